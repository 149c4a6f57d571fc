"""Regional compilation of the paged engine's decode step (qerl.rollout.layer_compile), on CPU with dynamo's
aot_eager backend wrapped in a counter (inductor itself needs a GPU or a C++ toolchain)."""
from __future__ import annotations

import pytest
import torch

from qerl.rollout import SamplingParams, layer_compile
from qerl.rollout.paged_engine import PagedEngine

from tests.rollout.conftest import TEXTS  # the three prompts every rollout test decodes


def counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


def tiny_model(tiny_model_dir, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = layers
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def run(model, tok, compile_, sampling, n=2):
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    engine = PagedEngine(model, tok, eos_token_ids=(), decode_buckets=True, compile=compile_)
    return engine.generate(prompts, n, sampling), engine


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("temperature,trainer_swaps", [(0.0, False), (1.0, True)])
def test_compiled_layers_give_the_eager_rows_and_one_compile_serves_every_layer(
        tiny_model_dir, model_and_tok, monkeypatch, temperature, trainer_swaps):
    """trainer_swaps: the trainer's per-instance forwards of every norm and MLP (fused_elementwise, tiled_mlp) are
    on, as in a training run's rollouts: they must not cost one compile per layer either."""
    from qerl.fused_elementwise import fuse_elementwise
    from qerl.tiled_mlp import tile_mlps

    tok = model_and_tok[1]
    sampling = SamplingParams(temperature=temperature, max_tokens=9, seed=3)
    counts = {}
    for layers in (2, 5):
        model = tiny_model(tiny_model_dir, layers)
        if trainer_swaps:
            swapped = [tile_mlps(model, 2), fuse_elementwise(model)]
            assert all(swapped)
        ref, _ = run(model, tok, False, sampling)
        backend, graphs = counting_backend()  # a new backend: dynamo's cache entries are per backend
        monkeypatch.setattr(layer_compile, "BACKEND", backend)
        out, engine = run(model, tok, True, sampling)
        assert out.completion_ids == ref.completion_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-9)
        assert engine._compiled is not None and out.stats["graph_eager_steps"] > 0  # the compiled path ran
        assert out.stats["graph_build_s"] > 0 and ref.stats["graph_build_s"] > 0  # counted, compiled or not
        assert all(m._compiled_call_impl is None for m in model.modules())  # nothing left on after the call
        assert sum("forward" in vars(m) for m in model.modules()) == (3 * layers + 1 if trainer_swaps else 0)
        counts[layers] = len(graphs)
    assert counts[2] > 0 and counts[2] == counts[5]  # compiled once per code path, not per layer


def test_no_meta_reaches_the_compiled_layers(tiny_model_dir, model_and_tok, monkeypatch):
    """The step's PagedMeta comes through paged_step, not the layers' kwargs: no graph input is a PagedMeta and the
    attention call is left to run eagerly (no custom pool op inside the compiled graphs)."""
    tok = model_and_tok[1]
    backend, graphs = counting_backend()
    monkeypatch.setattr(layer_compile, "BACKEND", backend)
    run(tiny_model(tiny_model_dir, 2), tok, True, SamplingParams(temperature=0.0, max_tokens=5))
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert graphs and not any("paged" in t for t in targets)


@pytest.mark.gpu
def test_gpu_compiled_layers_in_captured_graphs_equal_eager_layers(nvfp4_dir, tiny_model_dir):
    """On CUDA with inductor: the FP4 + LoRA model (groups, adapter copies) decodes the same greedy rows with its
    layers compiled inside the captured graphs as with eager layers, and a second call replays without capturing."""
    from transformers import AutoTokenizer

    from qerl.rollout.layer_compile import decoder_layers
    from tests.rollout.test_paged_engine import fp4_lora_model

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = fp4_lora_model(nvfp4_dir).cuda()
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=16)
    eager = PagedEngine(model, tok, block_size=16, num_blocks=64, eos_token_ids=(), compile=False)
    compiled = PagedEngine(model, tok, block_size=16, num_blocks=64, eos_token_ids=(), compile=True)
    ref = eager.generate(prompts, 2, params)
    runs = [compiled.generate(prompts, 2, params) for _ in range(2)]
    for run in runs:
        assert run.completion_ids == ref.completion_ids
        for a, b in zip(run.logprobs, ref.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)
    assert runs[0].stats["graph_captures"] >= 1 and runs[1].stats["graph_captures"] == 0
    assert decoder_layers(model) and all(m._compiled_call_impl is None for m in model.modules())


@pytest.mark.gpu
def test_gpu_next_rollout_after_sleep_captures_without_warmup_and_decodes_the_same():
    """A random FP4 + LoRA Qwen2.5-shaped model (24 rows: humming's GEMMs, compiled layers): after sleep() freed
    the pool, the next call captures each bucket at its first step (no eager warm-up: this process ran it) and
    decodes the same rows as the first call."""
    from tests.rollout.conftest import random_fp4_lora

    model, tok, prompts = random_fp4_lora()
    engine = PagedEngine(model, tok, block_size=16, num_blocks=128, eos_token_ids=(), compile=True)
    params = SamplingParams(temperature=0, max_tokens=12)
    first = engine.generate(prompts, 8, params)
    engine.sleep()
    second = engine.generate(prompts, 8, params)
    assert first.stats["graph_eager_steps"] >= 1 and second.stats["graph_eager_steps"] == 0
    assert second.stats["graph_captures"] >= 1 and second.stats["humming_bytes"] > 0
    assert second.completion_ids == first.completion_ids
    for a, b in zip(second.logprobs, first.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-2)
