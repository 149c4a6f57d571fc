"""bench.suite_report: the targets of BENCHMARKS.md from a suite payload, by hand-made figures."""
from __future__ import annotations

from bench import suite_report
from bench.suite_report import GIB, targets


def _totals(model, m, fwd, bwd):
    return {"model": model, "M": m, "speedup": fwd, "bwd_speedup": bwd}


def _payload():
    kernels = {"layer_totals": [_totals("7B", 1, 3.2, 1.0), _totals("7B", 64, 3.1, 0.8), _totals("7B", 256, 1.9, 0.5),
                                _totals("7B", 2048, 0.95, 0.89)]}
    wired = {"rows": [{"model": "7B", "M": 1, "bf16_us": 100.0, "chosen_us": 30.0},
                      {"model": "7B", "M": 1, "bf16_us": 50.0, "chosen_us": 20.0}]}  # layer 150 / 50 = 3.0x
    rollout = [{"batch": 8, "tokens_per_s": 3100.0, "pct_of_weight_floor": 55.0, "x_bf16": 2.1},
               {"batch": 64, "tokens_per_s": 9000.0, "x_bf16": 1.9}]
    step = {"rollout_seconds": 10.0, "update_seconds": 12.0, "x_bf16": 1.6}
    mem = [{"size": "32B", "mode": "fp4", "rows": 8, "peak_bytes": 70 * GIB},
           {"size": "7B", "mode": "bf16", "rows": 8, "peak_bytes": 20 * GIB},
           {"size": "7B", "mode": "fp4", "rows": 8, "peak_bytes": 10 * GIB},  # 50%
           {"size": "7B", "mode": "bf16", "rows": 1, "offload": True, "mlp_chunks": 4, "peak_bytes": 16 * GIB},
           {"size": "7B", "mode": "fp4", "rows": 1, "offload": True, "mlp_chunks": 4, "peak_bytes": 7 * GIB},
           {"size": "7B", "mode": "fp4", "rows": 1, "offload": True, "mlp_chunks": 2, "peak_bytes": 1 * GIB}]
    e2e = {"speed": [{"mode": "fp4", "rollout": rollout, "grpo_step": step},
                     {"mode": "bf16", "rollout": [], "grpo_step": {"rollout_seconds": 20.0, "update_seconds": 12.0}}],
           "memory": mem}
    return {"kernels": kernels, "wired": wired, "e2e": e2e}


def _by_target(payload):
    return {r["target"]: r for r in targets(payload)}


def test_each_target_met_or_missed_by_its_own_figures():
    rows = _by_target(_payload())
    decode = rows["(a) decode forward M <= 64 >= 3.0x bf16"]
    assert decode["status"] == "met"
    assert [f["what"] for f in decode["figures"]] == ["7B M=1", "7B M=64", "7B M=1 stacked (engine)"]
    assert decode["figures"][-1]["value"] == 3.0
    assert rows["(a) forward M = 256 >= 1.8x bf16"]["status"] == "met"
    assert rows["(a) forward and grad_input M >= 2048 >= 0.9x bf16"]["status"] == "missed"  # grad_input 0.89
    assert rows["(b) FP4 rollout >= 2x bf16"]["status"] == "missed"  # batch 64: 1.9x
    assert rows["(b) batch 8 FP4 >= 3,000 tokens/s"]["status"] == "met"
    assert rows["(b) batch 8 FP4 >= 50% of the weight-read floor"]["status"] == "met"
    step = rows["(c) GRPO step >= 1.5x bf16"]
    assert step["status"] == "met" and step["parts"]["bf16"]["rollout_seconds"] == 20.0
    assert rows["(d) 32B FP4 GRPO update fits 75 GiB"]["status"] == "met"
    ratio = rows["(d) 7B FP4 peak <= 45% of bf16 LoRA"]
    # only settings with a bf16 twin count (the 2-slice run has none): 50% and 43.75%, the best is met
    assert ratio["status"] == "met" and ratio["figures"][0]["value"] == 43.75
    assert sorted(f["value"] for f in ratio["all_settings"]) == [43.8, 50.0]


def test_missing_parts_are_not_measured_never_met():
    rows = targets({"kernels": None, "wired": None, "e2e": {"speed": [{"mode": "fp4", "rollout": []}],
                                                            "memory": [{"size": "32B", "mode": "fp4"}]}})
    assert {r["status"] for r in rows} == {"not measured"}


def test_thresholds_are_inclusive_and_memory_is_an_upper_bound():
    p = _payload()
    p["e2e"]["memory"][0]["peak_bytes"] = 75.5 * GIB
    p["kernels"]["layer_totals"][0]["speedup"] = 2.99
    rows = _by_target(p)
    assert rows["(d) 32B FP4 GRPO update fits 75 GiB"]["status"] == "missed"
    assert rows["(a) decode forward M <= 64 >= 3.0x bf16"]["status"] == "missed"


def test_markdown_lists_every_target_with_its_figures():
    text = suite_report.targets_markdown(targets(_payload()))
    lines = text.splitlines()
    assert len(lines) == 2 + 9
    assert "| (b) batch 8 FP4 >= 3,000 tokens/s | met | batch 8: 3100 tokens/s |" in lines
    assert "7B M=1 stacked (engine): 3x" in text


def test_suite_runs_every_part_under_one_lock_and_reports_targets(tokenizer_dir, tmp_path, capsys):
    """The whole suite on the CPU with a tiny model: the kernel part needs CUDA and fails on its own (reported,
    its targets 'not measured'), the end-to-end part runs its workers as subprocesses sharing the GPU lock."""
    import json

    from bench import suite

    tiny = ("--speed-size tiny --batches 2 --prompts 2 --group 2 --prompt-len 8 --new-tokens 3 "
            "--step-completion 3 --memory-completion 5 --micro-batch 2 --lora-r 4")
    suite.main(["--out-dir", str(tmp_path), "--tokenizer", str(tokenizer_dir), "--budget-s", "400",
                "--wired-rows", "", "--memory", "tiny:fp4,tiny:bf16", "--e2e-args", tiny])
    payload = json.loads((tmp_path / "suite.json").read_text())
    assert payload["runs"]["kernels"]["rc"] != 0 and payload["kernels"] is None  # no CUDA here
    assert payload["runs"]["e2e"]["rc"] == 0
    speed = {r["mode"]: r for r in payload["e2e"]["speed"]}
    assert set(speed) == {"fp4", "bf16"} and all(r["errors"] == {} for r in speed.values())
    assert all(r["gpu_lock_wait_s"] >= 0 for r in speed.values())
    rows = {r["target"]: r["status"] for r in payload["targets"]}
    assert rows["(a) decode forward M <= 64 >= 3.0x bf16"] == "not measured"
    assert rows["(c) GRPO step >= 1.5x bf16"] in ("met", "missed")  # measured, whatever the CPU gives
    assert rows["(d) 32B FP4 GRPO update fits 75 GiB"] == "not measured"  # not asked for (and no CPU peaks)
    out = capsys.readouterr().out
    assert "## Targets" in out and "(b) Rollout" in out
