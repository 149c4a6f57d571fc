"""bench.anatomy's report (the timing itself needs a GPU)."""
from __future__ import annotations

import pytest

from bench import anatomy


def test_markdown_floor_and_missing_variants():
    rows = [{"variant": "full", "N": 18944, "K": 3584, "M": 16, "us": 25.5},
            {"variant": "skeleton", "N": 18944, "K": 3584, "M": 16, "us": 21.7},
            {"variant": "full", "N": 3584, "K": 18944, "M": 1, "us": 27.0}]
    table = anatomy.markdown({"ceilings": {"copy_GBps": 3000.0}, "rows": rows}).splitlines()
    assert table[0].count("|") == 3 + len(anatomy.VARIANTS) + 1
    floor = 18944 * 3584 * 0.5625 / 3000.0 / 1e3  # packed bytes / (GB/s) in us
    assert table[2].startswith(f"| 18944 x 3584 | 16 | {floor:.1f} | 25.5 | - | - | - | 21.7 |")
    assert table[3].startswith("| 3584 x 18944 | 1 |") and table[3].count("-") == 4


def test_cli_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(anatomy.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        anatomy.main(["--rows", "1"])


def test_publish_prints_and_writes_the_table(tmp_path, capsys):
    import json

    from bench.kernels import publish

    publish({"rows": []}, "| a |", tmp_path / "r.json")
    assert "| a |" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["markdown"] == "| a |"
