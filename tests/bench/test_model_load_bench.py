"""CPU smoke test of the model-load benchmark (bench.model_load): both ways on a tiny random checkpoint, 2 ranks over
gloo, through the same orchestrator, torchrun launches and JSON the GPU run uses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_both_ways_load_on_cpu_and_write_seconds_and_peak_rss_per_rank(tokenizer_dir, tmp_path):
    out = tmp_path / "model_load.json"
    proc = subprocess.run([sys.executable, "-m", "bench.model_load", "--size", "tiny", "--ranks", "2",
                           "--tokenizer", str(tokenizer_dir), "--timeout-s", "150", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(out.read_text())
    assert payload["device"] == "CPU (gloo)"
    results = {r["way"]: r for r in payload["results"]}
    assert list(results) == ["rank0", "every"]
    for r in results.values():
        assert "error" not in r, r
        assert len(r["load_s"]) == len(r["rss_growth_mib"]) == len(r["rss_anon_mib"]) == r["ranks"] == 2
        assert r["slowest_s"] == max(r["load_s"]) > 0 and r["model_mib"] > 100
        assert all(g >= 0 for g in r["rss_growth_mib"])
    assert "rank0" in proc.stdout and "every" in proc.stdout
