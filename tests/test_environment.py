"""The environment variables' reference (hatch_aoti/settings/environment.py) against the sources: every
``HATCH_AOTI_*`` name the code, the tests, the scripts or the docs use is listed, and every listed
variable is read where the list says."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

from hatch_aoti.settings.environment import VARIABLES, Variable

NAME = re.compile(r"HATCH_AOTI_[A-Z0-9_]+")
#: Where each reader's code is (the loader is the package every wheel gets a copy of).
READERS = {
    "build": ["hatch_aoti/**/*.py"],
    "CLI": ["hatch_aoti/**/*.py"],
    "loader": ["hatch_aoti/loader/*.py"],
    "tests": ["tests/**/*.py"],
    "scripts": ["scripts/*.sh", "scripts/*.py", ".ci/run"],
}
DOCS = ["docs/*.md", "README.md", "CONTRIBUTING.md"]
BENCHMARKS = ["benchmarks/**/*.py", "benchmarks/*.sh"]


def text(patterns: list[str]) -> dict[Path, str]:
    files = {path for pattern in patterns for path in REPO.glob(pattern) if path.is_file()}
    return {path: path.read_text(encoding="utf-8") for path in sorted(files)}


def listed(found: str) -> Variable | None:
    return next((variable for variable in VARIABLES if variable.matches(found)), None)


def test_every_name_used_anywhere_is_listed() -> None:
    everywhere = [pattern for patterns in READERS.values() for pattern in patterns] + DOCS + BENCHMARKS
    unlisted = {
        f"{name} ({path.relative_to(REPO)})"
        for path, source in text(everywhere).items()
        for name in NAME.findall(source)
        if listed(name) is None
    }
    assert not unlisted, f"add them to hatch_aoti/settings/environment.py: {sorted(unlisted)}"


def test_every_listed_variable_is_read_where_the_list_says() -> None:
    sources = {reader: "\n".join(text(patterns).values()) for reader, patterns in READERS.items()}
    for variable in VARIABLES:
        stem = variable.name.removesuffix("<MODEL>").removesuffix("*")
        if variable.group == "others":  # read by torch, pip or hatchling: named by the code or tests that rely on it
            where = [reader for reader in READERS if stem in sources[reader]]
        else:
            where = [reader for reader in variable.read_by if stem in sources[reader]]
        assert where, f"{variable.name} is in no source of {', '.join(variable.read_by)}: drop it from the list"
        assert len(where) == len(variable.read_by) or variable.group == "others", (variable.name, where)


def test_each_variable_says_what_it_does_in_one_sentence() -> None:
    for variable in VARIABLES:
        assert variable.meaning and not variable.meaning.endswith(".") and "\n" not in variable.meaning, variable.name
        assert variable.read_by and variable.default, variable.name
        page = variable.doc.split("#")[0]
        assert not page or (REPO / "docs" / page).resolve().is_file(), (variable.name, variable.doc)
    names = [variable.name for variable in VARIABLES]
    assert len(names) == len(set(names)), "each variable once"
