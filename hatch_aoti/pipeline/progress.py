"""The build's progress as its output shows it: ``[k/N]`` for each model and stage, and a last line with
the totals.

Made in the build backend from the coordinator's events (``protocol.py``): ``k`` is the model's place
among the build's models (their order in the table), so that a model's lines are found by its number
while the models compile in parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: What a model's line says while it is in each of the coordinator's stages.
STAGES = {
    "check": "checking",
    "export": "exporting",
    "compile": "compiling",
    "verify": "verifying against eager",
    "tune": "timing its candidates",
    "store": "storing in the cache",
}


@dataclass
class Progress:
    """Where the build is, model by model, and what came from the cache."""

    models: list[str]
    """The build's models, in the table's order."""
    shown: set[tuple[str, str]] = field(default_factory=set)
    """(model, stage) pairs already said: a tuned model enters a stage once per candidate."""
    cached: dict[str, str] = field(default_factory=dict)
    """Models that came from the cache, and from which tier (``local`` or ``remote``)."""
    compiled: set[str] = field(default_factory=set)

    def at(self, model: str) -> str:
        """``[k/N] model``: the model (or its variant, ``name@bfloat16``) with its place among the build's."""
        base = model.partition("@")[0]
        place = self.models.index(base) + 1 if base in self.models else "?"
        return f"[{place}/{len(self.models)}] {model}"

    def entered(self, model: str, stage: str) -> str | None:
        """The line for a model entering a stage; ``None`` where it has entered it before."""
        if (model, stage) in self.shown:
            return None
        self.shown.add((model, stage))
        return f"aoti: {self.at(model)}: {STAGES.get(stage, stage)}"

    def came(self, model: str, tier: str | None) -> None:
        """A model is done: from the cache's ``tier``, or compiled (``None``)."""
        self.failed(model)
        if tier is None:
            self.compiled.add(model)
        else:
            self.cached[model] = tier

    def failed(self, model: str) -> None:
        self.cached.pop(model, None)
        self.compiled.discard(model)

    def summary(self, seconds: float) -> str:
        """The build's last line: ``aoti: 3 models in 41.2s (2 from the cache, 1 compiled)``."""
        count = len(self.models)
        remote = sum(tier == "remote" for tier in self.cached.values())
        parts = [
            f"{len(self.cached) - remote} from the cache" if len(self.cached) > remote else "",
            f"{remote} from the remote cache" if remote else "",
            f"{len(self.compiled)} compiled" if self.compiled else "",
        ]
        said = ", ".join(part for part in parts if part)
        variants = {*self.cached, *self.compiled}
        if said and any("@" in v for v in variants):  # counted by variant, not by model
            said = f"{len(variants)} variants: {said}"
        return f"aoti: {count} model{'s' if count != 1 else ''} in {seconds:.1f}s" + (f" ({said})" if said else "")
