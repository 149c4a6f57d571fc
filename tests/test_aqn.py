"""qerl.aqn: the schedule against the paper's formula, and the noise context on a real tiny Qwen2 (plain, peft)."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from qerl.aqn import aqn_noise, aqn_sigma, aqn_stage, rmsnorm_noise_targets, sample_noise
from qerl.errors import QerlError

CONFIGS = [(100, 4, 1e-2, 5e-4), (10, 3, 1e-2, 1e-3), (7, 5, 0.05, 0.001), (1000, 10, 1e-2, 5e-4),
           (13, 2, 2e-2, 1e-3), (9, 4, 1e-3, 1e-2)]  # not divisible, K=2, increasing sigma


def _paper_sigma(step, total, K, s0, s1):
    """The paper: K equal stages; stage 0 clean; stage k >= 1: s0 * (s1/s0)^((k-1)/(K-2))."""
    k = min(math.floor(Fraction(min(step, total) * K, total)), K - 1)
    if k == 0:
        return 0.0
    return s0 if K == 2 else s0 * (s1 / s0) ** ((k - 1) / (K - 2))


@pytest.mark.parametrize("total,K,s0,s1", CONFIGS)
def test_exponential_schedule_is_the_papers_formula(total, K, s0, s1):
    for step in range(total + 3):  # also past the end
        got = aqn_sigma(step, total, sigma_start=s0, sigma_end=s1, num_stages=K)
        assert got == pytest.approx(_paper_sigma(step, total, K, s0, s1), rel=1e-12, abs=0.0), step


@pytest.mark.parametrize("total,K,s0,s1", CONFIGS)
def test_stages_are_equal_and_cover_the_run(total, K, s0, s1):
    stages = [aqn_stage(s, total, K) for s in range(total)]
    assert stages == sorted(stages) and stages[0] == 0 and stages[-1] == K - 1
    lengths = [stages.count(k) for k in range(K)]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == total
    sig = [aqn_sigma(s, total, sigma_start=s0, sigma_end=s1, num_stages=K) for s in range(total)]
    assert sig[0] == 0.0 and sig[lengths[0]] == pytest.approx(s0) and sig[-1] == pytest.approx(s1 if K > 2 else s0)


def test_original_float_partition_agrees_where_it_is_exact():
    """The original code's `int(step // (total / K))`, on totals where total / K is exact in binary."""
    for total, K in [(100, 4), (64, 8), (1000, 10), (96, 3)]:
        for step in range(total):
            assert aqn_stage(step, total, K) == min(int(step // (total / K)), K - 1)


def test_ablation_schedules():
    kw = dict(sigma_start=1e-2, sigma_end=1e-3, num_stages=6)
    total = 60  # stages of 10 steps; noisy stages 1..5 -> fractions 0, .25, .5, .75, 1
    for k, frac in zip(range(1, 6), (0.0, 0.25, 0.5, 0.75, 1.0)):
        step = 10 * k + 3
        lin = 1e-2 + (1e-3 - 1e-2) * frac
        cos = 1e-3 + (1e-2 - 1e-3) * (1 + math.cos(math.pi * frac)) / 2
        assert aqn_sigma(step, total, schedule="linear", **kw) == pytest.approx(lin, rel=1e-12)
        assert aqn_sigma(step, total, schedule="cosine", **kw) == pytest.approx(cos, rel=1e-12)
        assert aqn_sigma(step, total, schedule="constant", **kw) == 1e-2
        assert aqn_sigma(step, total, schedule="none", **kw) == 0.0
    for schedule in ("linear", "cosine", "constant", "exponential"):
        assert aqn_sigma(5, total, schedule=schedule, **kw) == 0.0  # stage 0 always clean


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_stages=1), "num_stages"), (dict(total_steps=0), "total_steps"), (dict(step=-1), "step"),
    (dict(sigma_start=0.0), "sigma_start"), (dict(sigma_end=-1e-3), "sigma_end"),
    (dict(schedule="step"), "schedule")])
def test_schedule_validation(kwargs, field):
    args = dict(step=3, total_steps=10, sigma_start=1e-2, sigma_end=1e-3, num_stages=4) | kwargs
    with pytest.raises(QerlError, match=field):
        aqn_sigma(args.pop("step"), args.pop("total_steps"), **args)


# ------------------------------------------------------------------------------------------------ noise
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_bit_exact(model, before):
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name].detach(), value), name


def test_targets_are_the_decoder_layer_norms(tiny):
    names = [n for n, _ in rmsnorm_noise_targets(tiny)]
    assert names == [f"model.layers.{i}.{k}.weight" for i in range(2)
                     for k in ("input_layernorm", "post_attention_layernorm")]
    params = dict(tiny.named_parameters())
    assert all(p is params[n] for n, p in rmsnorm_noise_targets(tiny))
    with pytest.raises(QerlError, match="RMSNorm"):
        rmsnorm_noise_targets(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)))


def test_noise_reaches_logits_in_proportion_to_sigma_and_is_removed(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    clean, before = _logits(tiny, ids), _state(tiny)
    diffs = []
    for sigma in (1e-3, 1e-2, 1e-1):
        with aqn_noise(tiny, sigma, torch.Generator().manual_seed(1)) as n:
            noisy = _logits(tiny, ids)
            assert n.applied_rms == pytest.approx(sigma, rel=0.25)  # float32: nothing rounded away
            assert n.changed_fraction == 1.0
        diffs.append((noisy - clean).abs().mean().item())
        _assert_bit_exact(tiny, before)
        torch.testing.assert_close(_logits(tiny, ids), clean, rtol=0, atol=0)
    assert 0 < diffs[0] < diffs[1] < diffs[2]
    assert diffs[1] / diffs[0] > 3 and diffs[2] / diffs[1] > 3  # roughly linear in sigma


def test_fresh_noise_each_rollout_never_accumulates(tiny):
    before, gen = _state(tiny), torch.Generator().manual_seed(3)
    with aqn_noise(tiny, 1e-2, gen) as first:
        pass
    with aqn_noise(tiny, 1e-2, gen) as second:
        name, param = rmsnorm_noise_targets(tiny)[0]
        torch.testing.assert_close(param.detach(), before[name] + second.noise[name], rtol=0, atol=1e-7)
    assert not torch.equal(first.noise[name], second.noise[name])
    _assert_bit_exact(tiny, before)
    # same seed, same vectors: what a vLLM engine would add to its own copy
    again = sample_noise({n: p.shape for n, p in rmsnorm_noise_targets(tiny)}, 1e-2,
                         torch.Generator().manual_seed(3))
    assert all(torch.equal(again[k], first.noise[k]) for k in again)


def test_restored_on_exception_and_sigma_zero_is_a_noop(tiny):
    before = _state(tiny)
    with pytest.raises(RuntimeError, match="rollout died"):
        with aqn_noise(tiny, 0.5, torch.Generator().manual_seed(4)):
            assert not torch.equal(rmsnorm_noise_targets(tiny)[0][1].detach(),
                                   before[rmsnorm_noise_targets(tiny)[0][0]])
            raise RuntimeError("rollout died")
    _assert_bit_exact(tiny, before)
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    with aqn_noise(tiny, 0.0, gen) as n:
        _assert_bit_exact(tiny, before)
    assert n.noise == {} and torch.equal(gen.get_state(), state)  # no draws: RNG stream unchanged


def test_bf16_restoration_is_bit_exact_and_rounding_is_reported():
    norm_model = torch.nn.Module()
    norm_model.input_layernorm = torch.nn.Module()
    norm_model.input_layernorm.weight = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
    before = norm_model.input_layernorm.weight.detach().clone()
    with aqn_noise(norm_model, 1e-3, torch.Generator().manual_seed(6)) as small:
        pass
    with aqn_noise(norm_model, 1e-1, torch.Generator().manual_seed(6)) as large:
        pass
    assert torch.equal(norm_model.input_layernorm.weight.detach(), before)
    # bf16 spacing around 1.0 is 2^-8 below / 2^-7 above: a 1e-3 perturbation survives only beyond ~2 sigma
    assert 0 < small.changed_fraction < 0.1
    assert large.changed_fraction > 0.9 and large.applied_rms == pytest.approx(1e-1, rel=0.1)


def test_noise_through_peft_wrapper(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["input_layernorm"]))
    names = [n for n, _ in rmsnorm_noise_targets(model)]
    assert names == [f"model.layers.{i}.{k}.weight" for i in range(2)
                     for k in ("input_layernorm", "post_attention_layernorm")]
    ids = torch.randint(0, base.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    clean, before = _logits(model, ids), _state(model)
    with aqn_noise(model, 1e-2, torch.Generator().manual_seed(8)):
        assert (_logits(model, ids) - clean).abs().max() > 1e-4  # the trainable copy forward uses got it
    _assert_bit_exact(model, before)


def test_sample_noise_validation():
    with pytest.raises(QerlError, match="sigma"):
        sample_noise({"a": (3,)}, -1.0)
    with pytest.raises(QerlError, match="sigma"):
        sample_noise({"a": (3,)}, float("nan"))
