"""CPU smoke test of the end-to-end benchmark (bench.e2e) on a tiny random Qwen2.5-shaped model.

Runs every code path the GPU run takes (random FP4/dense model build, LoRA, TorchEngine rollouts, one GRPO step
through GRPOTrainer, one update for the memory figure, HF generate, floors, table, atomic JSON), checking the
numbers that must hold on any device; the floors are checked against hand-computed byte counts.
"""
from __future__ import annotations

import json

import pytest
import torch

from bench import e2e, e2e_report
from bench.random_models import build_random_model, decode_weight_bytes, kv_bytes_per_step, qwen25_config
from qerl.errors import QerlError
from qerl.quant.dispatch import pdl_mode
from qerl.quant.linear import FP4Linear

TINY = ["--speed-size", "tiny", "--memory", "tiny:fp4,tiny:bf16,tiny:fp4:1:offload", "--batches", "2,4", "--prompts", "2",
        "--group", "2", "--prompt-len", "8", "--new-tokens", "3", "--step-completion", "3",
        "--memory-completion", "5", "--micro-batch", "2", "--lora-r", "4", "--hf-tokens", "2", "--profile-tokens", "3",
        "--profile-update", "--in-process"]


@pytest.fixture(scope="module")
def run(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    e2e.main(["--out-dir", str(out), "--tokenizer", str(tokenizer_dir), *TINY, "--gpu-lock", str(out / "gpu.lock")])
    return json.loads((out / "e2e.json").read_text()), out


def test_rollout_and_step_rows(run):
    payload, _ = run
    assert [r["mode"] for r in payload["speed"]] == ["fp4", "bf16"]
    for res in payload["speed"]:
        assert res["errors"] == {}
        assert [r["batch"] for r in res["rollout"]] == [2, 4]
        for row in res["rollout"]:  # random weights never sample EOS in 3 tokens here: full length
            assert row["tokens"] == row["batch"] * 3
            assert row["warm_up"]["prefill_calls"] == 1 and row["captures_while_timed"] == 0
            assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"])
        step = res["grpo_step"]
        assert (step["rows"], step["prompt_len"], step["completion_len"]) == (4, 8, 3)
        assert step["rollout_tokens"] == 12 and torch.isfinite(torch.tensor(step["loss"]))
        assert step["step_seconds"] >= step["rollout_seconds"]
        assert step["warm_up"]["prefill_calls"] == 1 and step["captures_while_timed"] == 0
        assert res["gpu_lock_wait_s"] >= 0  # the parts took the lock (shared set-up, exclusive timing)
        assert res["hf_generate"]["tokens"] == 2 * 2
        prof = res["profile"]  # CPU: no CUDA kernels, but the step accounting and the PDL mode are there
        assert (prof["batch"], prof["new_tokens"]) == (2, 3) and prof["pdl_mode"] == pdl_mode()
        assert prof["wall_us_per_step"] == pytest.approx(prof["seconds_profiled"] * 1e6 / 2)
        assert prof["kernels_per_step"] >= 0 and isinstance(prof["top"], list)
        up = step["update_profile"]  # the update of one more step: 4 rows x (8 + 3) tokens
        assert (up["rows"], up["tokens"]) == (4, 44) and up["seconds_profiled"] > 0
        assert up["kernels_per_update"] >= 0 and isinstance(up["top"], list)
        assert up["gpu_idle_us"] == pytest.approx(up["seconds_profiled"] * 1e6 - up["gpu_us_per_update"])
        assert step["allocator"] == up["allocator"] == {"device_allocs": 0, "alloc_retries": 0}  # CPU
    fp4, bf16 = payload["speed"]
    assert fp4["grpo_step"]["x_bf16"] == pytest.approx(bf16["grpo_step"]["step_seconds"]
                                                       / fp4["grpo_step"]["step_seconds"])


def test_worker_gets_the_same_options(tmp_path):
    """A worker subprocess parses back exactly the parent's options (flags included, worker fields added)."""
    args = e2e._parse(["--out-dir", str(tmp_path), *TINY[:-1], "--batches", "8,64"])
    argv = e2e._worker_argv(args, "speed", "tiny:fp4", tmp_path / "w.json")
    assert argv[1:3] == ["-m", "bench.e2e"]
    back, sent = vars(e2e._parse(argv[3:])), vars(args)
    worker = ("worker", "worker_spec", "worker_out")
    assert [back.pop(k) for k in worker] == ["speed", "tiny:fp4", str(tmp_path / "w.json")]
    assert [sent.pop(k) for k in worker] == [None, None, None]
    assert back == {**sent, "in_process": False}  # the worker runs the work itself
    assert back["profile_update"] is True and back["batches"] == [8, 64]
    plain = e2e._parse(e2e._worker_argv(e2e._parse([]), "speed", "7B:fp4", tmp_path / "w.json")[3:])
    assert plain.profile_update is False and plain.in_process is False


def test_memory_rows(run):
    payload, _ = run
    assert [(m["size"], m["mode"], m["rows"], m["offload"]) for m in payload["memory"]] == [
        ("tiny", "fp4", 2, False), ("tiny", "bf16", 2, False), ("tiny", "fp4", 1, True)]
    for m in payload["memory"]:
        assert (m["prompt_len"], m["completion_len"]) == (8, 5)
        assert m["peak_bytes"] is None  # CPU: no allocator statistics, reported as such
        assert torch.isfinite(torch.tensor(m["loss"]))


def test_table_and_files(run):
    payload, out = run
    table = e2e_report.markdown(payload)
    assert "(b) Rollout" in table and "(d) Peak memory" in table and payload["device"] in table
    assert "(c) One GRPO step (LoRA ops: fused; RMSNorm, SiLU * up, log-probs: compiled)" in table and "(c) One update under torch.profiler" in table
    assert not list(out.glob("*.tmp")) and (out / "e2e_parts").is_dir()


def test_update_breakdown_sorts_kernels_by_kind():
    top = [{"name": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "us_per_update": 3e6},
           {"name": "void cublasLt::splitKreduce_kernel<32, 16>", "us_per_update": 0.5e6},
           {"name": "_fp4_mm_kernel", "us_per_update": 0.25e6},
           {"name": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "us_per_update": 1e6},
           {"name": "_dequant_kernel", "us_per_update": 0.2e6},
           {"name": "void at::native::vectorized_elementwise_kernel<8, CUDAFunctor_add>", "us_per_update": 2e6}]
    prof = {"top": top, "gpu_us_per_update": 7.5e6, "gpu_idle_us": 0.4e6, "seconds_profiled": 7.9}
    got = e2e_report.update_breakdown(prof)
    assert got == pytest.approx({"gemm": 3.75, "attention": 1.0, "dequant": 0.2, "other": 2.55, "gpu": 7.5,
                                 "idle": 0.4, "wall": 7.9})  # other: the add plus 0.55 s beyond the top list


def test_fp4_model_is_packed_and_finite():
    model = build_random_model("tiny", fp4=True, device="cpu", dtype=torch.float32)
    fp4 = [m for m in model.modules() if isinstance(m, FP4Linear)]
    assert len(fp4) == 2 * 7 and not any(p.dtype == torch.uint8 for p in model.parameters())
    w = fp4[0].dequantize_weight()
    assert 0.01 < w.std().item() < 0.04  # plausible scales: dequantized std near HF's 0.02 init
    logits = model(input_ids=torch.randint(0, 1000, (2, 6))).logits
    assert torch.isfinite(logits).all()


def test_decode_bytes_and_floors_by_hand():
    cfg = qwen25_config("tiny")
    h, i, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    lin = h * (2 * h + 2 * kv) + 3 * h * i
    biases = (h + 2 * kv) * 4  # q, k, v biases in float32
    norms = (2 * layers + 1) * h * 4
    expected = layers * (lin // 2 + lin // 16 + 4 * 7 + biases) + norms + v * h * 4  # packed + fp8 + gs, lm_head
    assert decode_weight_bytes(build_random_model(cfg, fp4=True, device="cpu", dtype=torch.float32)) == expected
    assert kv_bytes_per_step(cfg, rows=3, cache_len=128) == 3 * 128 * 2 * layers * kv * 2
    payload = {"ceilings": {"copy_GBps": 1.0, "bf16_tflops": 1.0}, "config": {"prompt_len": 8},
               "speed": [{"mode": "fp4", "size": "tiny", "decode_weight_bytes": 10**9,
                          "rollout": [{"batch": 4, "new_tokens": 3, "tokens_per_s": 2.0}]}]}
    e2e_report.add_floors(payload)
    row = payload["speed"][0]["rollout"][0]
    assert row["floor_weights_tokens_per_s"] == pytest.approx(4.0)  # 4 rows / (1 GB / 1 GB/s)
    assert row["pct_of_weight_floor"] == pytest.approx(50.0)
    assert row["floor_weights_kv_tokens_per_s"] == pytest.approx(4 / (1 + kv_bytes_per_step(cfg, 4, 128) / 1e9))


def test_bad_inputs_raise():
    with pytest.raises(QerlError, match="size"):
        qwen25_config("3B")
    with pytest.raises(QerlError, match="--tokenizer"):
        e2e.main(["--tokenizer", "/nonexistent"])
