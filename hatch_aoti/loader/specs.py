"""The call specs (torch's pytree) of a model's inputs and outputs, as the manifest stores them."""

from __future__ import annotations

import importlib
import json
from typing import Any


def treespec(pytree: Any, name: str, text: str) -> Any:
    """A call spec. Containers from other libraries (transformers' ``ModelOutput`` classes) are known
    to torch only once their module is imported, as the model's own code did; so import it first."""
    try:
        return pytree.treespec_loads(text)
    except NotImplementedError:  # a container type that is not registered yet
        pass
    modules = sorted(_spec_modules(json.loads(text)[1]))
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise RuntimeError(
                f"compiled model {name!r} takes or returns containers defined in {module!r}, which cannot be "
                f"imported here ({exc}); install the package that provides it"
            ) from None
    try:
        return pytree.treespec_loads(text)
    except NotImplementedError as exc:
        raise RuntimeError(
            f"compiled model {name!r} takes or returns a container type that torch does not know here, even "
            f"after importing {modules or 'its modules'}: {exc}"
        ) from None


def _spec_modules(node: dict[str, Any]) -> set[str]:
    """The modules of a serialized spec's container types, but the standard ones."""
    found = {node["type"].rpartition(".")[0]} if node.get("type") else set()
    for child in node.get("children_spec") or []:
        found |= _spec_modules(child)
    return found - {"builtins", "collections"}


def children(spec: Any) -> list[Any]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)
