"""CPU smoke test of the data-parallel benchmark (bench.distributed): its three cases on a tiny random model, 2 ranks
over gloo, through the same orchestrator, torchrun launches, trainer and JSON the GPU run uses; its case names, and
its report's speed-up lines (bench.distributed_report)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert payload["speedups"] == {"fp4-lora-x2 vs fp4-lora-x1": payload["speedup_fp4_lora_2_vs_1"]}  # one full case
    assert "speed-up fp4-lora 2 GPUs vs 1" in proc.stdout and "full-x2" in proc.stdout
    assert proc.stdout.count("  per rank: rollout s") == 3 and "measured / estimated" in proc.stdout
    _check_tail(results)
    _check_memory(results)


def _check_tail(results: dict) -> None:
    """Per rank: its own rollout seconds, decode steps, seconds in steps of <= 32 rows and longest row, which is the
    longest drawn length of that rank's share of the rows."""
    from bench.paged import draw_lengths

    lengths = draw_lengths(4 * 2, 4, 0.6, 6, 0)  # TINY's rows, median, the default sigma, cap, seed
    for case, r in results.items():
        n = r["gpus"]
        per = len(lengths) // n
        assert r["longest_row_per_rank"] == [max(lengths[i * per:(i + 1) * per]) for i in range(n)], case
        for key in ("rollout_s_per_rank", "decode_steps_per_rank", "tail_s_per_rank"):
            assert len(r[key]) == n, (case, key)
        assert r["rollout_s_slowest"] == max(r["rollout_s_per_rank"]) >= r["rollout_s_fastest"] \
            == min(r["rollout_s_per_rank"]) > 0
        assert r["rollout_s_per_rank"][r["slowest_rank"]] == r["rollout_s_slowest"]
        assert r["tail_s"] == r["tail_s_per_rank"][r["slowest_rank"]]
        # a tiny rank never has more than 32 live rows: every decode step is a tail step
        for steps, tail, longest, seconds in zip(r["decode_steps_per_rank"], r["tail_s_per_rank"],
                                                  r["longest_row_per_rank"], r["rollout_s_per_rank"]):
            assert steps >= longest - 1 and 0 < tail <= seconds + 0.01, case
        assert r["rollout_s"] >= r["rollout_s_slowest"] - 0.01  # the trainer's, around the same call, the max


def _check_memory(results: dict) -> None:
    """qerl/memory.py's estimate per case beside the measured peaks (0 on the CPU: no allocator statistics)."""
    for case, r in results.items():
        est, got, ratio = r["memory"]["estimate"], r["memory"]["measured"], r["memory"]["ratio"]
        terms = est["terms"]
        both = sum(v for k, v in terms.items() if k not in ("gathered", "activations"))  # weights, adapter, overhead..
        assert terms["overhead"] > 0 and terms["weights"] > 0 and terms["rollout"] == 0  # paged: no pool term
        assert est["update"] == pytest.approx(both + terms["activations"], abs=0.02), case
        grads = terms["weights"] / 4 if case.startswith("full") else 0.0  # 1 of weight, gradient, AdamW's 2 states
        assert est["rollout"] == pytest.approx(both - grads + terms["gathered"], abs=0.02), case
        assert est["total"] == pytest.approx(max(est["update"], est["rollout"]), abs=0.02), case
        assert len(r["engine_resident_gib"]) == len(r["weight_copies_gib"]) == r["gpus"], case
        assert got["update"] == max(u - e for u, e in zip(r["update_peak_gib"], r["engine_resident_gib"]))
        assert got["update_with_engine"] == max(r["update_peak_gib"])
        assert got["rollout_with_pool"] == max(r["rollout_peak_gib"])
        assert set(ratio) == {"update", "rollout"}
    fp4, fp4_2, full = (results[c]["memory"]["estimate"]["terms"] for c in ("fp4-lora-x1", "fp4-lora-x2", "full-x2"))
    assert fp4["adapter"] > 0 == fp4["gathered"] and full["gathered"] > 0 == full["adapter"]
    assert fp4["weights"] == fp4_2["weights"] and fp4["activations"] == fp4_2["activations"]  # LoRA: replicated


def test_case_names_any_rank_count_and_one_line_refusals():
    from bench.distributed import main, parse_cases

    assert parse_cases("fp4-lora-x1,fp4-lora-x2,fp4-lora-x4,full-x2,full-x4", gpus=4, prompts=32) == [
        ("fp4-lora-x1", "fp4", 1), ("fp4-lora-x2", "fp4", 2), ("fp4-lora-x4", "fp4", 4), ("full-x2", "full", 2),
        ("full-x4", "full", 4)]
    assert parse_cases("fp4-lora-x16") == [("fp4-lora-x16", "fp4", 16)]  # no GPUs: gloo ranks, no limit
    for bad, gpus, prompts in (("full-x1", 8, 32), ("fp4-lora-x0", 8, 32), ("foo", 8, 32), ("fp4-lora-x4", 2, 32),
                               ("fp4-lora-x3", 8, 32), ("fp4-lora-x1,full-x", 8, 32)):
        with pytest.raises(SystemExit) as err:
            parse_cases(bad, gpus, prompts)
        line = str(err.value)
        assert line.startswith("--cases: ") and "\n" not in line, line
        assert bad.split(",")[-1] in line or "4 needs" in line
    with pytest.raises(SystemExit, match="^--cases: 'foo' is not a case"):  # the command refuses before any case
        main(["--cases", "fp4-lora-x1,foo", "--out", "/nonexistent/never-written.json"])


def test_speedup_lines_for_two_and_four_ranks():
    from bench.distributed_report import speedup_lines, speedups

    results = [{"case": "fp4-lora-x1", "step_s": 30.0}, {"case": "fp4-lora-x2", "step_s": 20.0},
               {"case": "fp4-lora-x4", "step_s": 12.0}, {"case": "full-x2", "step_s": 21.0},
               {"case": "full-x4", "step_s": 15.0}, {"case": "full-x8", "error": "timed out after 280 s"}]
    assert speedup_lines(results) == ["speed-up fp4-lora 2 GPUs vs 1: x1.50 (same global batch)",
                                      "speed-up fp4-lora 4 GPUs vs 1: x2.50 (same global batch)",
                                      "speed-up full 4 GPUs vs 2: x1.40 (same global batch)"]
    assert speedups(results)["fp4-lora-x4 vs fp4-lora-x1"] == 30.0 / 12.0
    # without the 1-GPU case no fp4-lora line; a lone full case has nothing to compare with
    assert speedup_lines([results[1], results[2], results[3]]) == []


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


def test_measured_memory_leaves_out_what_the_engine_keeps():
    """The estimate leaves what is free to what takes it: the update is compared without the engine's resident
    bytes and the update's own dense copies, the rollout without its KV pool and its opportunistic weight copies
    (hand-built figures)."""
    from bench.distributed_report import memory_fields

    result = {"update_peak_gib": [62.7, 60.0], "engine_resident_gib": [47.0, 40.0], "rollout_peak_gib": [55.8, 50.0],
              "kv_pool_gib": [31.5, 30.0], "weight_copies_gib": [16.0, 16.0]}
    got = memory_fields({"update": 16.0, "rollout": 10.0}, result)
    assert got["measured"]["update"] == pytest.approx(20.0) and got["measured"]["update_with_engine"] == 62.7
    assert got["measured"]["rollout"] == pytest.approx(8.3) and got["ratio"]["update"] == pytest.approx(1.25)
    got = memory_fields({"update": 16.0, "rollout": 10.0}, dict(result, update_copies_gib=[12.2, 0.0]))
    assert got["measured"]["update"] == pytest.approx(20.0)  # rank 1 (no copies) is now the fullest
    got = memory_fields({"update": 16.0, "rollout": 10.0}, dict(result, update_copies_gib=[12.2, 12.2]))
    assert got["measured"]["update"] == pytest.approx(7.8) and got["measured"]["update_with_engine"] == 62.7
