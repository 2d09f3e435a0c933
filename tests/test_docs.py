"""The documentation holds together: a short README in a fixed order, docs/ pages, and relative links
(and images) in README.md, docs/*.md and reports/**/README.md that all point at files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the README's sections, in this order: a heading matches when it starts with the text (case-insensitive)
README_SECTIONS = [
    "what has been verified",
    "install",
    "audit your server in 5 minutes",
    "precision flags and cost",
    "reading the result",
    "what a server audit cannot detect",
    "speculative against plain",
    "your own engine and ci",
    "glossary",
    "architecture",
    "the two set-up commands",
    "links",
]

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def documentation_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "reports").rglob("README.md"))]


def relative_links(markdown: str) -> list[str]:
    """Every link or image target that is not a URL, a mail address or a bare anchor, without its anchor."""
    text = INLINE_CODE.sub("", FENCE.sub("", markdown))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def broken_links(root: Path) -> list[str]:
    broken = []
    for path in documentation_files(root):
        for target in relative_links(path.read_text(encoding="utf-8")):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(root)}: {target}")
    return broken


def section_order(readme: str) -> list[str]:
    """The README's second-level headings, outside code blocks, lower-cased."""
    text = FENCE.sub("", readme)
    return [line[3:].strip().lower() for line in text.splitlines() if line.startswith("## ")]


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_docs_has_pages() -> None:
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 5, pages


def test_every_relative_link_resolves() -> None:
    assert (ROOT / "docs").is_dir()
    assert broken_links(ROOT) == []


def test_readme_sections_in_order() -> None:
    headings = section_order((ROOT / "README.md").read_text(encoding="utf-8"))
    positions = []
    for section in README_SECTIONS:
        found = [i for i, heading in enumerate(headings) if heading.startswith(section)]
        assert found, f"README.md has no section '{section}' (headings: {headings})"
        positions.append(found[0])
    assert positions == sorted(positions), f"README.md sections out of order: {headings}"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "reports" / "x").mkdir(parents=True)
    (tmp_path / "docs" / "page.md").write_text("[ok](../README.md#top) ![chart](missing.svg)\n", encoding="utf-8")
    (tmp_path / "reports" / "x" / "README.md").write_text("[gone](../nothing.md) `[code](not-a-link.md)`\n",
                                                          encoding="utf-8")
    (tmp_path / "README.md").write_text("[page](docs/page.md) [web](https://example.org/a.md) [here](#top)\n"
                                        "```\n[in code](nowhere.md)\n```\n", encoding="utf-8")
    assert broken_links(tmp_path) == ["docs/page.md: missing.svg", "reports/x/README.md: ../nothing.md"]


@pytest.mark.parametrize("headings, in_order", [
    (README_SECTIONS, True),
    ([README_SECTIONS[1], README_SECTIONS[0], *README_SECTIONS[2:]], False),
])
def test_section_order_check(headings: list[str], in_order: bool) -> None:
    readme = "# specaudit\n\n" + "\n\n".join(f"## {h.capitalize()}\n\ntext" for h in headings)
    found = section_order(readme)
    positions = [next(i for i, h in enumerate(found) if h.startswith(s)) for s in README_SECTIONS]
    assert (positions == sorted(positions)) is in_order
