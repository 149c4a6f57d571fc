"""PagedEngine against TorchEngine (dynamic cache) on the tiny Qwen2 with the real tokenizer, CPU.

Sampled comparisons run the model in float64: in float32 the ~1e-7 differences between a padded batched forward and
a packed one move some inverse-CDF draws across a token boundary (a random model's distribution is near uniform).
"""
from __future__ import annotations

import copy

import pytest
import torch

from qerl.errors import QerlError
from qerl.rollout import SamplingParams
from qerl.rollout.paged_engine import PagedEngine
from qerl.rollout.torch_engine import TorchEngine
from tests.rollout.conftest import TEXTS



def same_rows(a, b, atol=1e-5):
    assert a.completion_ids == b.completion_ids and a.finish_reasons == b.finish_reasons
    for x, y in zip(a.logprobs, b.logprobs):
        assert torch.allclose(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64), atol=atol)


def count_forward_tokens(model):
    """Tokens fed to the decoder per forward, through a hook on the innermost Qwen2Model."""
    seen = []
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    hook = inner.model.register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True)
    return seen, hook


@pytest.mark.parametrize("n,block_size", [(1, 16), (3, 3)])  # 3: partial last prompt blocks
def test_greedy_equals_torch_engine(model_and_tok, prompts, n, block_size):
    model, tok = model_and_tok
    params = SamplingParams(temperature=0, max_tokens=12)
    ref = TorchEngine(model, tok, cache="dynamic", eos_token_ids=()).generate(prompts, n, params)
    out = PagedEngine(model, tok, block_size=block_size, eos_token_ids=()).generate(prompts, n, params)
    assert out.prompt_ids == ref.prompt_ids
    same_rows(out, ref)
    assert model.config._attn_implementation == "sdpa"  # switched back after the call


def test_prefill_attention_runs_without_cudnn_and_the_setting_comes_back(model_and_tok, prompts, monkeypatch):
    """Every prompt (and every recompute after preemption) brings a new length, for which cuDNN SDPA would build
    a graph on the host: the engine's SDPA calls run with cuDNN off, and the global setting is untouched after."""
    import torch.nn.functional as F

    model, tok = model_and_tok
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    PagedEngine(model, tok, eos_token_ids=()).generate(prompts, 2, SamplingParams(temperature=0, max_tokens=3))
    assert len(seen) >= len(prompts) * model.config.num_hidden_layers  # at least every prompt's prefill
    assert set(seen) == {False} and torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=50, top_p=0.9)])
def test_sampled_equals_torch_engine(model64, model_and_tok, prompts, knobs):
    tok = model_and_tok[1]
    params = SamplingParams(max_tokens=10, seed=3, **knobs)
    ref = TorchEngine(model64, tok, cache="dynamic", eos_token_ids=()).generate(prompts, 3, params)
    out = PagedEngine(model64, tok, block_size=5, eos_token_ids=()).generate(prompts, 3, params)
    same_rows(out, ref, atol=1e-9)
    assert len({tuple(c) for c in out.completion_ids}) > len(prompts)  # the samples of a prompt differ


def test_small_pool_preempts_and_returns_the_unconstrained_rows(model64, model_and_tok, prompts):
    tok = model_and_tok[1]
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    free = PagedEngine(model64, tok, block_size=4, eos_token_ids=()).generate(prompts, 2, params)
    eos = free.completion_ids[1][6]  # a token row 1 samples: some rows now end early, freeing blocks mid-call
    runs = [PagedEngine(model64, tok, block_size=4, num_blocks=nb, eos_token_ids=[eos]).generate(prompts, 2, params)
            for nb in (None, 9)]
    assert runs[1].stats["preemptions"] > 0 and runs[0].stats["preemptions"] == 0
    assert "stop" in runs[1].finish_reasons
    same_rows(runs[1], runs[0], atol=1e-9)


def test_over_long_sequence_is_one_line_error_before_any_forward(model_and_tok, prompts):
    model, tok = model_and_tok
    engine = PagedEngine(model, tok, block_size=4, num_blocks=6, eos_token_ids=())
    seen, hook = count_forward_tokens(model)
    try:
        with pytest.raises(QerlError) as err:
            engine.generate(prompts, 2, SamplingParams(temperature=0, max_tokens=10))  # 12 + 9 positions: 6 blocks
    finally:
        hook.remove()
    assert seen == [] and engine.pool is None  # nothing ran, nothing allocated
    msg = str(err.value)
    assert "\n" not in msg and "prompt 2 (12 tokens) + max_tokens 10 needs 6 KV blocks" in msg and "pool has 5" in msg
    assert "max_prompt_length + max_completion_length" in msg and "gpu_memory_utilization" in msg
    out = engine.generate(prompts, 2, SamplingParams(temperature=0, max_tokens=8))  # 12 + 7 positions: 5 blocks
    assert [len(c) for c in out.completion_ids] == [8] * 6


def test_prompt_prefilled_once_per_group_and_blocks_all_free(model_and_tok, prompts):
    model, tok = model_and_tok
    engine = PagedEngine(model, tok, block_size=5, eos_token_ids=())
    seen, hook = count_forward_tokens(model)
    try:
        out = engine.generate(prompts, 8, SamplingParams(max_tokens=5, seed=0))
    finally:
        hook.remove()
    rows = len(prompts) * 8
    assert sum(seen) == sum(map(len, prompts)) + rows * (5 - 1)  # prompts once, then one token per row and step
    assert out.stats["prefill_tokens"] == sum(map(len, prompts)) and out.stats["forks"] == len(prompts) * 7
    # step-time bins: every step counted once; the first step prefills, the 4 after it decode all rows at once
    bins = ("prefill", "decode_1_32", "decode_33_128", "decode_129_512", "decode_513_up")
    counts = {b: out.stats[f"steps_{b}"] for b in bins}
    assert sum(counts.values()) == out.stats["steps"] and counts["prefill"] >= 1
    assert counts["decode_1_32" if rows <= 32 else "decode_33_128"] == 4 and all(
        out.stats[f"step_s_{b}"] >= 0 for b in bins)
    alloc = engine.allocator
    assert alloc.all_free() and all(alloc.ref_count(b) == 0 for b in range(alloc.num_blocks))


def test_rows_do_not_depend_on_the_rest_of_the_batch(model64, model_and_tok, prompts):
    tok = model_and_tok[1]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=11)
    engine = PagedEngine(model64, tok, block_size=4, eos_token_ids=())
    alone = engine.generate(prompts[:1], 2, params)
    batch = engine.generate(prompts, 2, params)
    assert batch.completion_ids[:2] == alone.completion_ids  # rows 0-1: same (seed, row), other prompts added
    chunked = PagedEngine(model64, tok, block_size=4, max_num_batched_tokens=3, max_num_seqs=2,
                          eos_token_ids=()).generate(prompts, 2, params)
    same_rows(chunked, batch, atol=1e-9)  # chunked prefill, two rows at a time


def test_peft_lora_and_in_place_changes_are_seen_by_the_next_call(tiny_model_dir, prompts):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)  # init_lora_weights=False: random non-zero B, so the adapter changes the outputs
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                                      init_lora_weights=False))
    model.train()
    params = SamplingParams(temperature=0, max_tokens=8)
    engine = PagedEngine(model, tok, block_size=4, eos_token_ids=())
    before = engine.generate(prompts, 2, params)
    assert model.training and model.base_model.model.model.layers[0].training  # training mode restored
    same_rows(before, TorchEngine(model, tok, cache="dynamic", eos_token_ids=()).generate(prompts, 2, params))
    with torch.no_grad():  # a LoRA update and AQN-style noise on the RMSNorm weights, in place
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    after = engine.generate(prompts, 2, params)
    assert after.completion_ids != before.completion_ids
    same_rows(after, TorchEngine(model, tok, cache="dynamic", eos_token_ids=()).generate(prompts, 2, params))


def test_eos_and_stop_strings_end_rows_as_torch_engine(model_and_tok, prompts):
    model, tok = model_and_tok
    free = TorchEngine(model, tok, eos_token_ids=()).generate(prompts, 1, SamplingParams(temperature=0, max_tokens=12))
    text = tok.decode(free.completion_ids[1][4:6])
    stop = text.strip()[:3] or text[:3]
    eos = free.completion_ids[0][3]
    for params in (SamplingParams(temperature=0, max_tokens=12, stop=(stop,)),
                   SamplingParams(temperature=0, max_tokens=12)):
        ref = TorchEngine(model, tok, cache="dynamic", eos_token_ids=[eos]).generate(prompts, 2, params)
        out = PagedEngine(model, tok, block_size=4, eos_token_ids=[eos]).generate(prompts, 2, params)
        same_rows(out, ref)
        assert "stop" in out.finish_reasons
    short = PagedEngine(model, tok, eos_token_ids=()).generate(prompts, 2, SamplingParams(max_tokens=1, seed=0))
    assert [len(c) for c in short.completion_ids] == [1] * 6 and set(short.finish_reasons) == {"length"}


def test_llama_shaped_model_equals_torch_engine(model_and_tok, prompts):
    """Not only Qwen2: any model whose mask comes from create_causal_mask (here Llama, 4 query / 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = model_and_tok[1]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=model_and_tok[0].config.vocab_size, hidden_size=64,
                                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2)).eval()
    params = SamplingParams(temperature=0, max_tokens=10)
    ref = TorchEngine(model, tok, cache="dynamic", eos_token_ids=()).generate(prompts, 2, params)
    same_rows(PagedEngine(model, tok, block_size=8, eos_token_ids=()).generate(prompts, 2, params), ref)


def test_bad_arguments_raise_one_line_errors(model_and_tok):
    model, tok = model_and_tok
    for kw, field in ((dict(block_size=0), "block_size"), (dict(num_blocks=1), "num_blocks"),
                      (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                      (dict(max_num_seqs=0), "max_num_seqs"), (dict(decode_buckets="yes"), "decode_buckets"),
                      (dict(compile="no"), "compile"), (dict(lora_dtype="half"), "lora_dtype"),
                      (dict(fuse_projections="yes"), "fuse_projections"),
                      (dict(plain_projections="auto"), "plain_projections")):
        with pytest.raises(QerlError, match=field):
            PagedEngine(model, tok, **kw)
    with pytest.raises(QerlError, match="plain_projections: expected True or False, got 'auto'"):
        PagedEngine(model, tok, plain_projections="auto")  # the value itself in the line
    with pytest.raises(QerlError, match="prompt_ids"):
        PagedEngine(model, tok).generate([], 1)


@pytest.mark.parametrize("knobs", [dict(temperature=0), dict(temperature=1.0, seed=3)])
def test_bucketed_decode_steps_equal_torch_engine(model64, model_and_tok, prompts, knobs):
    """Decode-only steps padded to buckets (9 rows -> 16, padded rows on the null block, length 1) give the rows of
    the unpadded engine; the static buffers are kept for the next call and rebuilt when the sampling knobs change."""
    tok = model_and_tok[1]
    params = SamplingParams(max_tokens=10, **knobs)
    ref = TorchEngine(model64, tok, cache="dynamic", eos_token_ids=()).generate(prompts, 3, params)
    engine = PagedEngine(model64, tok, block_size=4, eos_token_ids=(), decode_buckets=True)
    out = engine.generate(prompts, 3, params)
    same_rows(out, ref, atol=1e-9)
    assert out.stats["graph_eager_steps"] == 10 - 1 and out.stats["graph_captures"] == 0  # no graphs on CPU
    # the time blocked on the step's result is part of the decode steps' time; prefill steps have no static buffers
    assert 0 < out.stats["step_wait_s_decode_1_32"] <= out.stats["step_s_decode_1_32"]
    assert out.stats["step_wait_s_prefill"] == 0
    assert out.stats["graph_wait_s"] == pytest.approx(out.stats["step_wait_s_decode_1_32"])
    graphs = engine._graphs
    again = engine.generate(prompts[:1], 3, params)
    assert engine._graphs is graphs and again.completion_ids == out.completion_ids[:3]
    engine.generate(prompts[:1], 3, SamplingParams(temperature=0.5, max_tokens=10, seed=1))
    assert engine._graphs is not graphs


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def fp4_lora_model(nvfp4_dir, adapter_dtype=torch.float64):
    """The tiny NVFP4 model (float32) + peft LoRA on all 7 projections, adapters kept in `adapter_dtype` (as the
    trainer keeps fp32 adapters on a bf16 model), in training mode."""
    from peft import get_peft_model

    from qerl.quant.loader import load_quantized_model
    from qerl.quant.lora import fp4_lora_config

    torch.manual_seed(0)  # init_lora_weights=False: random non-zero B, so the adapters change the outputs
    model = get_peft_model(load_quantized_model(nvfp4_dir), fp4_lora_config(r=4, lora_alpha=8, init_lora_weights=False,
                                                                            target_modules=LORA_TARGETS))
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(adapter_dtype)
    return model.train()


def model_state(model):
    """Parameter objects with their dtype and requires_grad, module objects with their training flag."""
    return ({n: (id(p), p.dtype, p.requires_grad) for n, p in model.named_parameters()},
            {n: (id(m), m.training) for n, m in model.named_modules()})


def test_fp4_lora_with_groups_and_lora_dtype_equals_torch_engine_and_model_is_restored(nvfp4_dir, tiny_model_dir,
                                                                                      prompts):
    """fuse_projections=True + lora_dtype=float32 over float64 adapters (the CPU image of bf16 copies of fp32
    adapters): the paged engine's rows equal TorchEngine's with the same settings (its bucketed decode steps with
    the groups in place too); after the call the model is the trained one again: the same Parameter objects in
    their dtype with requires_grad, the same modules in training mode, the training forward and backward unchanged."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = fp4_lora_model(nvfp4_dir)
    ids = torch.tensor([prompts[2]])
    before, logits = model_state(model), model(ids).logits.detach()
    params = SamplingParams(temperature=0, max_tokens=8)  # greedy: float32 sampling draws move across batch shapes
    same = dict(eos_token_ids=(), lora_dtype=torch.float32, fuse_projections=True)
    torch_engine = TorchEngine(model, tok, cache="dynamic", **same)
    ref = torch_engine.generate(prompts, 2, params)
    assert ref.stats["projection_groups"] > 0
    torch_engine.close()  # its groups hold the layers: ungroup so that the paged engine groups them itself
    engine = PagedEngine(model, tok, block_size=4, decode_buckets=True, **same)
    seen = set()  # the dtypes of the LoRA weights in place whenever a decoder layer runs during the call
    lora_linears = [m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    layers = model.base_model.model.model.layers
    hooks = [layer.register_forward_pre_hook(lambda mod, args: seen.update(m.weight.dtype for m in lora_linears))
             for layer in layers]
    out = engine.generate(prompts, 2, params)
    for h in hooks:
        h.remove()
    assert lora_linears and seen == {torch.float32}  # the float32 copies were used, never the float64 weights
    same_rows(out, ref, atol=1e-4)
    assert out.stats["projection_groups"] == 4 * len(model.base_model.model.model.layers)
    assert len(engine._shadows) == 2 * len(LORA_TARGETS) * len(model.base_model.model.model.layers)
    assert model_state(model) == before
    loss = model(ids).logits
    torch.testing.assert_close(loss.detach(), logits)
    loss.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64
               for n, p in model.named_parameters() if "lora_" in n)
    engine.close()
    assert not any("_qerl_group" in m.__dict__ for m in model.modules()) and model_state(model) == before


def test_graph_key_changes_with_groups_and_lora_dtype(nvfp4_dir, tiny_model_dir, prompts):
    """The bucketed decode buffers (CUDA graphs on GPU) are rebuilt when the projection groups or lora_dtype change,
    and the rows stay those of TorchEngine with the same settings."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = fp4_lora_model(nvfp4_dir)
    params = SamplingParams(temperature=0, max_tokens=6)
    engine = PagedEngine(model, tok, block_size=4, decode_buckets=True, eos_token_ids=(), lora_dtype=torch.float32,
                         fuse_projections=True)
    engine.generate(prompts, 2, params)
    graphs = engine._graphs
    engine.generate(prompts, 2, params)
    assert engine._graphs is graphs
    engine.unfuse_projections()
    out = engine.generate(prompts, 2, params)
    assert engine._graphs is not graphs and out.stats["projection_groups"] == 0
    graphs = engine._graphs
    engine.lora_dtype = None
    engine.generate(prompts, 2, params)
    assert engine._graphs is not graphs
    ref = TorchEngine(model, tok, cache="dynamic", eos_token_ids=(), lora_dtype=None, fuse_projections=False)
    same_rows(engine.generate(prompts, 2, params), ref.generate(prompts, 2, params), atol=1e-4)


def test_bucket_sizes():
    from qerl.rollout.paged_graphs import bucket_sizes

    assert bucket_sizes(1) == [1] and bucket_sizes(5) == [1, 2, 4, 8]
    assert bucket_sizes(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 384]


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(temperature=0), dict(temperature=1.0, top_k=50, seed=3)])
def test_gpu_graph_replays_equal_eager_steps_and_see_in_place_updates(model_and_tok, prompts, knobs):
    """On CUDA: captured decode steps give the rows of unpadded eager steps (float32, so no rounding differences
    between batch shapes matter); a second call replays without capturing again and sees in-place weight changes."""
    model = copy.deepcopy(model_and_tok[0]).cuda()
    tok = model_and_tok[1]
    params = SamplingParams(max_tokens=24, **knobs)
    graphed = PagedEngine(model, tok, block_size=16, num_blocks=64, eos_token_ids=())
    out = graphed.generate(prompts, 3, params)
    eager = PagedEngine(model, tok, block_size=16, num_blocks=64, eos_token_ids=(), decode_buckets=False)
    same_rows(out, eager.generate(prompts, 3, params), atol=1e-4)
    assert out.stats["graph_captures"] == 1 and out.stats["graph_replays"] == 24 - 2  # 23 decode steps: 1 eager
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    again = graphed.generate(prompts, 3, params)
    assert again.stats["graph_captures"] == 0 and again.stats["graph_replays"] == 24 - 1
    same_rows(again, eager.generate(prompts, 3, params), atol=1e-4)
    assert again.completion_ids != out.completion_ids


@pytest.mark.gpu
def test_gpu_fp4_lora_graphs_with_groups_and_bf16_style_copies_equal_eager(nvfp4_dir, tiny_model_dir, prompts):
    """On CUDA with the defaults (groups, adapter copies in the compute dtype, graphs): the rows of an eager,
    ungrouped engine with the same copies; the second call replays; ungrouping recaptures with the same rows."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = fp4_lora_model(nvfp4_dir).cuda()
    before = model_state(model)
    params = SamplingParams(temperature=0, max_tokens=16)
    engine = PagedEngine(model, tok, block_size=16, num_blocks=64, eos_token_ids=())
    assert engine.lora_dtype == torch.float32
    runs = [engine.generate(prompts, 2, params) for _ in range(2)]
    eager = PagedEngine(model, tok, block_size=16, num_blocks=64, eos_token_ids=(), decode_buckets=False,
                        fuse_projections=False).generate(prompts, 2, params)
    assert runs[0].stats["projection_groups"] == 4 * len(model.base_model.model.model.layers)
    assert runs[0].stats["graph_captures"] >= 1 and runs[1].stats["graph_captures"] == 0
    for run in runs:
        same_rows(run, eager, atol=1e-3)
    engine.unfuse_projections()
    again = engine.generate(prompts, 2, params)
    assert again.stats["graph_captures"] >= 1
    same_rows(again, eager, atol=1e-3)
    assert model_state(model) == before


@pytest.mark.gpu
def test_gpu_fp4_rollout_on_humming_copies_matches_our_kernels_and_gives_the_memory_back(tokenizer_dir, monkeypatch):
    """A random Qwen2.5-shaped FP4 + LoRA model (shapes humming tiles), 24 rows: the engine builds humming's
    repacked copies before its pool, its rows' log-probs match those of our kernels (QERL_FP4_HUMMING=0), and
    release() drops the copies."""
    from transformers import AutoTokenizer

    from bench.random_models import attach_lora, build_random_model, qwen25_config
    from qerl.quant.kernels import humming_fp4

    if not torch.cuda.is_available() or not humming_fp4.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and humming-kernels")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = qwen25_config("7B", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2)
    model = attach_lora(build_random_model(config, fp4=True), r=8, alpha=16, fp4=True, gradient_checkpointing=False)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(temperature=0, max_tokens=6)
    monkeypatch.setenv("QERL_FP4_HUMMING", "0")
    ours = PagedEngine(model, tok, eos_token_ids=(), dense_weights=False)
    ref = ours.generate(prompts, 8, params)
    ours.close()
    assert ref.stats["humming_bytes"] == 0
    monkeypatch.delenv("QERL_FP4_HUMMING")
    engine = PagedEngine(model, tok, eos_token_ids=(), dense_weights=False)
    out = engine.generate(prompts, 8, params)
    assert out.stats["humming_bytes"] > 0 and humming_fp4.copies_nbytes() == out.stats["humming_bytes"]
    first = torch.tensor([lp[0] for lp in out.logprobs])
    torch.testing.assert_close(first, torch.tensor([lp[0] for lp in ref.logprobs]), atol=3e-2, rtol=0)
    assert all(len(c) == 6 for c in out.completion_ids)
    engine.release()
    assert humming_fp4.copies_nbytes() == 0
    engine.close()


def test_a_call_that_compiled_logs_each_library_and_returns_its_seconds(caplog):
    import logging

    from qerl.compile_cache import report

    times = dict(wall_s=40.0, torch_compile_s=0.4, humming_prepare_s=0.3, humming_background_s=9.5, humming_kernels=2,
                 cuda_build_s=2.4, triton_jit_s=1.5, triton_kernels=7)
    log = logging.getLogger("qerl.rollout.paged")

    def _log_compiles(t):
        return report(t, log)

    with caplog.at_level("INFO", logger="qerl.rollout.paged"):
        out = _log_compiles(times)
    assert out == {"compile_torch_s": 0.4, "compile_humming_s": 0.3, "compile_humming_background_s": 9.5,
                   "compile_cuda_s": 2.4, "compile_triton_s": 1.5}
    (line,) = [r.getMessage() for r in caplog.records]
    # the background compile ran beside the rest: only the 0.3 s waited for it counts in the total
    assert "4.6 s of this 40.0 s call compiled" in line and "qerl's CUDA kernels 2.4 s" in line
    assert "humming 2 kernels 0.3 s waited (9.5 s in the background)" in line
    assert "qerl's Triton kernels 7 specializations 1.5 s" in line
    caplog.clear()
    with caplog.at_level("INFO", logger="qerl.rollout.paged"):
        _log_compiles(dict(times, cuda_build_s=0.0, triton_jit_s=0.0))  # 0.7 s: nothing worth a line
    assert not caplog.records
