"""The README's configuration reference, generated from the settings classes in ``config.py``.

``python -m hatch_aoti.settings.docs`` prints the tables; ``--write`` puts them into README.md
between their markers. A test checks that the README matches.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hatch_aoti.settings.config import DimSpec, ModelTable, Table, TensorSpec, reference

TABLES = {"config:table": Table, "config:model": ModelTable, "config:input": TensorSpec, "config:dim": DimSpec}


def markdown(cls: type) -> str:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| {key} | {default} | {doc} |" for key, default, doc in reference(cls)]
    return "\n".join(rows) + "\n"


def reference_tables() -> dict[str, str]:
    return {marker: markdown(cls) for marker, cls in TABLES.items()}


def write(readme: Path) -> None:
    text = readme.read_text(encoding="utf-8")
    for marker, table in reference_tables().items():
        start, end = f"<!-- {marker} -->\n", f"<!-- /{marker} -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        if not rest:
            raise SystemExit(f"{readme} has no {start.strip()} marker")
        text = f"{head}{start}{table}{end}{tail}"
    readme.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write(Path(sys.argv[-1]) if sys.argv[-1].endswith(".md") else Path("README.md"))
    else:
        for marker, table in reference_tables().items():
            print(f"{marker}:\n{table}")
