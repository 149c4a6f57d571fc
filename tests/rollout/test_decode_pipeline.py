"""PagedEngine's pipelined decode steps (qerl.rollout.decode_pipeline): one step in flight, tokens taken from the
previous step's output on the device, rows that ended discovered one step late. On CPU the same code runs with the
steps' bodies eager; compared with the synchronous steps in float64 (see test_paged_engine's docstring)."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.rollout import SamplingParams
from qerl.rollout.kv_pool import BlockAllocator
from qerl.rollout.paged_engine import PagedEngine
from qerl.rollout.paged_graphs import DecodeGraphs
from qerl.rollout.scheduler import Chunk, Scheduler



def spy_launches(monkeypatch):
    """The launches DecodeGraphs.launch made, each as 'host' (token ids given) or 'device' (from the last step)."""
    seen, real = [], DecodeGraphs.launch

    def launch(self, ids, *args, **kwargs):
        out = real(self, ids, *args, **kwargs)
        if out is not None:
            seen.append("device" if isinstance(ids, tuple) else "host")
        return out

    monkeypatch.setattr(DecodeGraphs, "launch", launch)
    return seen


def run(model, tok, prompts, params, pipeline, **kw):
    engine = PagedEngine(model, tok, block_size=4, decode_buckets=True, pipeline_decode=pipeline, **kw)
    out = engine.generate(prompts, 4, params)
    assert engine.allocator.all_free()
    return out


def same(a, b):
    assert a.completion_ids == b.completion_ids and a.finish_reasons == b.finish_reasons
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                   atol=1e-9, rtol=0)


@pytest.mark.parametrize("ending", ["eos", "stop"])
def test_pipelined_steps_give_the_synchronous_rows(model64, model_and_tok, prompts, monkeypatch, ending):
    """Rows ending at different steps (a twelfth of the vocabulary is EOS; or a stop string: the longest text of a
    token row 0 samples), others at max_tokens: the same tokens, log-probs, finish reasons and token counts; steps
    after the first of a run took their tokens on the device; a step run in vain for rows that had ended adds no
    token."""
    tok = model_and_tok[1]
    eos, stop = range(0, len(tok), 12), ()
    if ending == "stop":
        free = run(model64, tok, prompts, SamplingParams(temperature=1.0, max_tokens=14, seed=11), False,
                   eos_token_ids=())
        eos, stop = (), (max((tok.decode([t]) for t in free.completion_ids[0]), key=len),)
    params = SamplingParams(temperature=1.0, max_tokens=14, seed=11, stop=stop)
    sync = run(model64, tok, prompts, params, False, eos_token_ids=eos)
    seen = spy_launches(monkeypatch)
    piped = run(model64, tok, prompts, params, True, eos_token_ids=eos)
    same(piped, sync)
    assert {"stop", "length"} <= set(sync.finish_reasons)
    assert seen.count("device") >= 10 and seen.count("host") >= 1
    assert piped.stats["decode_tokens"] == sync.stats["decode_tokens"]
    assert sync.stats["steps"] <= piped.stats["steps"] <= sync.stats["steps"] + seen.count("host")


def test_pipeline_hands_back_to_the_scheduler_for_preemption_and_waiting_rows(model64, model_and_tok, prompts,
                                                                            monkeypatch):
    """A pool too small for every row (preemptions) and a cap on running rows (rows wait): the pipelined runs stop
    where schedule() must act, and the rows equal the unconstrained synchronous ones."""
    tok = model_and_tok[1]
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    free = run(model64, tok, prompts, params, False, eos_token_ids=())
    seen = spy_launches(monkeypatch)
    for kw in (dict(num_blocks=14), dict(max_num_seqs=5)):
        out = run(model64, tok, prompts, params, True, eos_token_ids=(), **kw)
        same(out, free)
        assert seen.count("device") > 0
    assert out.stats["preemptions"] == 0


def test_next_decode_plans_ahead_only_what_it_may():
    """One position on for each running row, blocks grown; rows at max_tokens with the step in flight, finished
    rows and a pool without a free block leave them out or stop; waiting rows stop it."""
    alloc = BlockAllocator(8)
    sched = Scheduler([[1, 2, 3]], 3, max_tokens=4, allocator=alloc, block_size=4)
    first = sched.schedule()  # the prompt of row 0
    sched.commit(first)
    sched.update([(s, 7, -1.0, None) for s in sched.sampling_rows(first[0].seq)])  # forks: 3 rows of 4 tokens
    step = sched.schedule()
    assert [(c.start, c.end) for c in step] == [(3, 4)] * 3
    rows = [c.seq for c in step]
    rows[2].output += [5, 5]  # as if this row had two tokens more: with the step in flight it reaches max_tokens
    nxt = sched.next_decode(step)
    assert [(c.seq.row, c.start, c.end) for c in nxt] == [(0, 4, 5), (1, 4, 5)]
    assert all(len(s.blocks) == 2 for s in rows[:2])  # position 4 opens a second block of 4
    rows[1].status = "finished"
    assert [c.seq.row for c in sched.next_decode(step)] == [0]
    while alloc.num_free:
        alloc.alloc(1)
    assert sched.next_decode([Chunk(rows[0], 8, 9)]) is None  # position 9 needs a third block: none is free
    sched.waiting.append(rows[1])
    assert sched.next_decode(step) is None


def test_a_bad_pipeline_setting_is_one_line(model_and_tok):
    with pytest.raises(QerlError, match="pipeline_decode"):
        PagedEngine(*model_and_tok, pipeline_decode="yes")


@pytest.mark.gpu
def test_gpu_pipelined_graph_steps_give_the_synchronous_rows():
    """A random FP4 + LoRA Qwen2.5-shaped model on CUDA (24 rows: humming's GEMMs, captured graphs), greedy rows to
    max_tokens: with one step in flight and tokens taken on the device, the same tokens and log-probs as the
    synchronous steps, and both calls replayed captured graphs."""
    from tests.rollout.conftest import random_fp4_lora

    model, tok, prompts = random_fp4_lora()
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = {}
    for pipeline in (False, True, False):  # the first call compiles and captures for both
        engine = PagedEngine(model, tok, block_size=16, num_blocks=256, eos_token_ids=(), pipeline_decode=pipeline)
        outs[pipeline] = engine.generate(prompts, 8, params)
        engine.close()
    assert outs[True].completion_ids == outs[False].completion_ids
    for a, b in zip(outs[True].logprobs, outs[False].logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)
    assert outs[True].stats["graph_replays"] >= 30 and outs[False].stats["graph_replays"] >= 30
