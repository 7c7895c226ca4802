"""The configuration reference and the JSON schema, generated from the settings classes in ``model.py``;
the environment variables' reference, from ``environment.py``.

``python -m hatch_aoti.settings.docs`` prints the tables; ``--write`` puts them into
``docs/configuration.md`` and ``docs/environment.md`` between their markers and writes
``docs/hatch-aoti.schema.json``. A test checks that all three match.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hatch_aoti.settings.environment import GROUPS
from hatch_aoti.settings.environment import reference as environment_reference
from hatch_aoti.settings.model import AccuracySpec, DimSpec, ModelTable, Table, TensorSpec
from hatch_aoti.settings.reader import reference
from hatch_aoti.settings.schema import tool_schema

TABLES = {
    "config:table": Table,
    "config:model": ModelTable,
    "config:input": TensorSpec,
    "config:dim": DimSpec,
    "config:accuracy": AccuracySpec,
}
PAGE = Path("docs/configuration.md")
SCHEMA = Path("docs/hatch-aoti.schema.json")
ENV_PAGE = Path("docs/environment.md")


def markdown(cls: type) -> str:
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| {key} | {default} | {doc} |" for key, default, doc in reference(cls)]
    return "\n".join(rows) + "\n"


def reference_tables() -> dict[str, str]:
    return {marker: markdown(cls) for marker, cls in TABLES.items()}


def environment_tables() -> dict[str, str]:
    tables = {}
    for group, marker in GROUPS.items():
        rows = ["| variable | read by | default | meaning |", "| --- | --- | --- | --- |"]
        rows += [
            f"| {name} | {readers} | {default} | {meaning} |"
            for name, readers, default, meaning in environment_reference(group)
        ]
        tables[marker] = "\n".join(rows) + "\n"
    return tables


def schema_text() -> str:
    return json.dumps(tool_schema(), indent=2) + "\n"


def write(page: Path) -> None:
    fill(page, reference_tables())
    fill(page.parent / ENV_PAGE.name, environment_tables())
    (page.parent / SCHEMA.name).write_text(schema_text(), encoding="utf-8")


def fill(page: Path, tables: dict[str, str]) -> None:
    """Put each table between its markers in ``page``."""
    text = page.read_text(encoding="utf-8")
    for marker, table in tables.items():
        start, end = f"<!-- {marker} -->\n", f"<!-- /{marker} -->"
        head, _, rest = text.partition(start)
        _, _, tail = rest.partition(end)
        if not rest:
            raise SystemExit(f"{page} has no {start.strip()} marker")
        text = f"{head}{start}{table}{end}{tail}"
    page.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    if "--write" in sys.argv:
        write(Path(sys.argv[-1]) if sys.argv[-1].endswith(".md") else PAGE)
    else:
        for marker, table in {**reference_tables(), **environment_tables()}.items():
            print(f"{marker}:\n{table}")
