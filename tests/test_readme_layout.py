"""The README's layout tree names every module of the package and of bench/, one line each."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_layout_names_every_module():
    text = (REPO / "README.md").read_text()
    layout = text[text.index("## Layout"):]
    named = set(re.findall(r"^\s+([\w./]+\.(?:py|cu))\s", layout, flags=re.MULTILINE))
    modules = {p.name for root in ("qerl", "bench") for p in (REPO / root).rglob("*.py") if p.name != "__init__.py"}
    missing = sorted(modules - named)
    assert not missing, f"README.md's Layout does not name: {missing}"
