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


def test_a_timed_out_case_is_killed_with_its_workers_and_names_its_last_phase(tmp_path):
    """A case that outlives its timeout: the whole tree (a child that started its own session, as torchrun's workers
    may) is killed, and the error names the last progress line of the case's log."""
    import os
    import time

    from bench.distributed import _run_case_process

    pid_file = tmp_path / "grandchild.pid"
    script = ("import os, subprocess, sys, time\n"
              "print('[case +0 s] building', flush=True)\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
              "print('[case +1 s] warm-up step', flush=True)\n"
              "time.sleep(120)\n")
    log = tmp_path / "case.log"
    start = time.perf_counter()
    error = _run_case_process([sys.executable, "-c", script], dict(os.environ), 5, tmp_path / "none.json", log)
    assert time.perf_counter() - start < 30
    assert error == "timed out after 5 s; last: [case +1 s] warm-up step"
    grandchild = int(pid_file.read_text())
    time.sleep(0.5)
    stat = Path(f"/proc/{grandchild}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the grandchild survived"
    assert "building" in log.read_text()
