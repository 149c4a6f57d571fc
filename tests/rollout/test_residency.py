"""An engine resident across updates (qerl.rollout.residency, PagedEngine(resident="auto")): the update's reserve,
the resident pool's size, the trainer's wiring (CPU); on a GPU, a kept pool and kept graphs that read the weights
as the update left them."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.rollout.residency import (LAST_PEAK_MARGIN, MARGIN, SLACK_BYTES, UpdateMemory, resident_blocks,
                                    update_reserve)

GIB = 1 << 30


def test_update_reserve_scales_the_measured_peak_to_full_length():
    assert update_reserve(None, 100, 200) is None and update_reserve(GIB, 0, 200) is None
    assert update_reserve(4 * GIB, 200, 200) == int(4 * GIB * MARGIN) + SLACK_BYTES
    # a batch of half the longest sequences the config allows: activations at full length take twice as much
    assert update_reserve(4 * GIB, 100, 200) == int(8 * GIB * MARGIN) + SLACK_BYTES
    assert update_reserve(4 * GIB, 300, 200) == update_reserve(4 * GIB, 200, 200)  # never scaled down


def test_resident_pool_holds_every_row_and_leaves_the_update_free():
    block = 16 * 57344  # a 7B's 16-token block
    need = 1 + 128 * 269  # 128 rows of 4,300 tokens
    free = 100 * GIB
    assert resident_blocks(need, free, 0.85, 2 * GIB, 40 * GIB, block) == need
    assert resident_blocks(need, free, 0.85, 2 * GIB, 60 * GIB, block) is None  # 85 - 2 - 60 < 30.1 GiB
    assert resident_blocks(need, free, 0.85, 2 * GIB, None, block) is None  # no update planned: as before
    assert resident_blocks(1, free, 0.85, 0, 0, block) is None  # block 0 is the null block: two at least


def test_a_pool_short_of_full_length_must_beat_what_the_last_call_used():
    """The paper's 1,024-row 7B step cannot hold every row at full length beside its update on any card; a resident
    pool of what is left serves it when that is well above the blocks the last (released) rollout used."""
    block = 16 * 57344
    need = 1 + 1024 * 288  # 1,024 rows of 4,608 tokens: 264 GiB
    free, reserve, update = 125 * GIB, 2 * GIB, 35 * GIB
    budget = (int(free * 0.85) - reserve - update) // block  # ~68 GiB of blocks
    assert resident_blocks(need, free, 0.85, reserve, update, block) is None  # nothing known of the last call
    used = {"peak_blocks": 40000, "preemptions": 0, "num_blocks": 120000}
    assert resident_blocks(need, free, 0.85, reserve, update, block, last=used) == budget
    tight = dict(used, peak_blocks=int(budget / LAST_PEAK_MARGIN) + 1)  # the last call used nearly all of it
    assert resident_blocks(need, free, 0.85, reserve, update, block, last=tight) is None
    preempted = dict(used, preemptions=3, num_blocks=budget + 1)  # it was short of blocks even with more
    assert resident_blocks(need, free, 0.85, reserve, update, block, last=preempted) is None
    assert resident_blocks(need, free, 0.85, reserve, update, block, last=dict(preempted, num_blocks=budget)) == budget


def test_update_memory_measures_nothing_off_cuda():
    with UpdateMemory("cpu") as meter:
        torch.ones(1000)
    assert meter.growth is None


def test_engine_option_and_config_key(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.config import RolloutConfig
    from qerl.rollout.paged_engine import PagedEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(QerlError, match="^PagedEngine.resident: expected False or 'auto', got 'yes'$"):
        PagedEngine(model, tok, resident="yes")
    engine = PagedEngine(model, tok)
    engine.plan_update(GIB)
    assert engine.update_bytes is None  # off CUDA the pool is sized per call anyway
    assert RolloutConfig().keep_resident is True and RolloutConfig(keep_resident=False).keep_resident is False


def test_trainer_plans_each_update_from_its_measured_peak(tiny_model_dir, tmp_path, monkeypatch):
    from bench.e2e_workers import _random_reward
    from qerl import trainer as trainer_mod
    from qerl.config import TrainConfig
    from qerl.policy import LoraSpec, load_policy

    model, tok = load_policy(tiny_model_dir, mode="lora", dtype=torch.float32, device="cpu",
                             lora=LoraSpec(r=2, alpha=4))
    cfg = TrainConfig(mode="lora", data={"source": "bench"}, rewards=["bench.e2e_workers:_random_reward"],
                      num_generations=2, batch_size=2, micro_batch_size=2, max_steps=1, max_completion_length=4,
                      aqn=None, lora={"lora_r": 2, "lora_alpha": 4}, dtype="float32", rollout={"engine": "paged"})
    trainer = trainer_mod.GRPOTrainer(cfg, model, tok, [list(range(100, 108)), list(range(200, 206))], ["0", "0"],
                                      [("random", _random_reward, 1.0)], checkpoint_dir=tmp_path)
    planned = []
    monkeypatch.setattr(trainer.engine, "plan_update", planned.append)
    batch = trainer.rollout(0)
    trainer.update(batch, 0)
    assert planned == [None]  # nothing measured on the CPU

    class Measured(UpdateMemory):
        def __exit__(self, *exc):
            self.growth = 3 * GIB

    monkeypatch.setattr(trainer_mod, "UpdateMemory", Measured)
    trainer.update(batch, 0)
    longest = cfg.max_prompt_length + cfg.max_completion_length
    assert planned[-1] == update_reserve(3 * GIB, batch.input_ids.shape[1], longest) > 3 * GIB

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.Tensor, "backward", oom)
    with pytest.raises(QerlError, match="micro_batch_size") as err:
        trainer.update(batch, 0)
    assert "keep_resident" not in str(err.value)  # nothing was kept through this update
    monkeypatch.setattr(type(trainer.engine), "resident_now", property(lambda self: True))
    with pytest.raises(QerlError, match=r"or set rollout.keep_resident: false$"):
        trainer.update(batch, 0)


@pytest.mark.gpu
def test_gpu_resident_engine_keeps_pool_and_graphs_and_reads_the_updated_weights():
    """Without a plan the pool goes back at sleep(); with one, the next pool holds every row at full length and
    stays, with its captured graphs, across sleep(); after an in-place change of LoRA B (as an optimizer step
    makes) the kept graphs give the rows a freshly built pool and fresh captures give; a plan larger than free
    memory gives everything back again."""
    from qerl.rollout.base import SamplingParams
    from qerl.rollout.paged_engine import PagedEngine
    from tests.rollout.conftest import random_fp4_lora

    model, tok, prompts = random_fp4_lora()
    params = SamplingParams(temperature=0, max_tokens=24)
    engine = PagedEngine(model, tok, gpu_memory_utilization=0.05, eos_token_ids=())
    engine.generate(prompts, 4, params)
    engine.sleep()
    assert engine.pool is None  # nothing planned yet
    engine.plan_update(GIB)
    before = engine.generate(prompts, 4, params)
    assert before.stats["resident_pool"] and before.stats["num_blocks"] == engine._full_need(prompts, 4, 24)
    pool, graphs = engine.pool, engine._graphs
    engine.sleep()
    assert engine.pool is pool and engine._graphs is graphs
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.5)
    kept = engine.generate(prompts, 4, params)
    assert kept.stats["pool_kept"] and engine._graphs is graphs and kept.stats["graph_captures"] == 0
    assert kept.stats["graph_replays"] > 0
    assert kept.completion_ids != before.completion_ids  # the kept graphs read the new adapter
    engine.release()
    fresh = engine.generate(prompts, 4, params)
    assert not fresh.stats["pool_kept"] and fresh.completion_ids == kept.completion_ids
    for a, b in zip(fresh.logprobs, kept.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)
    engine.plan_update(1 << 50)
    engine.sleep()
    assert engine.pool is None
    engine.close()
