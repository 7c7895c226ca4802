"""Entry point: registers the ``aoti`` build hook with hatchling."""

from __future__ import annotations

from hatchling.plugin import hookimpl

from hatch_aoti.frontends.hatch import AotiBuildHook


@hookimpl
def hatch_register_build_hook() -> type[AotiBuildHook]:
    return AotiBuildHook
