"""The package's layout by process: what the build backend imports never reaches torch or the worker,
and no module imports itself back through others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hatch_aoti"
#: Run inside the build backend's process (hatchling's or setuptools'): torch must never be imported there.
TORCH_FREE = (
    "hatch_aoti.pipeline",
    "hatch_aoti.frontends",
    "hatch_aoti.settings",
    "hatch_aoti.store",
    "hatch_aoti.hooks",
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, *, top_level_only: bool = False, type_checking: bool = False) -> set[str]:
    """What a module imports (the modules, not the names), at any depth of its code or at module level only;
    ``type_checking`` counts the imports of ``if TYPE_CHECKING:`` blocks too, which never run but tie the
    modules together all the same (for readers and type checkers)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    if top_level_only:  # `if TYPE_CHECKING:` blocks never run
        nodes = [n for n in nodes if not (isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test))]
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= submodules  # `from pkg import module`: the module (its package is a parent, not a peer)
            if len(submodules) < len(node.names):
                found.add(node.module)
    if not top_level_only and not type_checking:
        found -= _type_checking_only(tree)
    return found


def _type_checking_only(tree: ast.Module) -> set[str]:
    blocks = [n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    return {
        imp
        for block in blocks
        for node in ast.walk(block)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for imp in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        )
    }


def reached_from(start: str) -> dict[str, str]:
    """Every module reachable from ``start``, each with the module that imports it. A backend module is
    followed through its module-level imports only: the build backend calls its ``check`` and ``pins``,
    the worker its ``compile``, which imports torch."""
    seen, todo = {start: ""}, [start]
    while todo:
        current = todo.pop()
        lazy_ok = current.startswith("hatch_aoti.backends.") and current != "hatch_aoti.backends.interface"
        for imported in imports(current, top_level_only=lazy_ok):
            if imported not in seen:
                seen[imported] = current
                if imported in MODULES:
                    todo.append(imported)
    return seen


@pytest.mark.parametrize("start", sorted(m for m in MODULES if m.startswith(TORCH_FREE)))
def test_the_build_backend_never_reaches_torch_or_the_worker(start: str) -> None:
    reached = reached_from(start)
    bad = sorted(m for m in reached if m.split(".")[0] == "torch" or m.startswith("hatch_aoti.worker"))
    chains = []
    for module in bad:
        chain, at = [module], module
        while reached[at]:
            at = reached[at]
            chain.append(at)
        chains.append(" <- ".join(chain))
    assert not chains, "\n".join(chains)


def import_graph() -> dict[str, set[str]]:
    """Each module's imports within the package: lazy ones and ``TYPE_CHECKING`` ones included."""
    return {name: {m for m in imports(name, type_checking=True) if m in MODULES and m != name} for name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other back, of any length: the strongly connected
    components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest way from the group's first module back to itself, inside the group, for the message."""
    start, inside = members[0], set(members)
    paths = {nxt: [start, nxt] for nxt in sorted(graph[start] & inside)}
    todo = list(paths)
    while start not in paths:
        node = todo.pop(0)
        for nxt in sorted(graph[node] & inside):
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                todo.append(nxt)
    return paths[start]


def test_the_circle_search_finds_circles_of_any_length() -> None:
    ring = {f"m{i}": {f"m{(i + 1) % 20}"} for i in range(20)}
    assert circles({**ring, "x": {"m0"}, "y": set()}) == [sorted(ring)]
    assert one_cycle(ring, sorted(ring))[0] == one_cycle(ring, sorted(ring))[-1] == "m0"
    assert len(one_cycle(ring, sorted(ring))) == 21
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back() -> None:
    """Through any number of others, ``TYPE_CHECKING`` imports and imports inside functions counted."""
    graph = import_graph()
    found = [f"{' -> '.join(one_cycle(graph, group))} (all of {', '.join(group)})" for group in circles(graph)]
    assert not found, "\n".join(found)


def test_the_settings_and_the_backend_interface_stand_apart_from_their_users() -> None:
    """The settings name nothing of the backends (their registry is the settings' own), and the public
    backend interface nothing of the worker, whose modules import torch: ``TYPE_CHECKING`` imports and
    imports inside functions counted."""
    graph = import_graph()

    def reached(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    for name in (m for m in MODULES if m.startswith("hatch_aoti.settings")):
        assert not {m for m in reached(name) if m.startswith("hatch_aoti.backends")}, name
    assert not {m for m in reached("hatch_aoti.backends.interface") if m.startswith("hatch_aoti.worker")}


def test_the_front_ends_import_without_torch() -> None:
    """What the AST test promises, seen in a real process: the hooks and the pipeline leave torch unimported."""
    code = (
        "import sys, hatch_aoti.hooks, hatch_aoti.frontends.setuptools, hatch_aoti.pipeline.core, "
        "hatch_aoti.settings.docs, hatch_aoti.backends; [hatch_aoti.backends.get(n) for n in ('aoti', 'precompile')]; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hatch_aoti') and "
        "(m.startswith('torch') or m.startswith('hatch_aoti.worker'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_hatch_aotis_own_wheel_holds_every_module_and_template(wheelhouse: Path) -> None:
    """What the build backend imports must be in the wheel it is installed from (hatchling honours
    ``.gitignore``: a package named like its ``build/`` rule would be left out)."""
    import zipfile

    (wheel,) = wheelhouse.glob("hatch_aoti-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py")}
    wanted |= {f"hatch_aoti/templates/{p.name}" for p in (PACKAGE.parent / "templates").glob("*.py")}
    assert wanted <= names, sorted(wanted - names)


LOADER = PACKAGE / "loader"


def loader_imports(module: Path, *, top_level_only: bool = False) -> tuple[set[str], set[str]]:
    """The loader module's imports: (absolute top-level names, sibling modules imported relatively)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    absolute: set[str] = set()
    siblings: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            absolute |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            siblings |= {node.module} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            absolute.add(node.module.split(".")[0])
    return absolute, siblings & {p.stem for p in LOADER.glob("*.py")}


def test_the_loader_needs_only_torch_and_the_standard_library() -> None:
    """The loader ships in every wheel, where hatch-aoti is not installed: its modules import torch, the
    standard library and each other (relatively, so that they work under any package name)."""
    allowed = set(sys.stdlib_module_names) | {"torch", "__future__"}
    found = {m.name: sorted(loader_imports(m)[0] - allowed) for m in LOADER.glob("*.py")}
    assert {name: bad for name, bad in found.items() if bad} == {}


def test_the_loader_imports_its_modules_without_its_parent_package() -> None:
    """``from . import module`` imports the loader's parent package first (``__import__`` returns the top
    one), which ``hatch-aoti`` must not run and which a wheel extracted elsewhere cannot import; ``from
    .module import name`` imports the module alone."""
    modules = {p.stem for p in LOADER.glob("*.py")}
    found = {
        m.name: node.lineno
        for m in LOADER.glob("*.py")
        for node in ast.walk(ast.parse(m.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom)
        and node.level
        and not node.module
        and {a.name for a in node.names} & modules
    }
    assert found == {}


def test_the_loader_imports_a_feature_only_where_a_model_uses_it() -> None:
    """Importing the loader and loading an AOTInductor model with shipped weights reaches neither the
    fetch code, nor precompile's run time, nor torch's fallback runner; and the modules form no circle."""
    graph = {m.stem: loader_imports(m, top_level_only=True)[1] for m in LOADER.glob("*.py")}
    reached, todo = set(), ["__init__", "engine", "calls"]  # load() imports engine and calls
    while todo:
        current = todo.pop()
        if current not in reached:
            reached.add(current)
            todo += graph[current]
    assert reached.isdisjoint({"external", "fetcher", "precompile", "pt2"}), sorted(reached)
    everything = {m.stem: loader_imports(m)[1] for m in LOADER.glob("*.py")}
    for start in everything:
        seen, todo = set(), list(everything[start])
        while todo:
            current = todo.pop()
            assert current != start, f"the loader's {start} imports itself back"
            if current not in seen:
                seen.add(current)
                todo += everything[current]
