"""The configuration reference and the JSON schema, generated from the settings classes in ``model.py``.

``python -m hatch_aoti.settings.docs`` prints the tables; ``--write`` puts them into
``docs/configuration.md`` between their markers and writes ``docs/hatch-aoti.schema.json``.
A test checks that both match.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hatch_aoti.settings.model import DimSpec, ModelTable, Table, TensorSpec
from hatch_aoti.settings.reader import reference
from hatch_aoti.settings.schema import tool_schema

TABLES = {"config:table": Table, "config:model": ModelTable, "config:input": TensorSpec, "config:dim": DimSpec}
PAGE = Path("docs/configuration.md")
SCHEMA = Path("docs/hatch-aoti.schema.json")


def markdown(cls: type) -> str:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| {key} | {default} | {doc} |" for key, default, doc in reference(cls)]
    return "\n".join(rows) + "\n"


def reference_tables() -> dict[str, str]:
    return {marker: markdown(cls) for marker, cls in TABLES.items()}


def schema_text() -> str:
    return json.dumps(tool_schema(), indent=2) + "\n"


def write(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for marker, table in reference_tables().items():
        start, end = f"<!-- {marker} -->\n", f"<!-- /{marker} -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        if not rest:
            raise SystemExit(f"{page} has no {start.strip()} marker")
        text = f"{head}{start}{table}{end}{tail}"
    page.write_text(text, encoding="utf-8")
    (page.parent / SCHEMA.name).write_text(schema_text(), encoding="utf-8")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write(Path(sys.argv[-1]) if sys.argv[-1].endswith(".md") else PAGE)
    else:
        for marker, table in reference_tables().items():
            print(f"{marker}:\n{table}")
