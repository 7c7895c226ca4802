"""The backends' names: their entry-point group, hatch-aoti's own, and those installed.

Read without importing any backend (nor the backend interface), so that the reader checks a
table's ``backend`` in the build backend's process; :mod:`hatch_aoti.backends` loads them.
"""

from __future__ import annotations

import importlib.metadata

GROUP = "hatch_aoti.backends"
BUILTIN = ("aoti", "precompile")
DEFAULT = "aoti"


def known() -> list[str]:
    """Names of the installed backends, without importing them."""
    names = {ep.name for ep in importlib.metadata.entry_points(group=GROUP)}
    return [*BUILTIN, *sorted(names - set(BUILTIN))]
