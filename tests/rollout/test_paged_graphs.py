"""DecodeGraphs' capture fallbacks, on the CPU with torch.cuda's graph API replaced by fakes that fail the way a
real capture does (capture_end raising leaves the capture stream current and the pool recording)."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from qerl.rollout import paged_graphs
from qerl.rollout.paged_graphs import DecodeGraphs


class FakeCuda:
    """torch.cuda's graph calls: the first `fail` captures raise at their end and leave their pool recording and
    the capture stream current; a capture into a recording pool raises at its start, as beginAllocateToPool
    does."""

    def __init__(self, fail: int):
        self.fail, self.pools, self.recording, self.stream, self.captured = fail, 0, set(), "engine", []

    def graph_pool_handle(self):
        self.pools += 1
        return (0, self.pools)

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        if pool in self.recording:
            raise RuntimeError(f"beginAllocateToPool: already recording to mempool_id {pool}")
        previous, self.stream = self.stream, "capture"
        self.recording.add(pool)
        yield
        if self.fail:
            self.fail -= 1
            raise RuntimeError("operation not permitted when stream is capturing")  # the stream stays "capture"
        self.recording.discard(pool)
        self.stream = previous
        self.captured.append(pool)

    def current_stream(self):
        return self.stream

    def set_stream(self, stream):
        self.stream = stream


@pytest.fixture
def fake(monkeypatch):
    def install(fail):
        cuda = FakeCuda(fail)
        for name in ("graph_pool_handle", "graph", "current_stream", "set_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=lambda: None))
        graphs = types.SimpleNamespace(mempool=cuda.graph_pool_handle(), eager_runs={}, warm_key="k", graphs={},
                                       capture_ok=True, stats={"graph_captures": 0, "graph_replays": 0},
                                       bodies=[], eager_sizes=[])
        graphs._body = lambda size: graphs.bodies.append(size)

        def eager(size):
            graphs.eager_runs[size] = graphs.eager_runs.get(size, 0) + 1
            graphs.eager_sizes.append(size)
        graphs._eager = eager
        return cuda, graphs
    return install


def test_a_capture_before_warm_up_that_fails_is_warmed_up_and_captured_next_time(fake, caplog):
    cuda, graphs = fake(fail=1)
    paged_graphs._WARMED.add(("k", 256))  # warmed by an earlier graphs object: captured at its first step
    DecodeGraphs._capture(graphs, 256)
    assert "operation not permitted when stream is capturing" in caplog.text  # the cause, said once
    assert graphs.eager_sizes == [256] and 256 not in graphs.graphs and ("k", 256) not in paged_graphs._WARMED
    assert cuda.stream == "engine"  # the capture stream left behind by the failed capture is not current any more
    DecodeGraphs._capture(graphs, 256)  # the pool of the failed capture is still recording: a fresh one is used
    assert 256 in graphs.graphs and graphs.capture_ok and graphs.stats["graph_captures"] == 1
    assert cuda.captured == [graphs.mempool] and graphs.mempool != (0, 1)


def test_a_capture_that_fails_after_warm_up_decodes_eagerly_from_then_on(fake):
    cuda, graphs = fake(fail=2)
    graphs.eager_runs[64] = 1  # warmed up here: a failure now is the capture's own
    with pytest.warns(RuntimeWarning, match="CUDA-graph capture failed"):
        DecodeGraphs._capture(graphs, 64)
    assert not graphs.capture_ok and graphs.eager_sizes == [64] and cuda.stream == "engine"


@pytest.mark.gpu
def test_gpu_a_capture_that_fails_in_capture_end_is_retried_and_the_rows_stay_the_same(monkeypatch):
    """The real API: after sleep() the next call captures each warmed bucket at its first step; the first capture
    is made to fail (a device sync while capturing invalidates it, capture_end raises). The bucket runs eagerly,
    is captured at its next step, and the call decodes the rows of the first."""
    from qerl.rollout import SamplingParams
    from qerl.rollout.paged_engine import PagedEngine
    from tests.rollout.conftest import random_fp4_lora

    model, tok, prompts = random_fp4_lora()
    engine = PagedEngine(model, tok, block_size=16, num_blocks=128, eos_token_ids=(), compile=False)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = engine.generate(prompts, 2, params)
    engine.sleep()
    body, failed = DecodeGraphs._body, []

    def failing_body(self, size):
        if torch.cuda.is_current_stream_capturing() and not failed:
            failed.append(size)
            torch.cuda.synchronize()  # not permitted while capturing
        return body(self, size)

    monkeypatch.setattr(DecodeGraphs, "_body", failing_body)
    second = engine.generate(prompts, 2, params)
    assert failed and second.stats["graph_eager_steps"] >= 1 and second.stats["graph_captures"] >= 1
    assert second.completion_ids == first.completion_ids
    third = engine.generate(prompts, 2, params)  # later captures and replays of this call work too
    assert third.completion_ids == first.completion_ids and third.stats["graph_eager_steps"] == 0


def test_a_warm_up_counts_only_with_the_same_weight_copies_attached(model_and_tok, prompts):
    """The copies attached (dense, humming) pick a bucket's kernels, so a bucket warmed without them must run
    eagerly again before its capture; after sleep() with the same copies, the warm-up still counts."""
    from qerl.rollout import SamplingParams
    from qerl.rollout.paged_engine import PagedEngine

    model, tok = model_and_tok
    engine = PagedEngine(model, tok, block_size=16, num_blocks=128, eos_token_ids=(), decode_buckets=True,
                         compile=False, dense_weights=False)
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.generate(prompts, 2, params)
    plain = engine._graphs.warm_key
    engine.sleep()
    engine.generate(prompts, 2, params)
    assert engine._graphs.warm_key == plain  # a new pool: same warm-up
    for attr in ("dense_bytes", "humming_bytes"):
        engine.sleep()
        setattr(engine, attr, 1)  # as if the copies were attached for this call
        engine._graphs = None
        graphs = engine._graphs_for(prompts, params, engine._pool_for(prompts, 2, params.max_tokens))
        assert graphs.warm_key != plain, attr
        setattr(engine, attr, 0)
