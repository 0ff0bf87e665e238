"""The README is the landing page and docs/ holds one page per topic: every relative link in them resolves.

`mkdocs build --strict` (CI) checks the links between docs/ pages as the site renders them; these tests check
the same links as GitHub renders them, and the README's, which is not part of the site.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _prose(text: str, keep_code_spans: bool = False) -> list[str]:
    """The lines of a Markdown file outside fenced code blocks, inline code spans removed unless kept."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line if keep_code_spans else re.sub(r"`[^`]*`", "", line))
    return lines


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text lowercased, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading id of a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    ids = set()
    for line in _prose(path.read_text(encoding="utf-8"), keep_code_spans=True):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            ids.add(base if count == 0 else f"{base}-{count}")
    return ids


def broken_links(path: Path) -> list[str]:
    """The relative links of a Markdown file whose target file, folder or heading does not exist."""
    broken = []
    for line in _prose(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{path.name}: {target} (no such heading)")
    return broken


def doc_pages(root: Path = ROOT) -> list[Path]:
    return sorted((root / "docs").rglob("*.md"))


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    pages = [ROOT / "README.md", *doc_pages()]
    assert len(pages) > 5
    broken = [problem for page in pages for problem in broken_links(page)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## CPU kernels: `cpu_pack`\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[fine](docs/page.md#cpu-kernels-cpu_pack) [also fine](#top) [gone](docs/other.md)\n"
        "[no heading](docs/page.md#nowhere) [web](https://example.org/x.md)\n"
        "```\n[in code](docs/missing.md)\n```\n# Top\n"
    )
    assert broken_links(readme) == [
        "README.md: docs/other.md (no such file)",
        "README.md: docs/page.md#nowhere (no such heading)",
    ]


def test_the_readme_is_a_landing_page_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {target.partition("#")[0] for line in _prose(readme) for target in LINK.findall(line)}
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 7
    assert [page for page in pages if page not in linked] == []


def test_the_site_navigation_lists_every_docs_page():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "docs_dir: docs" in config
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [page for page in pages if not re.search(rf"\s{re.escape(page)}\s*$", config, re.MULTILINE)] == []


def test_measurements_are_labelled_by_date_not_by_session_number():
    labelled = [
        f"{page.relative_to(ROOT)}: {line.strip()[:80]}"
        for page in [ROOT / "README.md", *doc_pages()]
        for line in _prose(page.read_text(encoding="utf-8"))
        if re.search(r"\bsessions?[ -]\d", line, re.IGNORECASE)
    ]
    assert labelled == []
