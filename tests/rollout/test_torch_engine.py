"""The torch rollout engine against transformers' own generate and a full forward pass (tiny Qwen2, CPU)."""
from __future__ import annotations

import copy

import pytest
import torch

from qerl.errors import QerlError
from qerl.rollout import RolloutOutput, SamplingParams, make_engine
from qerl.rollout.torch_engine import TorchEngine

from tests.rollout.conftest import TEXTS  # the three prompts every rollout test decodes


@pytest.fixture(scope="module")
def prompts(model_and_tok):
    _, tok = model_and_tok
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids)  # different lengths, so left padding is exercised
    return ids


def hf_greedy(model, tok, prompts, max_new: int) -> list[list[int]]:
    """Reference: transformers' generate on the left-padded batch, never stopping early."""
    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                         pad_token_id=tok.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:].tolist()


def full_forward_logprobs(model, prompt, completion, temperature: float) -> torch.Tensor:
    """Reference: log_softmax(logits / T) of the completion tokens from one unpadded forward pass."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double().cpu()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_matches_transformers_generate(model_and_tok, prompts, cache, n):
    model, tok = model_and_tok
    ref = hf_greedy(model, tok, prompts, 12)
    engine = TorchEngine(model, tok, cache=cache, eos_token_ids=())
    out = engine.generate(prompts, n=n, sampling=SamplingParams(temperature=0, max_tokens=12))
    assert out.prompt_ids == [p for p in prompts for _ in range(n)]
    assert out.completion_ids == [r for r in ref for _ in range(n)]
    assert out.finish_reasons == ["length"] * len(prompts) * n
    for r, (p, c) in enumerate(zip(out.prompt_ids, out.completion_ids)):  # greedy: log_softmax of raw logits
        expect = full_forward_logprobs(model, p, c, temperature=0)
        assert torch.allclose(torch.tensor(out.logprobs[r], dtype=torch.float64), expect, atol=1e-4)


def test_each_prompt_prefilled_once_then_one_token_steps(model_and_tok, prompts):
    model, tok = model_and_tok
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    try:
        out = TorchEngine(model, tok).generate(prompts, n=4, sampling=SamplingParams(max_tokens=5, seed=0))
    finally:
        hook.remove()
    width = max(len(p) for p in prompts)
    assert shapes[0] == (len(prompts), width)  # one prefill row per prompt, not per sample
    assert all(s[1] == 1 and s[0] <= len(prompts) * 4 for s in shapes[1:])
    assert len(shapes) == 5 and out.stats["prefill_rows"] == len(prompts)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("knobs", [dict(temperature=1.0), dict(temperature=0.7, top_k=50, top_p=0.9)])
def test_sampled_logprobs_equal_full_forward_recomputation(model_and_tok, prompts, knobs, cache):
    model, tok = model_and_tok
    out = TorchEngine(model, tok, cache=cache).generate(prompts, n=2,
                                                        sampling=SamplingParams(max_tokens=10, seed=3, **knobs))
    diffs = [
        (torch.tensor(out.logprobs[r], dtype=torch.float64)
         - full_forward_logprobs(model, p, c, knobs["temperature"])).abs()
        for r, (p, c) in enumerate(zip(out.prompt_ids, out.completion_ids))
    ]
    assert torch.cat(diffs).mean() < 1e-4
    assert len({tuple(c) for c in out.completion_ids}) > 1  # samples differ


def test_static_and_dynamic_caches_sample_the_same_rows(model_and_tok, prompts):
    """The static decoder (fixed shapes, on-device bookkeeping, grouped-query decode attention) ends, trims and
    labels rows as the dynamic one, also when rows end early on an EOS id and past the host-check interval.
    Greedy: sampled draws sit on CDF boundaries that 1e-7 differences between attention kernels can cross."""
    model, tok = model_and_tok
    params = SamplingParams(temperature=0, max_tokens=40)
    free = TorchEngine(model, tok, cache="dynamic", eos_token_ids=()).generate(prompts, 3, params)
    eos = free.completion_ids[1][2]  # a token some row produces early
    runs = [TorchEngine(model, tok, cache=c, eos_token_ids=[eos]).generate(prompts, 3, params)
            for c in ("dynamic", "static")]
    assert runs[0].completion_ids == runs[1].completion_ids
    assert runs[0].finish_reasons == runs[1].finish_reasons and "stop" in runs[0].finish_reasons
    assert max(map(len, runs[1].completion_ids)) > 16 or "length" not in runs[1].finish_reasons
    for a, b in zip(runs[0].logprobs, runs[1].logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_top_k_one_is_greedy(model_and_tok, prompts):
    model, tok = model_and_tok
    engine = TorchEngine(model, tok, eos_token_ids=())
    greedy = engine.generate(prompts, 1, SamplingParams(temperature=0, max_tokens=6))
    top1 = engine.generate(prompts, 1, SamplingParams(temperature=1.0, top_k=1, max_tokens=6, seed=1))
    assert top1.completion_ids == greedy.completion_ids


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_seeds_reproducible_and_per_sequence(model_and_tok, prompts, cache):
    model, tok = model_and_tok
    # float64: a float32 batch of 2 rows and one of 3 round some logits differently on some CPUs (AVX2-only),
    # enough to move a uniform draw across a token boundary
    model = copy.deepcopy(model).double()
    engine = TorchEngine(model, tok, cache=cache)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
    a = engine.generate(prompts, 2, params)
    b = engine.generate(prompts, 2, params)
    other = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_tokens=8, seed=8))
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != other.completion_ids
    # a row's draws depend on (seed, row) only: the same rows come back when the batch is split
    split = TorchEngine(model, tok, max_batch_size=2, cache=cache).generate(prompts, 2, params)
    assert split.completion_ids == a.completion_ids


def test_eos_stops_rows_independently(model_and_tok, prompts):
    model, tok = model_and_tok
    ref = hf_greedy(model, tok, prompts, 10)
    eos = ref[0][3]  # make row 0's 4th greedy token the EOS id
    for cache in ("dynamic", "static"):
        out = TorchEngine(model, tok, cache=cache, eos_token_ids=[eos]).generate(
            prompts, 1, SamplingParams(temperature=0, max_tokens=10))
        for r, row in enumerate(ref):
            cut = row.index(eos) + 1 if eos in row else len(row)
            assert out.completion_ids[r] == row[:cut]
            assert out.finish_reasons[r] == ("stop" if eos in row else "length")
        assert out.finish_reasons[0] == "stop" and len(out.completion_ids[0]) <= 4


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_stop_strings_and_max_tokens(model_and_tok, prompts, cache):
    model, tok = model_and_tok
    engine = TorchEngine(model, tok, eos_token_ids=(), cache=cache)
    ref = engine.generate(prompts, 1, SamplingParams(temperature=0, max_tokens=12)).completion_ids
    text = tok.decode(ref[1][4:6])
    stop = text.strip()[:3] or text[:3]
    assert stop
    out = engine.generate(prompts, 1, SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))
    for r, row in enumerate(ref):
        hit = next((k for k in range(1, len(row) + 1) if stop in tok.decode(row[:k])), None)
        assert out.completion_ids[r] == row[:hit or len(row)]
        assert out.finish_reasons[r] == ("stop" if hit else "length")
    assert out.finish_reasons[1] == "stop" and len(out.completion_ids[1]) <= 6
    short = engine.generate(prompts, 2, SamplingParams(max_tokens=3, seed=0))
    assert [len(c) for c in short.completion_ids] == [3] * 6 and set(short.finish_reasons) == {"length"}


def test_peft_adapter_is_used(tiny_model_dir, prompts):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_out = TorchEngine(base, tok, eos_token_ids=()).generate(prompts, 1, SamplingParams(temperature=0, max_tokens=8))
    torch.manual_seed(0)  # init_lora_weights=False: random non-zero B, so the adapter changes the outputs
    config = LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    model.train()
    out = TorchEngine(model, tok, eos_token_ids=()).generate(prompts, 2, SamplingParams(temperature=0, max_tokens=8))
    assert model.training and model.base_model.model.model.layers[0].training  # training mode restored
    ref = hf_greedy(model, tok, prompts, 8)
    assert out.completion_ids == [r for r in ref for _ in range(2)]
    assert out.completion_ids[::2] != base_out.completion_ids


def test_lora_dtype_uses_refreshed_copies_and_restores_trained_weights(tiny_model_dir, prompts):
    """lora_dtype=bf16: a call samples exactly as a model whose adapters hold the bf16-rounded weights, the
    trained fp32 parameters come back untouched, and an update of them reaches the next call."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj", "down_proj"],
                                      init_lora_weights=False))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    engine = TorchEngine(model, tok, eos_token_ids=(), lora_dtype=torch.bfloat16)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=5)

    def bf16_adapter_reference():  # a copy of the model whose adapter modules really are bf16
        ref_model = copy.deepcopy(model)
        for name, module in ref_model.named_modules():
            if name.split(".")[-1] in ("lora_A", "lora_B"):
                module.to(torch.bfloat16)
        return TorchEngine(ref_model, tok, eos_token_ids=(), lora_dtype=None).generate(prompts, 2, params)

    for _ in range(2):
        out = engine.generate(prompts, 2, params)
        assert {n: p for n, p in model.named_parameters() if "lora_" in n} == lora  # the same Parameter objects
        assert all(p.dtype == torch.float32 and p.requires_grad for p in lora.values())
        ref = bf16_adapter_reference()
        assert out.completion_ids == ref.completion_ids
        assert max(abs(a - b) for x, y in zip(out.logprobs, ref.logprobs) for a, b in zip(x, y)) < 1e-4
        with torch.no_grad():  # an "optimizer step": the next call must see it
            for n, p in lora.items():
                if "lora_B" in n:
                    p.mul_(-3.0)
    with pytest.raises(QerlError, match="lora_dtype"):
        TorchEngine(model, tok, lora_dtype="half")


def test_gradient_checkpointing_model_still_uses_cache(tiny_model_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = TorchEngine(model, tok).generate(prompts, 1, SamplingParams(temperature=0, max_tokens=5))
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    out = TorchEngine(model, tok).generate(prompts, 1, SamplingParams(temperature=0, max_tokens=5))
    assert out.completion_ids == ref.completion_ids and model.training


def test_input_require_grads_hooks_are_off_during_a_call_and_back_after(tiny_model_dir, prompts):
    """peft + gradient checkpointing hook the input embeddings (`output.requires_grad_(True)`), which
    torch.compile cannot trace: the engine lifts them for the call and puts them back for training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    model.enable_input_require_grads()
    emb = model.get_input_embeddings()
    hooks_before = len(emb._forward_hooks)
    assert hooks_before >= 1
    seen = []
    spy = emb.register_forward_pre_hook(lambda module, args: seen.append(len(module._forward_hooks)))
    model.train()
    out = TorchEngine(model, tok, eos_token_ids=()).generate(prompts, 1, SamplingParams(temperature=0, max_tokens=3))
    spy.remove()
    assert seen and set(seen) == {0}  # no forward hook on the embeddings during the call
    assert len(emb._forward_hooks) == hooks_before  # back for training: gradients reach the embeddings' output
    ids = torch.tensor([out.prompt_ids[0] + out.completion_ids[0]])
    assert model(input_ids=ids).logits.requires_grad


def test_output_helpers(model_and_tok, prompts):
    model, tok = model_and_tok
    out = make_engine("torch", model, tok).generate(prompts, 2, SamplingParams(max_tokens=4, seed=0))
    assert out.num_tokens == sum(len(c) for c in out.completion_ids)
    assert out.texts(tok) == tok.batch_decode(out.completion_ids, skip_special_tokens=True)
    with pytest.raises(QerlError, match="logprobs"):
        RolloutOutput([[1]], [[2, 3]], [[0.0]], ["length"])


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(max_tokens=0),
                                 dict(stop=("",)), dict(seed=-1), dict(temperature=float("nan"))])
def test_sampling_params_validation(bad):
    with pytest.raises(QerlError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_bad_arguments_raise_one_line_errors(model_and_tok):
    model, tok = model_and_tok
    assert SamplingParams(stop="###").stop == ("###",)
    with pytest.raises(QerlError, match="rollout.engine"):
        make_engine("nope", model, tok)
    with pytest.raises(QerlError, match=r"prompt_ids\[1\]"):
        TorchEngine(model, tok).generate([[1, 2], []], 1)
    with pytest.raises(QerlError, match="n must be"):
        TorchEngine(model, tok).generate([[1, 2]], 0)
    with pytest.raises(QerlError, match="use_cuda_graph"):
        TorchEngine(model, tok, use_cuda_graph=True)  # CPU model


class _Shaped:
    """Only the shapes of a model: what the static-cache memory estimate reads (config, embedding dtype)."""

    def __init__(self, **config):
        from transformers import Qwen2Config

        self.config = Qwen2Config(**config)
        self._embed = torch.nn.Embedding(1, 1, dtype=torch.bfloat16)

    def get_input_embeddings(self):
        return self._embed


def test_a_static_rollout_that_cannot_fit_is_one_line_naming_the_lengths_rows_and_the_paged_engine():
    from qerl.rollout.static_decoder import check_static_fits, static_cache_bytes

    qwen7b = _Shaped(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584,
                     vocab_size=152064)
    need = static_cache_bytes(qwen7b, 1024, 4608)
    assert 1024 * 4608 * 56 * 2**10 < need < 1.02 * 1024 * 4608 * 56 * 2**10  # the KV cache: 56 KiB per position
    with pytest.raises(QerlError) as err:
        check_static_fits(qwen7b, 1024, 4608, free=70 * 2**30, prompts=128, prompt_len=512)
    line = str(err.value)
    assert "\n" not in line and "1,024 rows x 4,608 positions" in line and "70.0 GiB" in line
    for name in ("max_prompt_length + max_completion_length", "rollout.engine: paged", "gpu_memory_utilization"):
        assert name in line
    check_static_fits(qwen7b, 8, 4608, free=70 * 2**30)  # 8 rows fit


def test_the_static_engine_refuses_before_allocating_and_reuses_what_it_holds(model_and_tok, prompts, monkeypatch):
    from qerl.rollout import torch_engine
    from qerl.rollout.static_decoder import static_cache_bytes

    model, tok = model_and_tok
    engine = TorchEngine(model, tok, cache="static")
    params = SamplingParams(max_tokens=4, seed=0)
    width = max(len(p) for p in prompts)
    need = static_cache_bytes(model, len(prompts) * 2, width + 4, prompts=len(prompts), prompt_len=width)
    monkeypatch.setattr(torch_engine, "free_memory_bytes", lambda _device: need - 1)
    with pytest.raises(QerlError, match=f"{len(prompts) * 2} rows x {width + 4} positions"):
        engine.generate(prompts, 2, params)
    assert engine.stats["prefill_calls"] == 0  # refused before the prefill allocated anything
    monkeypatch.setattr(torch_engine, "free_memory_bytes", lambda _device: need)
    first = engine.generate(prompts, 2, params)
    monkeypatch.setattr(torch_engine, "free_memory_bytes", lambda _device: 0)  # all of it is the held decoder's
    assert engine.generate(prompts, 2, params).completion_ids == first.completion_ids


def test_vllm_missing_names_the_extra(model_and_tok):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm installed: covered by the vllm engine's tests")
    model, tok = model_and_tok
    with pytest.raises(QerlError, match=r"qerl\[vllm\]"):
        make_engine("vllm", model, tok)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_warm_up_runs_a_few_decode_steps_and_changes_no_result(model_and_tok, prompts, cache):
    from qerl.rollout.static_decoder import WARMUP_STEPS

    model, tok = model_and_tok
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    cold = TorchEngine(model, tok, cache=cache, eos_token_ids=()).generate(prompts, 2, params)
    engine = TorchEngine(model, tok, cache=cache, eos_token_ids=())
    done = engine.warm_up(prompts, 2, SamplingParams(temperature=1.0, max_tokens=12, seed=99))
    assert done["prefill_calls"] == 1 and done["decode_calls"] == WARMUP_STEPS + 2 < 12 - 1
    warm = engine.generate(prompts, 2, params)
    assert warm.completion_ids == cold.completion_ids and warm.logprobs == cold.logprobs
    assert all(len(c) == 12 for c in warm.completion_ids)  # the step limit is gone after warm_up
    short = engine.warm_up(prompts, 1, SamplingParams(temperature=0, max_tokens=3))
    assert short["decode_calls"] == 2  # never more steps than the call itself would run


@pytest.mark.gpu
def test_warm_up_captures_the_graph_the_next_call_replays(tmp_path, tokenizer_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.resources import build_tiny_model

    build_tiny_model(tmp_path, tokenizer_dir, seed=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    engine = TorchEngine(model, tok, eos_token_ids=())
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=0)
    assert engine.warm_up(prompts, 2, params)["graph_captures"] == 1
    out = engine.generate(prompts[::-1], 2, params)  # other prompt widths, same rows and cache bucket
    assert out.stats["graph_captures"] == 1 and out.stats["graph_replays"] >= 2 + 39


@pytest.mark.gpu
def test_cuda_graph_decode_matches_generate(tmp_path, tokenizer_dir, prompts):
    """Static cache + CUDA graph on the GPU: greedy parity, graph reuse across prompt widths, log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.resources import build_tiny_model

    build_tiny_model(tmp_path, tokenizer_dir, seed=0, initializer_range=0.2)  # peaked logits: robust argmax
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
    engine = TorchEngine(model, tok, eos_token_ids=())
    assert engine.use_cuda_graph and engine.cache_kind == "static"
    greedy = SamplingParams(temperature=0, max_tokens=12)
    for batch in (prompts, prompts[:2], prompts):  # second call: other width and rows, same cache bucket
        out = engine.generate(batch, 2, greedy)
        assert out.completion_ids == [r for r in hf_greedy(model, tok, batch, 12) for _ in range(2)]
    assert engine.use_cuda_graph and out.stats["graph_captures"] == 3  # one per (rows, bucket) switch
    assert out.stats["graph_replays"] >= 3 * (12 - 1 - 2)  # every step after the warm-up ones is a replay
    out = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_tokens=12, seed=0))
    diffs = [(torch.tensor(out.logprobs[r], dtype=torch.float64) - full_forward_logprobs(model, p, c, 1.0)).abs()
             for r, (p, c) in enumerate(zip(out.prompt_ids, out.completion_ids))]
    assert torch.cat(diffs).mean() < 1e-3


@pytest.mark.gpu
def test_cuda_graph_runs_fp4_lora_model(tmp_path, tokenizer_dir, prompts):
    """The trainer's modules (FP4Linear base + LoRA) decode through the CUDA graph with eager's tokens."""
    import warnings

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.quant.linear import FP4Linear
    from qerl.quant.lora import fp4_lora_config
    from qerl.resources import build_tiny_model

    build_tiny_model(tmp_path, tokenizer_dir, seed=0, initializer_range=0.2)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in targets:
                    setattr(parent, name, FP4Linear.from_linear(child))
    torch.manual_seed(0)
    model = get_peft_model(model.cuda(), fp4_lora_config(r=8, target_modules=targets, init_lora_weights=False))
    greedy = SamplingParams(temperature=0, max_tokens=10)
    eager = TorchEngine(model, tok, cache="dynamic", eos_token_ids=(), fuse_projections=False).generate(
        prompts, 2, greedy)
    engine = TorchEngine(model, tok, eos_token_ids=())  # q/k/v and gate/up stacked (qerl.quant.grouped)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        graphed = [engine.generate(prompts, 2, greedy) for _ in range(2)]
    # with or without the graph (a failed capture falls back to eager), the tokens are eager's
    assert graphed[0].completion_ids == eager.completion_ids == graphed[1].completion_ids
    assert engine.use_cuda_graph, f"decode fell back to eager: {caught[0].message if caught else '?'}"
    assert graphed[1].stats["graph_captures"] == 1 and graphed[1].stats["graph_replays"] > 0
    assert graphed[1].stats["projection_groups"] == 4 * len(model.base_model.model.model.layers)


def test_bench_writes_json_with_equal_work_per_engine(tiny_model_dir, tmp_path):
    import json

    from bench.rollout import main

    out = tmp_path / "bench" / "rollout.json"
    assert main(["--model", str(tiny_model_dir), "--batch", "2", "--n", "2", "--prompt-len", "5",
                 "--new-tokens", "3", "--engines", "torch,hf", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["engine"] for r in result["results"]] == ["torch", "hf"]
    assert [r["tokens"] for r in result["results"]] == [2 * 2 * 3] * 2
    assert result["dtype"] == "float32" and not list(out.parent.glob("*.tmp"))


def test_decode_compile_options_ask_for_pdl_only_on_hopper(monkeypatch):
    from torch._inductor import config as inductor_config

    from qerl.rollout.model_state import compile_options

    assert compile_options(torch.device("cpu")) == {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _dev=None: (9, 0))
    expected = {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}
    monkeypatch.delenv("QERL_PDL", raising=False)
    assert compile_options(torch.device("cuda", 0)) == expected
    monkeypatch.setenv("QERL_PDL", "0")
    assert compile_options(torch.device("cuda", 0)) == {}
    monkeypatch.setenv("QERL_PDL", "auto")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _dev=None: (8, 0))
    assert compile_options(torch.device("cuda", 0)) == {}


def _graph_breaks_of_a_compiled_decode(tokenizer_dir, device: str, rows: int) -> tuple[dict, dict]:
    """Graph breaks and dynamo stats of one TorchEngine call over 12 layers with LoRA on `device` (static cache,
    compiled decode forward; CUDA graphs on the GPU), the model set up as the trainer's (gradient checkpointing
    + peft, compiled element-wise training ops swapped in)."""
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    from bench.random_models import attach_lora, build_random_model, qwen25_config
    from qerl.fused_elementwise import fuse_elementwise

    config = qwen25_config("7B", hidden_size=128 if device == "cpu" else 256, intermediate_size=256,
                           num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = attach_lora(build_random_model(config, fp4=False, device=device, dtype=dtype), r=8, fp4=False)
    assert fuse_elementwise(model) == 2 * 12 + 1 + 12 + 1  # as the trainer does: the swapped forwards trace too
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    engine = TorchEngine(model, tok, eos_token_ids=(), cache="static", compile=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        out = engine.generate([[1, 2, 3, 4, 5]] * rows, 1, SamplingParams(temperature=1.0, max_tokens=6, seed=0))
    finally:
        engine.close()
    assert out.stats["decode_calls"] >= 5 and engine.use_compile
    return dict(counters["graph_break"]), dict(counters["stats"])


def test_compiled_decode_step_is_one_graph_for_every_layer(tokenizer_dir):
    """The trainer's adapters hook the input embeddings (`requires_grad_`); torch 2.11 (the GPU image's) cannot
    trace that and broke the decode graph 6 times here, compiling layer by layer past dynamo's recompile limit:
    the engine lifts the hooks, so the decode forward is one graph."""
    breaks, stats = _graph_breaks_of_a_compiled_decode(tokenizer_dir, "cpu", 2)
    assert not breaks, breaks
    assert stats["unique_graphs"] <= 2, stats


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 64])  # the compiled matmul attention; the Triton kernel (64 x 4 KV heads
# >= one program per SM)
def test_compiled_cuda_graph_decode_step_is_one_graph_for_every_layer(tokenizer_dir, rows):
    """The same on the GPU with CUDA graphs, grouped projections and both attention paths."""
    breaks, stats = _graph_breaks_of_a_compiled_decode(tokenizer_dir, "cuda", rows)
    assert not breaks, breaks
    assert stats["unique_graphs"] <= 3, stats
