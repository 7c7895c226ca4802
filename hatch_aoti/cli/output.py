"""How commands print: rich tables and progress on a terminal, plain aligned text when piped, JSON with ``--json``."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class Output:
    def __init__(self, as_json: bool) -> None:
        from rich.console import Console

        self.json = as_json
        self.terminal = sys.stdout.isatty() and not as_json
        # Piped: no colour, and wide enough that a sha256 column is not wrapped.
        self.console = Console(highlight=False, width=None if self.terminal else 200, soft_wrap=not self.terminal)

    def line(self, text: str = "", style: str | None = None) -> None:
        if not self.json:
            self.console.print(text, style=style, markup=False)

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
        if self.json:
            return
        from rich import box
        from rich.table import Table

        table = Table(
            *columns,
            title=title,
            title_justify="left",
            box=box.SIMPLE_HEAD if self.terminal else None,
            show_edge=False,
            pad_edge=False,
            highlight=False,
        )
        from rich.text import Text

        for row in rows:
            table.add_row(*(Text(str(cell)) for cell in row))  # Text: a cell's "[4, 128]" is not markup
        self.console.print(table)

    def data(self, value: Any) -> None:
        """The command's result as one JSON document (``--json`` only)."""
        if self.json:
            print(json.dumps(value, indent=2, sort_keys=False, default=str))

    @contextlib.contextmanager
    def progress(self, total: int, description: str) -> Iterator[Callable[[str], None]]:
        """A progress bar on a terminal; ``step(text)`` advances it. Nothing when piped."""
        if not self.terminal:
            yield lambda text: None
            return
        from rich.progress import Progress

        with Progress(console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda text: bar.update(task, advance=1, description=f"{description}: {text}")


def human_size(size: int | None) -> str:
    from hatch_aoti.store.cache import human

    return "?" if size is None else human(size)
