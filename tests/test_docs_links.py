"""Relative links in README.md and docs/**/*.md point at files that exist, and their #anchors at real headings.

Anchors follow GitHub's heading slugs: the heading's text (inline markup dropped) lowercased, every character that
is not a letter, digit, '_', '-' or space removed, spaces turned into '-', and a repeated slug suffixed -1, -2, ...
Links inside fenced code blocks and inline code are not links and are skipped; so are http(s)://, mailto: and
other URLs with a scheme.
"""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def prose_lines(text: str, *, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code spans blanked unless keep_code."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        marker = FENCE.match(line)
        if fence is None:
            if marker:
                fence = marker.group(1)
            else:
                out.append((number, line if keep_code else INLINE_CODE.sub("", line)))
        elif marker and marker.group(1)[0] == fence[0] and len(marker.group(1)) >= len(fence) \
                and not line.strip()[len(marker.group(1)):].strip():
            fence = None
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = re.sub(r"<[^>]+>", "", text)                                              # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text: str) -> set[str]:
    """Every anchor a markdown file defines: its headings' slugs (-1, -2, ... for repeats) and <a name/id>."""
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in prose_lines(text, keep_code=True):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            anchor = base
            while anchor in seen:
                counts[base] = counts.get(base, 0) + 1
                anchor = f"{base}-{counts[base]}"
            seen.add(anchor)
        seen.update(HTML_ANCHOR.findall(line))
    return seen


@cache
def anchors_in(path: Path) -> frozenset[str]:
    return frozenset(anchors_of(path.read_text(encoding="utf-8")))


def shown(path: Path, root: Path) -> str:
    """A path relative to the repository root where it lies inside it."""
    resolved, base = path.resolve(), root.resolve()
    return str(resolved.relative_to(base)) if resolved.is_relative_to(base) else str(path)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One message per broken relative link of a markdown file: where, the link, what is missing."""
    problems: list[str] = []
    rel = path.relative_to(root)
    text = path.read_text(encoding="utf-8")
    prose = dict(prose_lines(text))
    # code lines blanked, line count kept, so a link whose text wraps onto the next line is still one match
    joined = "\n".join(prose.get(number, "") for number in range(1, len(text.splitlines()) + 1))
    for match in LINK.finditer(joined):
        target = match.group(1).strip("<>")
        if SCHEME.match(target):
            continue
        line = joined.count("\n", 0, match.start()) + 1
        where = f"{rel}:{line}: link ({target})"
        file_part, _, anchor = target.partition("#")
        file_part = unquote(file_part)
        if file_part:
            dest = (root / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        else:
            dest = path
        if not dest.exists():
            problems.append(f"{where}: no file or folder {shown(dest, root)}")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md":
            anchor = unquote(anchor)
            if anchor not in anchors_in(dest.resolve()):
                problems.append(f"{where}: no heading with anchor #{anchor} in {shown(dest, root)}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_slugs_follow_github_rules() -> None:
    text = "\n".join([
        "# Q-Evolve",
        "### Critic budget (issue 19) [O]",
        "### The critic (§2.3 step 3, `critic_arch: lasttoken`)",
        "### ETO and QLASS from the same π_BC (2026-12-03)",
        "## See [the docs](x.md) here",
        "## Tests", "## Tests", "## Tests",
        "```bash", "# not a heading", "```",
    ])
    assert anchors_of(text) == {
        "q-evolve", "critic-budget-issue-19-o", "the-critic-23-step-3-critic_arch-lasttoken",
        "eto-and-qlass-from-the-same-π_bc-2026-12-03", "see-the-docs-here", "tests", "tests-1", "tests-2",
    }


def test_checker_reports_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B\n\n## Part one\n", encoding="utf-8")
    page = tmp_path / "docs" / "a.md"
    page.write_text("\n".join([
        "# A",
        "[ok](b.md#part-one) [ok](#a) [ok](https://example.com/x.md) [ok](mailto:x@y.z) ![ok](b.md)",
        "[gone](missing.md) [bad anchor](b.md#part-two) [self](#nowhere) `[code](skipped.md)`",
        "```", "[fenced](skipped.md)", "```",
        "a [link that",
        "wraps](wrapped.md) onto the next line",
    ]), encoding="utf-8")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert "docs/a.md:3: link (missing.md): no file or folder docs/missing.md" in problems[0]
    assert "#part-two" in problems[1] and "docs/b.md" in problems[1]
    assert "#nowhere" in problems[2]
    assert "docs/a.md:7: link (wrapped.md)" in problems[3]
