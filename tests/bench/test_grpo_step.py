"""bench.grpo_step: the rollout floor by hand, and one tiny CPU step of the configured recipe with forced lengths."""
import json
import types

import pytest
import torch

from bench import grpo_step


def test_rollout_floor_bytes_by_hand():
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, num_key_value_heads=2)
    model = types.SimpleNamespace(config=config)
    grpo_step.decode_weight_bytes, saved = (lambda m: 1000), grpo_step.decode_weight_bytes
    try:
        got = grpo_step.rollout_floor_bytes(model, [2, 3], prompt_len=5, steps=3)
    finally:
        grpo_step.decode_weight_bytes = saved
    per_pos = 2 * 3 * 2 * 16 * 2  # K and V, layers, kv heads, head_dim 16, bf16
    positions = (6 + 7) + (6 + 7 + 8)  # row 1 reads 6 then 7 positions; row 2 reads 6, 7, 8
    assert got == 3 * 1000 + positions * per_pos


def test_recipe_is_the_experiments_train_section_shrunk():
    args = grpo_step._parse(["--experiment", "qwen7b", "--prompts", "3", "--completion-cap", "40"])
    cfg, size = grpo_step.recipe(args)
    assert (cfg.batch_size, cfg.max_completion_length, size) == (3, 40, "7B")
    assert cfg.rollout.engine == "paged" and cfg.num_generations == 8


def test_tiny_cpu_step_ends_rows_at_their_drawn_lengths(tmp_path):
    out = tmp_path / "step.json"
    assert grpo_step.main(["--size", "tiny", "--device", "cpu", "--modes", "bf16", "--prompts", "1",
                           "--completion-cap", "12", "--median", "6", "--prompt-len", "8", "--warmup-tokens", "2",
                           "--profile-update", "--steps", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    (row,) = payload["results"]
    assert payload["recipe"]["batch_size"] == 1 and row["rows"] == 8
    lengths = grpo_step.draw_lengths(8, 6, 0.6, 12, 0)
    assert row["useful_tokens"] == sum(lengths)
    assert row["decode_steps"] >= max(lengths) - 1  # the paged engine ran until the longest drawn row ended
    assert row["update_tokens"] > 0 and torch.isfinite(torch.tensor(row["loss"]))
    assert row["mode"] == "bf16+lora" and row["update_s"] > 0 and row["step_s"] >= row["rollout_s"]
    prof = row["update_profile"]  # the update again under the profiler: 8 rows in micro-batches of the recipe's size
    assert prof["micro_batches"] == -(-8 // payload["recipe"]["micro_batch_size"]) and prof["wall_s_profiled"] > 0
    (later,) = row["later_steps"]  # fresh draws: another seed's lengths
    assert later["useful_tokens"] == sum(grpo_step.draw_lengths(8, 6, 0.6, 12, 1)) and later["update_s"] > 0
    assert row["update_repeat_s"] > 0 and set(row["update_compiles"]) >= {"dynamo_frames", "triton_cache_entries"}


def test_rollout_only_times_the_rollout_and_runs_no_update(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rollout.json"
    monkeypatch.setattr("qerl.trainer.GRPOTrainer.update",
                        lambda *a, **k: pytest.fail("--rollout-only ran an update"))
    assert grpo_step.main(["--size", "tiny", "--device", "cpu", "--modes", "bf16", "--prompts", "1",
                           "--completion-cap", "12", "--median", "6", "--prompt-len", "8", "--warmup-tokens", "2",
                           "--rollout-only", "--steps", "3", "--progress-s", "1e-9", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  rollout ")]
    done = [int(line.split(": ")[1].split(" tokens")[0].replace(",", "")) for line in lines]  # tokens so far, per step
    assert len(done) == row["decode_steps"] and done == sorted(done) and done[-1] == row["useful_tokens"]
    assert row["useful_tokens"] == sum(grpo_step.draw_lengths(8, 6, 0.6, 12, 0)) and row["rollout_tok_s"] > 0
    assert row["update_s"] is None and row["later_steps"] == [] and row["step_s"] >= row["rollout_s"]


def test_unknown_mode_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--modes"):
        grpo_step.main(["--size", "tiny", "--device", "cpu", "--modes", "int8", "--prompts", "1",
                        "--completion-cap", "4", "--out", str(tmp_path / "x.json")])


def test_warmup_lengths_run_every_decode_bucket_for_two_decode_steps():
    from bench.paged import warmup_lengths
    from qerl.rollout.paged_graphs import bucket_sizes

    cases = [(rows, 48) for rows in range(1, 70)] + [(1024, 48), (256, 32), (96, 20), (300, 48), (513, 48)]
    for rows, tokens in cases:
        lengths = warmup_lengths(rows, tokens)
        assert len(lengths) == rows and max(lengths) == tokens and min(lengths) >= 1
        running = [sum(k > t for k in lengths) for t in range(1, tokens)]  # rows decoding at decode step t
        assert running == sorted(running, reverse=True) and running[0] == rows and running[-1] == 1
        sizes = bucket_sizes(rows)
        met = [next(b for b in sizes if b >= r) for r in running]
        needed = {next(b for b in sizes if b >= r) for r in range(1, rows + 1)}  # what a timed run can meet
        assert {b for b in needed if met.count(b) >= 2} == needed, (rows, tokens, met)
    assert warmup_lengths(1, 5) == [5] and warmup_lengths(0, 5) == []
    assert all(1 <= k <= 3 for k in warmup_lengths(40, 3))  # fewer steps than buckets: still valid lengths


def test_rollout_floor_seconds_take_the_larger_of_bytes_and_flops_per_step(monkeypatch):
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, num_key_value_heads=2)
    model = types.SimpleNamespace(config=config)
    monkeypatch.setattr(grpo_step, "decode_weight_bytes", lambda m: 1000)
    monkeypatch.setattr(grpo_step, "decode_matmul_params", lambda m: 10)
    # per position 384 bytes; steps: t=1 two rows read 6 positions, t=2 two rows 7, t=3 one row 8
    # bytes/1000 B/s = 5.608, 6.376, 4.072 s; FLOPs 2*10*rows / 5 FLOP/s = 8, 8, 4 s
    got = grpo_step.rollout_floor_s(model, [3, 2], prompt_len=5, bandwidth=1000.0, matmul_rate=5.0)
    assert got == pytest.approx(8 + 8 + 4.072)
    bytes_only = grpo_step.rollout_floor_s(model, [3, 2], prompt_len=5, bandwidth=1000.0, matmul_rate=1e12)
    assert bytes_only == pytest.approx(5.608 + 6.376 + 4.072)


def test_decode_matmul_params_count_every_linear_layer_but_not_the_embedding():
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 50))
    assert grpo_step.decode_matmul_params(model) == 8 * 16 + 16 * 50


def test_fp4_packed_mode_runs_every_update_over_the_packed_weights(tmp_path):
    """--modes fp4,fp4-packed: the same FP4 step, its updates over dense copies of the base (the CPU host rule
    admits a tiny model's) and over the packed weights (train.dense_weights false)."""
    out = tmp_path / "packed.json"
    assert grpo_step.main(["--size", "tiny", "--device", "cpu", "--modes", "fp4,fp4-packed", "--prompts", "1",
                           "--completion-cap", "8", "--median", "4", "--prompt-len", "8", "--warmup-tokens", "2",
                           "--steps", "2", "--out", str(out)]) == 0
    copies, packed = json.loads(out.read_text())["results"]
    assert (copies["mode"], packed["mode"]) == ("fp4+lora", "fp4-packed+lora")
    assert copies["update_dense_copies_gib"] > 0 and copies["later_steps"][0]["update_dense_copies_gib"] > 0
    assert packed["update_dense_copies_gib"] == 0 and packed["later_steps"][0]["update_dense_copies_gib"] == 0


def test_padded_mode_pads_the_updates_rows(tmp_path):
    """--modes bf16-unshared,bf16-padded,bf16-shared,bf16: the update's rows packed (train.padding_free true: only
    real tokens computed), padded (each micro-batch to its longest row), packed with each prompt once per group, and
    the default (auto: shared here, where checkpointing is on and micro-batches hold whole groups)."""
    out = tmp_path / "padded.json"
    modes = "bf16-unshared,bf16-padded,bf16-shared,bf16"
    assert grpo_step.main(["--size", "tiny", "--device", "cpu", "--modes", modes, "--prompts", "2",
                           "--completion-cap", "12", "--median", "5", "--prompt-len", "8", "--warmup-tokens", "2",
                           "--out", str(out)]) == 0
    packed, padded, shared, default = json.loads(out.read_text())["results"]
    assert (packed["mode"], padded["mode"], default["mode"]) == ("bf16-unshared+lora", "bf16-padded+lora", "bf16+lora")
    assert packed["update_rows_packed"] and not padded["update_rows_packed"]
    assert shared["update_prompts_packed"] and default["update_prompts_packed"] and not packed["update_prompts_packed"]
    assert packed["update_padded_tokens_ratio"] == 1.0 < padded["update_padded_tokens_ratio"]
    assert shared["update_padded_tokens_ratio"] == default["update_padded_tokens_ratio"] < 1.0


def _waits_for_the_gpu():
    import warnings

    from bench.common import SYNC_WARNING

    warnings.warn(f"{SYNC_WARNING} (a stand-in for CUDA's report)")


def test_sync_sites_count_each_wait_by_its_call_site():
    """bench.common.sync_sites: each report counted under the frames that made it (the markers' files); other
    warnings pass through untouched; the sync debug mode is put back."""
    import warnings

    from bench.common import sync_sites

    with pytest.warns(UserWarning, match="unrelated"):
        with sync_sites(markers=("/tests/",)) as sites:
            for _ in range(3):
                _waits_for_the_gpu()
            warnings.warn("unrelated")
    ((site, count),) = sites.items()
    assert count == 3 and site.startswith("test_grpo_step.py:") and "_waits_for_the_gpu" in site
    assert "test_sync_sites_count_each_wait_by_its_call_site" in site
