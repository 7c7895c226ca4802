"""Shared fixtures: real frontends, real wheels, a fresh runtime venv without hatch-aoti.

Compiling costs 10-25 s per model here, so each test project is built once per session
and every test that needs its wheel shares it.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCH_PIN = os.environ.get("HATCH_AOTI_TEST_TORCH", "torch==2.13.0")


def run(cmd: list[str], *, check: bool = True, **kwargs) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


#: The other torch release the index here serves (the CUDA build, about 3.8 GB with its nvidia-* wheels).
TORCH_NEXT = os.environ.get("HATCH_AOTI_TEST_TORCH_NEXT", "2.14.1")


#: Session fixtures cheap enough for each test process to make its own (under pytest-xdist). An
#: autouse one must be here: every test uses it, so it would put the whole suite in one group.
PER_PROCESS = frozenset(
    {"private_compile_cache", "wheelhouse", "build_env", "torch_venv", "runtime", "dev_venv", "tmp_session"}
    | {"s3_server", "private_tmpdir"}
)
GROUP = pytest.StashKey[str]()
NEXT_GROUPS = pytest.StashKey[set[str]]()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put test files that share a session fixture in one group: scripts/test.sh runs the suite in
    two processes (pytest-xdist, ``--dist loadgroup``), and a group runs in one of them, so that each
    shared wheel is still built, and torch 2.14.1 installed, once."""
    groups = shared_groups(items)
    for item in items:
        item.stash[GROUP] = groups[item.path.name]
        item.add_marker(pytest.mark.xdist_group(item.stash[GROUP]))
        if "torch_next_envs" in item.fixturenames:  # the torch window: installs torch 2.14.1, 3.8 GB
            item.add_marker(pytest.mark.heavy)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The groups whose tests need the other torch, among the tests left to run: one that ``-m`` left
    out installs nothing."""
    session.config.stash[NEXT_GROUPS] = {
        item.stash[GROUP] for item in session.items if "torch_next_envs" in item.fixturenames
    }


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Stop a run whose groups pytest-xdist lost (its 3.8 under pytest 9.2): each process would then
    build every shared wheel and install torch 2.14.1 again, twice the time and disk. Every test here
    has a group, so an id without one is lost."""
    if node.config.getvalue("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid.rpartition("]")[2]]
    if lost:
        pytest.exit(
            f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): install the pytest that "
            "pyproject.toml's test extra allows",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def shared_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each test file's group: the first file, by name, of those linked to it through a shared fixture."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for name in item.fixturenames if info else ():
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope == "session" and name not in PER_PROCESS and ours(defs[-1].func):
                parent[find(f"fixture {name}")] = find(item.path.name)
    files = sorted({item.path.name for item in items})
    first: dict[str, str] = {}
    for name in files:
        first.setdefault(find(name), name.removesuffix(".py"))
    return {name: first[find(name)] for name in files}


def ours(func: object) -> bool:
    """Whether a fixture is the suite's own, not pytest's or a plugin's."""
    return Path(inspect.getfile(func)).parent == REPO / "tests"  # type: ignore[arg-type]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start installing the other torch when the first test of the group that needs it starts: it
    takes minutes, mostly unpacking, and runs beside the builds of the tests before it."""
    if item.stash.get(GROUP, None) in item.config.stash.get(NEXT_GROUPS, set()):
        start_torch_next(item.config)


def start_torch_next(config: pytest.Config) -> None:
    if hasattr(config, "torch_next"):
        return
    root = Path(tempfile.mkdtemp(prefix="hatch-aoti-torch-next-"))
    env = root / f"torch-{TORCH_NEXT}"  # the layout `hatch-aoti verify --envs` uses again
    script = (
        f"import venv, subprocess, sys; venv.EnvBuilder(with_pip=True).create({str(env)!r}); "
        f"sys.exit(subprocess.call([{str(env / 'bin' / 'python')!r}, '-m', 'pip', 'install', '-q', "
        f"'torch=={TORCH_NEXT}']))"
    )
    log = (root / "install.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=log)
    config.torch_next = (root, proc)  # type: ignore[attr-defined]

    def stop() -> None:  # whatever happened to the session: no install left running, nothing left behind
        proc.kill()
        proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)

    config.add_cleanup(stop)


@pytest.fixture(scope="session")
def torch_next_envs(request: pytest.FixtureRequest) -> Path:
    """A directory holding ``torch-<TORCH_NEXT>/``, a venv with that torch (and nothing of ours)."""
    start_torch_next(request.config)  # started already by the group's first test, as a rule
    root, proc = request.config.torch_next
    status = proc.wait(timeout=1800)  # the session's cleanup kills it if this runs out
    assert status == 0, (root / "install.log").read_text(encoding="utf-8")[-4000:]
    return root


#: Every build in the session shares it, so that any two wheels of the same sources can be compared.
SOURCE_DATE_EPOCH = "1700000000"


@pytest.fixture(scope="session", autouse=True)
def private_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Builds in the tests use their own compile cache, never the user's."""
    root = tmp_path_factory.mktemp("compile-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HATCH_AOTI_CACHE_DIR", str(root))
        mp.setenv("SOURCE_DATE_EPOCH", SOURCE_DATE_EPOCH)
        mp.delenv("HATCH_AOTI_JOBS", raising=False)
        mp.delenv("HATCH_AOTI_NO_CACHE", raising=False)
        yield root


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What the tests' processes put in the temporary directory stays in the session's, which a
    passing run removes: Inductor's precompiled headers among it, over 100 MB for each torch install
    that compiles or loads a precompiled model, and each session's venvs are new installs. The
    processes of one run share it (under pytest-xdist, the parent of each one's directory); the test
    process itself uses it too (``hatch-aoti verify --import-package`` loads precompiled models there)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tmp"
    root.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(root))
        mp.setattr(tempfile, "tempdir", str(root))
        yield root


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hatch-aoti's own wheel, so isolated builds can install it from `PIP_FIND_LINKS`."""
    out = tmp_path_factory.mktemp("wheelhouse")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)])
    assert list(out.glob("hatch_aoti-*.whl"))
    return out


@pytest.fixture(scope="session")
def build_env(wheelhouse: Path, private_compile_cache: Path) -> dict[str, str]:
    """Environment for frontends: our wheelhouse first, existing find-links kept."""
    links = [str(wheelhouse), *filter(None, os.environ.get("PIP_FIND_LINKS", "").split())]
    env = {**os.environ, "PIP_FIND_LINKS": " ".join(links)}
    env.pop("PYTHONPATH", None)
    return env


@dataclass
class Runtime:
    """A fresh venv with torch but not hatch-aoti: what a wheel's user has."""

    python: Path

    def pip_install(self, *args: str) -> None:
        run([str(self.python), "-m", "pip", "install", "--no-index", "-q", *args])

    def run(self, code: str, *, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        return run([str(self.python), "-c", textwrap.dedent(code)], check=check, cwd=cwd or self.python.parent, env=env)

    def json(self, code: str) -> object:
        """Run ``code``, which must print one JSON document as its last line."""
        return json.loads(self.run(code).stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def torch_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with torch and numpy, installed once: the session's other venvs link to its files."""
    root = tmp_path_factory.mktemp("torch-venv")
    venv.EnvBuilder(with_pip=True).create(root)
    run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", TORCH_PIN, "numpy"])
    return root


def venv_with_torch(torch_venv: Path, root: Path) -> Path:
    """A new venv at ``root`` holding hard links to ``torch_venv``'s packages, pip and setuptools
    included (torch is about 1 GB: installing it again costs some 30 s here). Installing into it
    never changes ``torch_venv``: pip replaces files, it does not write into them."""
    venv.EnvBuilder(with_pip=False).create(root)
    (site,) = (torch_venv / "lib").glob("python3.*/site-packages")
    (target,) = (root / "lib").glob("python3.*/site-packages")

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:  # another file system
            shutil.copy2(src, dst)

    shutil.copytree(site, target, copy_function=link, dirs_exist_ok=True)
    return root / "bin" / "python"


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory, torch_venv: Path) -> Runtime:
    root = tmp_path_factory.mktemp("runtime-venv")
    python = venv_with_torch(torch_venv, root)
    probe = run(
        [str(python), "-c", "import importlib.util as u, torch, numpy; print(u.find_spec('hatch_aoti') is None)"],
        cwd=root,
    )
    assert probe.stdout.strip() == "True", "the runtime venv must not have hatch-aoti"
    return Runtime(python)


@pytest.fixture(scope="session")
def dev_venv(tmp_path_factory: pytest.TempPathFactory, torch_venv: Path) -> Path:
    """A venv with torch for editable installs (each test installs its own project into it)."""
    root = tmp_path_factory.mktemp("dev-venv")
    venv_with_torch(torch_venv, root)
    return root


def copy_project(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("dist", "build", "__pycache__", "*.egg-info"))
    return dest


#: Where each front end's users write the table.
TABLES = {"hatch": "tool.hatch.build.targets.wheel.hooks.aoti", "setuptools": "tool.hatch-aoti"}
BACKENDS = {
    "hatch": ('"hatchling", "hatch-aoti", "torch==2.13.*"', "hatchling.build"),
    "setuptools": ('"setuptools>=77", "hatch-aoti", "torch==2.13.*"', "setuptools.build_meta"),
}


def write_project(
    root: Path,
    name: str,
    hook_toml: str,
    files: dict[str, str],
    *,
    requires: str = "",
    src: bool = False,
    frontend: str = "hatch",
    torch: str = "torch==2.13.*",
) -> Path:
    """A minimal project whose package ``name`` (under ``src/`` if asked) holds ``files``.

    ``hook_toml`` is written with the hatch table's path; a setuptools project gets the
    same tables under ``[tool.hatch-aoti]``. A hatch project states ``torch`` in its
    dependencies (hatch-aoti requires it there); a setuptools one declares them dynamic and
    leaves torch to hatch-aoti.
    """
    default_requires, backend = BACKENDS[frontend]
    package = root / "src" / name if src else root / name
    package.mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = [{requires or default_requires}]
            build-backend = "{backend}"

            [project]
            name = "{name.replace("_", "-")}"
            version = "1.0"
            {f'dependencies = ["{torch}"]' if frontend == "hatch" else 'dynamic = ["dependencies"]'}
            """
        )
        + textwrap.dedent(hook_toml).replace(TABLES["hatch"], TABLES[frontend]),
        encoding="utf-8",
    )
    (package / "__init__.py").write_text("", encoding="utf-8")
    for rel, text in files.items():
        (package / rel).write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def build_no_isolation(
    project: Path, out: Path, *, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m build --wheel --no-isolation`` with this interpreter (hatch-aoti installed)."""
    return run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(project)],
        check=check,
        cwd=project,
        env=env,
    )


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("projects")


def debug_sections(library: Path) -> list[str]:
    """Names of a shared library's ``.debug_*`` sections."""
    from elftools.elf.elffile import ELFFile

    with library.open("rb") as f:
        return [s.name for s in ELFFile(f).iter_sections() if s.name.startswith(".debug_")]


@pytest.fixture(scope="session")
def sample_dists(tmp_path_factory: pytest.TempPathFactory, build_env: dict[str, str]) -> tuple[Path, Path]:
    project = copy_project(REPO / "sample_project", tmp_path_factory.mktemp("sample") / "sample_project")
    out = project / "dist"
    run([sys.executable, "-m", "build", "-o", str(out), str(project)], env=build_env, cwd=project)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


@pytest.fixture(scope="session")
def sample_installed(sample_dists: tuple[Path, Path], runtime: Runtime) -> Runtime:
    runtime.pip_install(str(sample_dists[1]))
    return runtime


# -- one wheel of every backend (tests/test_backends.py, tests/test_cli.py) ------------------

TOY = Path(__file__).with_name("toy_backend")

MIXED_MODELS = """
    import torch
    from torch import nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x, *, scale):
            y = self.lin(x) * scale
            return {"y": y, "norm": y.norm(dim=-1)}

    def scaled():
        torch.manual_seed(0)
        return Scaled()

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))
"""
MIXED_HOOK = """
    [tool.hatch.build.targets.wheel.hooks.aoti.models.fast]
    factory = "mixpkg.models:scaled"
    inputs = [{ shape = [2, 8] }]
    kwargs = { scale = { shape = [2, 1] } }
    inductor-configs = { "cpp.enable_kernel_profile" = true }  # for tests/test_cli.py

    [tool.hatch.build.targets.wheel.hooks.aoti.models.guarded]
    backend = "precompile"
    factory = "mixpkg.models:scaled"
    inputs = [{ shape = [2, 8] }]
    kwargs = { scale = { shape = [2, 1] } }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.batched]
    backend = "precompile"
    factory = "mixpkg.models:mlp"
    inputs = [{ shape = ["batch", 8] }]
    dynamic = { batch = { min = 2, max = 32 } }

    [tool.hatch.build.targets.wheel.hooks.aoti.models.plain]
    backend = "export"
    factory = "mixpkg.models:mlp"
    inputs = [{ shape = ["batch", 8] }]
    dynamic = { batch = { min = 1, max = 32 } }
"""


@pytest.fixture(scope="session")
def mixed_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One wheel, four models: aoti (with kernel profiling, for the CLI tests), precompile with kwargs,
    precompile with a dynamic batch, and the third-party ``export`` backend (tests/toy_backend, found
    through its entry point). Built with a temporary directory of its own (``<root>/tmp``), so that
    what it leaves there can be seen."""
    root = write_project(
        tmp_path_factory.mktemp("mixed") / "proj",
        "mixpkg",
        MIXED_HOOK,
        {"models.py": MIXED_MODELS},
        torch="torch==2.13.0",
    )  # precompiled models load only under the torch that built them
    (root / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": str(TOY), "HATCH_AOTI_JOBS": "2", "TMPDIR": str(root / "tmp")}
    proc = build_no_isolation(root, root / "dist", env=env)
    (wheel,) = (root / "dist").glob("*.whl")
    return wheel, proc.stderr


@pytest.fixture(scope="session")
def mixed_site(mixed_wheel: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("mixed-site")
    with zipfile.ZipFile(mixed_wheel[0]) as zf:
        zf.extractall(site)
    return site


# -- sample_project_setuptools (tests/test_setuptools.py, tests/test_torch_window.py) --------------------


@pytest.fixture(scope="session")
def setuptools_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_project(REPO / "sample_project_setuptools", tmp_path_factory.mktemp("st") / "sample_project_setuptools")


@pytest.fixture(scope="session")
def setuptools_dists(setuptools_project: Path, build_env: dict[str, str]) -> tuple[Path, Path, str]:
    """``python -m build``: the sdist, the wheel built from it, and the build's output."""
    out = setuptools_project / "dist"
    proc = run(
        [sys.executable, "-m", "build", "-o", str(out), str(setuptools_project)], env=build_env, cwd=setuptools_project
    )
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel, proc.stdout + proc.stderr


# -- a real S3 API on loopback (moto's server), for the compile cache's remote tier ------------


@dataclass
class S3:
    """moto's S3 server on 127.0.0.1; :meth:`bucket` makes an empty bucket for one test."""

    endpoint: str
    env: dict[str, str]
    counter: Iterator[int]

    @functools.cached_property
    def _client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
        )

    def client(self):  # type: ignore[no-untyped-def]
        return self._client

    def bucket(self) -> str:
        name = f"cache-{next(self.counter)}"
        self.client().create_bucket(Bucket=name)
        return name


def closed_port() -> str:
    """An endpoint on loopback where nothing listens: a store that is down."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3]:
    pytest.importorskip("s3fs")
    import itertools
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.devnull,  # nothing of this machine's own AWS setup
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    try:
        yield S3(endpoint, env, itertools.count())
    finally:
        server.stop()


@pytest.fixture()
def s3(s3_server: S3, monkeypatch: pytest.MonkeyPatch) -> S3:
    """The S3 server, with this process's AWS settings pointing at it for the test."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return s3_server
