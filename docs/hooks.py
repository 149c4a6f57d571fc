"""mkdocs hook (mkdocs.yml `hooks:`): BENCHMARKS.md, which stays at the repository root, on the site's benchmarks page.

On GitHub, docs/benchmarks.md links to ../BENCHMARKS.md. On the site the page includes that file where its
`<!-- include BENCHMARKS.md -->` line stands (headings one level down, its links into docs/ made page-relative),
and every page's link to ../BENCHMARKS.md points at the benchmarks page. Nothing else is rewritten, so any other
link out of docs/ stays broken and fails `mkdocs build --strict`.
"""
from __future__ import annotations

import re
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_MARKER = "<!-- include BENCHMARKS.md -->"


def _demote_headings(text: str) -> str:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            line = "#" + line
        lines.append(line)
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "benchmarks.md":
        included = (_ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").replace("](docs/", "](")
        markdown = markdown.replace(_MARKER, _demote_headings(included))
    return markdown.replace("](../BENCHMARKS.md)", "](benchmarks.md)")
