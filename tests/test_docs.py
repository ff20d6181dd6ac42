"""The documentation's shape (issue 52): the README is the user's path (at most 150 lines), no page of docs/ is over 400
lines, prose lines stay within 120 characters (headings, tables, generated evidence pages and the committed
pre-registration aside), and every relative link of the README and docs/ names a file or folder that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_at_most_150_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_page_is_at_most_400_lines_of_short_prose(page):
    lines = page.read_text().splitlines()
    assert len(lines) <= 400
    if "evidence" in page.relative_to(ROOT).parts:
        return  # generated from records: tables and figure rows as the report writes them
    fenced = False
    for number, line in enumerate(lines, 1):
        if line.startswith("## 11. Pre-registration"):
            break  # experiments.md's pre-registration stays as it was committed before its runs
        fenced ^= line.startswith("```")
        if not fenced and not line.startswith(("|", "#")):
            assert len(line) <= 120, f"{page.name}:{number}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_relative_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)}: {target}"
