"""The suite's split over two processes (tests/conftest.py): test files that share a session fixture
run in one process, so that each shared wheel is built once."""

from __future__ import annotations

import conftest
from _pytest.fixtures import getfixturemarker


def test_no_fixture_every_test_uses_puts_the_suite_in_one_group() -> None:
    """An autouse session fixture links every test file to every other: the second process would sit
    idle and the suite take twice as long."""
    autouse = set()
    for name, obj in vars(conftest).items():
        marker = getfixturemarker(obj)
        if marker is not None and marker.autouse and marker.scope == "session":
            autouse.add(marker.name or name)
    assert autouse, "tests/conftest.py has no autouse session fixture: this test no longer checks anything"
    assert autouse <= conftest.PER_PROCESS, f"made once for the whole suite: {sorted(autouse - conftest.PER_PROCESS)}"
