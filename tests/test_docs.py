"""The documentation: docs/layout.md names every module of the package and of bench/, one line each, and every page
of docs/ is in mkdocs.yml's nav (CI's `mkdocs build --strict` checks the links; this runs without mkdocs)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_layout_names_every_module():
    layout = (REPO / "docs" / "layout.md").read_text()
    named = set(re.findall(r"^\s+([\w./]+\.(?:py|cu))\s", layout, flags=re.MULTILINE))
    modules = {p.name for root in ("qerl", "bench") for p in (REPO / root).rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - named)
    assert not missing, f"docs/layout.md does not name: {missing}"


def test_every_page_is_in_the_nav():
    config = (REPO / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s+- [^:\n]+: ([\w./-]+\.md)$", config, flags=re.MULTILINE))
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == nav, f"pages not in mkdocs.yml's nav: {sorted(pages - nav)}; nav entries without a page: {sorted(nav - pages)}"
