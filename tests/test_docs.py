"""The documentation's relative links: every file and section a page links to exists."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

PAGES = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/*.md", "benchmarks/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The section anchors GitHub makes of a page's headings."""
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            base, n = slug, 0
            while slug in found:
                n += 1
                slug = f"{base}-{n}"
            found.add(slug)
    return found


def test_every_relative_link_resolves() -> None:
    pages = sorted({path for pattern in PAGES for path in REPO.glob(pattern)})
    broken = []
    for page in pages:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            if not where.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in anchors(where):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such section)")
    assert pages and not broken, "\n".join(broken)
