"""Every relative link in the docs leads somewhere.

The docs live in ``docs/guide/``, ``docs/operations/`` and ``docs/internals/``;
a page that is moved or split must take its links along. This reads
``README.md``, every ``docs/**/*.md`` and ``bench/RESULTS.md``, and checks that each
relative markdown link (``[text](path)``, ``![alt](path)``, ``[text](path#anchor)``,
``[text](#anchor)``) names an existing file, and that an anchor into a markdown
file names one of its headings (GitHub's slugs). Links inside code are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.processes import ROOT

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INDENTED = re.compile(r"(?:^(?: {4}|\t).*\n?)+", re.M)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench" / "RESULTS.md"]


def prose(text: str) -> str:
    """Return the text without fenced code, indented code and inline code."""
    text = FENCE.sub("", text)
    text = INDENTED.sub("", text)
    return INLINE_CODE.sub("", text)


def slug(heading: str) -> str:
    """Return GitHub's anchor for a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(prose(path.read_text()))


def test_the_pages_exist_and_have_links():
    checked = pages()
    assert all(p.exists() for p in checked)
    assert sum(len(links(p)) for p in checked) > 50     # the parser finds the links at all


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):          # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slugs_follow_githubs_rule():
    assert slug("The lease: a lock bounded on both sides") == "the-lease-a-lock-bounded-on-both-sides"
    assert slug("5. SIGTERM, as Heroku sends it") == "5-sigterm-as-heroku-sends-it"
    assert slug("Task states: what Flower and `celery events` show") == (
        "task-states-what-flower-and-celery-events-show")
    assert slug("1-3. Postgres restarts and cut connections") == "1-3-postgres-restarts-and-cut-connections"
