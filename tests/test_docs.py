"""The documentation holds together: every relative link in README.md and docs/ reaches
an existing file (and its #anchor a heading there), no page points outside the
repository, and the README stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation other than '-' and ' '
    dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(page: Path) -> list[str]:
    """Link targets outside code blocks and inline code."""
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text()))
    return LINK.findall(text)


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The page's relative links that reach no file, or no heading of it."""
    problems = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no file {file}")
        elif root not in file.parents:
            problems.append(f"{target}: outside the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading '#{anchor}' in {file.relative_to(root)}")
    return problems


def test_the_pages_exist():
    assert (ROOT / "docs" / "README.md").exists()
    assert len(PAGES) > 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_path_outside_the_repository(page):
    text = page.read_text()
    assert "../shared" not in text and "/work/" not in text


def test_every_docs_page_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / link.partition("#")[0]).resolve() for link in links(index)}
    pages = {p.resolve() for p in PAGES if p.parent != ROOT and p != index}
    assert pages - listed == set()


def test_the_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    assert "make demo" in readme and "make test" in readme and "## Layout" in readme


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## Some section: here\n\n## Twice\n\n## Twice\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "b.md"
    page.write_text(
        "[ok](../a.md) [ok](../a.md#some-section-here) [ok](../a.md#twice-1) [url](https://example.org/x)\n"
        "[self](#a-heading)\n\n# A heading\n\n`[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](../a.md#nowhere) [out](../../elsewhere.md)\n"
    )
    (tmp_path.parent / "elsewhere.md").write_text("# outside\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(":")[0] for p in problems] == ["missing.md", "../a.md#nowhere", "../../elsewhere.md"]
    assert "no file" in problems[0] and "no heading '#nowhere'" in problems[1] and "outside" in problems[2]


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
REPO_PATH = re.compile(r"\b(?:docs|tools|configs|omni_rl|examples|tests)/[\w./-]*\w\.(?:md|py|yaml|sh)\b")


def named_paths(text: str) -> list[str]:
    """The repository files a text names by path (docs/..., tools/..., configs/...)."""
    return REPO_PATH.findall(text)


def test_the_path_check_finds_a_missing_file():
    text = "# see docs/results/pi0-memory.md and docs/results/nowhere.md; run tools/gpu_check.sh.\n"
    assert named_paths(text) == ["docs/results/pi0-memory.md", "docs/results/nowhere.md", "tools/gpu_check.sh"]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_file_a_config_names_exists(config):
    """A shipped config's header points users at docs and tools: each must be there."""
    missing = [path for path in named_paths(config.read_text()) if not (ROOT / path).exists()]
    assert missing == []
