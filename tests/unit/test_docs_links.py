"""The README and the pages of docs/ link to each other and nowhere that does not exist: the
README's map links every page, every page links back to the README, and every relative link
(`../examples/…`, `tracking.md#the-run-report`) reaches a file and, where it names one, a heading
of it. A section moved or renamed without its links fails here."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from helpers import docs_generator

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
GENERATOR = docs_generator()  # the anchors its page links to are GitHub's, as here


def prose(page: Path) -> str:
    """A page without its fenced code blocks and code spans, where a `[a](b)` is no link."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(page))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, and a repeated one numbered (`job`, `job-1`)."""
    seen: Counter[str] = Counter()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} (.+)$", text, re.M)
    return {GENERATOR.numbered(GENERATOR.anchor(heading), seen) for heading in headings}


RELATIVE = [
    (page, target)
    for page in PAGES
    for target in links(page)
    if not re.match(r"[a-z]+:", target)  # https:, mailto:
]


def test_the_readme_links_every_page_and_every_page_links_back():
    assert DOCS, "docs/ has no pages"
    readme_links = {target.partition("#")[0] for target in links(README)}
    assert [page.name for page in DOCS if f"docs/{page.name}" not in readme_links] == []
    for page in DOCS:
        assert any(t.partition("#")[0] == "../README.md" for t in links(page)), page.name


@pytest.mark.parametrize(
    ("page", "target"),
    RELATIVE,
    ids=[f"{page.relative_to(ROOT).as_posix()}: {target}" for page, target in RELATIVE],
)
def test_a_relative_link_reaches_a_file_and_its_heading(page, target):
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    assert linked.exists(), f"{page.name} links {target}: no such file"
    if anchor:
        assert linked.suffix == ".md", f"{page.name} links {target}: an anchor into a non-page"
        assert anchor in anchors(linked), f"{page.name} links {target}: no such heading"
