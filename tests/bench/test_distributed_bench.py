"""CPU smoke test of the data-parallel benchmark (bench.distributed): its three cases on a tiny random model, 2 ranks
over gloo, through the same orchestrator, torchrun launches, trainer and JSON the GPU run uses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--size", "tiny", "--prompts", "4", "--group", "2", "--prompt-len", "8", "--max-tokens", "6", "--median", "4",
        "--micro-batch", "2", "--lora-r", "4", "--warmup-tokens", "2", "--timeout-s", "120"]


def test_three_cases_run_on_cpu_and_write_the_table_and_json(tokenizer_dir, tmp_path):
    out = tmp_path / "distributed.json"
    proc = subprocess.run([sys.executable, "-m", "bench.distributed", *TINY, "--tokenizer", str(tokenizer_dir),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(out.read_text())
    assert payload["device"] == "CPU (gloo)" and "devices: CPU (gloo)" in proc.stdout
    results = {r["case"]: r for r in payload["results"]}
    assert list(results) == ["fp4-lora-x1", "fp4-lora-x2", "full-x2"]
    for case, r in results.items():
        assert "error" not in r, r
        assert len(r["peak_gib_per_rank"]) == r["gpus"] == (1 if case.endswith("x1") else 2)
        # the same drawn lengths in every case, every row ending at its own (random weights never emit EOS)
        assert r["generated_tokens"] == r["drawn_tokens"] == results["fp4-lora-x1"]["drawn_tokens"]
        assert r["step_s"] >= r["update_s"] > 0 and r["tokens_per_s"] > 0
    assert payload["speedup_fp4_lora_2_vs_1"] == results["fp4-lora-x1"]["step_s"] / results["fp4-lora-x2"]["step_s"]
    assert "speed-up fp4-lora 2 GPUs vs 1" in proc.stdout and "full-x2" in proc.stdout
