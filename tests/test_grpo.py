"""qerl.grpo against independent float64 loop references (advantages, every loss_type with its gradient, TIS)
and against the plain full-logits computation (chunked log-probs, values and gradients, plain and peft)."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from qerl.errors import QerlError
from qerl.grpo import (group_advantages, masked_entropy_stats, masked_mean, policy_loss, tis_weights,
                       token_logprobs)


# ------------------------------------------------------------------------------------------ advantages
def _ref_advantages(rewards: list[float], g: int, scale: str, eps: float = 1e-4) -> list[float]:
    out, batch_std = [], statistics.stdev(rewards)
    for start in range(0, len(rewards), g):
        group = rewards[start:start + g]
        mean = sum(group) / g
        std = statistics.stdev(group)
        for r in group:
            if all(x == group[0] for x in group):
                out.append(0.0)
            elif scale == "group":
                out.append((r - mean) / (std + eps))
            elif scale == "batch":
                out.append((r - mean) / (batch_std + eps))
            else:
                out.append(r - mean)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_reference(scale):
    gen = torch.Generator().manual_seed(1)
    rewards = torch.rand(5 * 4, generator=gen, dtype=torch.float64)
    rewards[8:12] = 0.1  # a zero-variance group whose mean is not bit-exactly 0.1
    got = group_advantages(rewards, 4, scale)
    ref = torch.tensor(_ref_advantages(rewards.tolist(), 4, scale), dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[8:12], torch.zeros(4, dtype=torch.float64))


def test_zero_variance_groups_give_exact_zero_not_nan():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.3, 0.3, 0.3], dtype=torch.float32)
    for scale in ("group", "batch", "none"):
        adv = group_advantages(rewards, 3, scale)
        assert torch.equal(adv, torch.zeros(9)), scale
    adv = group_advantages(torch.full((4,), 0.7), 2, "batch")  # batch std 0 too
    assert torch.equal(adv, torch.zeros(4))


def test_group_advantages_bad_input():
    with pytest.raises(QerlError, match="group size"):
        group_advantages(torch.rand(4), 1)
    with pytest.raises(QerlError, match="divisible"):
        group_advantages(torch.rand(5), 2)
    with pytest.raises(QerlError, match="scale_rewards"):
        group_advantages(torch.rand(4), 2, "std")
    with pytest.raises(QerlError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


# ------------------------------------------------------------------------------------------------ loss
def _ref_loss_and_grad(lp, old, adv, mask, *, loss_type, eps, eps_high, beta, ref, isw, max_len, n_items):
    """Scalar-by-scalar float64 PPO-clip loss and its analytic gradient d loss / d lp."""
    B, T = len(lp), len(lp[0])
    per_tok, dper_tok = [[0.0] * T for _ in range(B)], [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            a = adv[i]
            r = math.exp(lp[i][t] - old[i][t])
            c = min(max(r, 1 - eps), 1 + eps_high)
            unclipped_wins = r * a <= c * a
            val = -min(r * a, c * a)
            dval = -a * r if unclipped_wins else 0.0
            w = isw[i][t] if isw is not None else 1.0
            val, dval = val * w, dval * w
            if beta:
                d = ref[i][t] - lp[i][t]
                val += beta * (math.exp(d) - d - 1)
                dval += beta * (1 - math.exp(d))
            per_tok[i][t], dper_tok[i][t] = val, dval
    # normaliser per token: loss = sum_i sum_t coef[i] * m * per_tok
    coef = []
    total = sum(sum(row) for row in mask)
    for i in range(B):
        n_i = sum(mask[i])
        if loss_type == "grpo":
            coef.append(1.0 / (max(n_i, 1) * B))
        elif loss_type == "bnpo":
            coef.append(1.0 / max(total, 1))
        elif loss_type == "dr_grpo":
            coef.append(1.0 / (B * max_len))
        else:
            coef.append(1.0 / (n_items if n_items is not None else max(total, 1)))
    loss, grad = 0.0, [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if mask[i][t]:
                loss += coef[i] * per_tok[i][t]
                grad[i][t] = coef[i] * dper_tok[i][t]
    return loss, grad


def _random_batch(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)  # wide spread: both clips hit
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    mask[0, 2] = 0  # a hole inside a sequence (e.g. a masked tool-output token)
    isw = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return lp, old, adv, mask, ref, isw


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,use_is,n_items", [(0.0, False, None), (0.04, True, None), (0.0, True, 57.0)])
def test_policy_loss_matches_float64_reference(loss_type, beta, use_is, n_items):
    lp, old, adv, mask, ref, isw = _random_batch(seed=["grpo", "bnpo", "dr_grpo", "dapo"].index(loss_type) + int(use_is))
    lp = lp.clone().requires_grad_(True)
    kw = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, max_completion_length=12,
              ref_logprobs=ref if beta else None, is_weights=isw if use_is else None, num_items_in_batch=n_items)
    loss, metrics = policy_loss(lp, old, adv, mask, **kw)
    loss.backward()
    ref_loss, ref_grad = _ref_loss_and_grad(
        lp.detach().tolist(), old.tolist(), adv.tolist(), mask.tolist(), loss_type=loss_type, eps=0.2,
        eps_high=0.28, beta=beta, ref=ref.tolist(), isw=isw.tolist() if use_is else None, max_len=12,
        n_items=n_items if loss_type == "dapo" else None)
    assert abs(loss.item() - ref_loss) <= 1e-6 * abs(ref_loss)
    torch.testing.assert_close(lp.grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-6, atol=1e-12)
    assert ("kl" in metrics) == (beta > 0)


def test_clip_metrics_count_tokens_like_trl():
    lp, old, adv, mask, _, _ = _random_batch(seed=3)
    _, m = policy_loss(lp, old, adv, mask, loss_type="bnpo")
    low = high = n = 0
    lp_l, old_l, adv_l, mask_l = lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()
    for i in range(len(lp_l)):
        for t in range(len(lp_l[0])):
            if mask_l[i][t]:
                r = math.exp(lp_l[i][t] - old_l[i][t])
                low += int(r < 0.8 and adv_l[i] < 0)
                high += int(r > 1.28 and adv_l[i] > 0)
                n += 1
    assert low > 0 and high > 0, "test batch must exercise both clip sides"
    assert m["clip_ratio/low_mean"].item() == pytest.approx(low / n, abs=1e-12)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(high / n, abs=1e-12)
    assert m["clip_ratio/region_mean"].item() == pytest.approx((low + high) / n, abs=1e-12)


def test_policy_loss_on_policy_gradient_is_policy_gradient():
    """old=None (num_iterations=1): ratio 1, gradient = -A * mask / normaliser, loss value -mean(A)."""
    lp, _, adv, mask, _, _ = _random_batch(seed=4)
    lp.requires_grad_(True)
    loss, _ = policy_loss(lp, None, adv, mask, loss_type="bnpo")
    loss.backward()
    expected = -(adv[:, None] * mask) / mask.sum()
    torch.testing.assert_close(lp.grad, expected)
    torch.testing.assert_close(loss.detach(), (-(adv[:, None] * mask)).sum() / mask.sum())


def test_gradient_accumulation_scaling():
    lp, old, adv, mask, _, _ = _random_batch(seed=5)
    for lt in ("grpo", "bnpo", "dr_grpo", "dapo"):
        one, _ = policy_loss(lp, old, adv, mask, loss_type=lt, max_completion_length=9)
        four, _ = policy_loss(lp, old, adv, mask, loss_type=lt, max_completion_length=9,
                              gradient_accumulation_steps=4)
        torch.testing.assert_close(four, one / 4)
    # dapo with the global token count is already normalised over the accumulated batch
    g1, _ = policy_loss(lp, old, adv, mask, loss_type="dapo", num_items_in_batch=100)
    g4, _ = policy_loss(lp, old, adv, mask, loss_type="dapo", num_items_in_batch=100, gradient_accumulation_steps=4)
    torch.testing.assert_close(g1, g4)


def test_policy_loss_bad_input():
    lp, old, adv, mask, _, _ = _random_batch(seed=6)
    with pytest.raises(QerlError, match="loss_type"):
        policy_loss(lp, old, adv, mask, loss_type="ppo")
    with pytest.raises(QerlError, match="max_completion_length"):
        policy_loss(lp, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(QerlError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, beta=0.1)
    with pytest.raises(QerlError, match="advantages"):
        policy_loss(lp, old, adv[:-1], mask)


# ------------------------------------------------------------------------------------------------- TIS
def test_tis_weights_truncate_and_report():
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(4, 6, generator=g) * 2
    rollout = old + torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    w, m = tis_weights(old, rollout, mask, cap=2.0)
    ws, ds = [], []
    for i in range(4):
        for t in range(6):
            ref = min(math.exp(old[i, t].item() - rollout[i, t].item()), 2.0) if mask[i, t] else 1.0
            assert w[i, t].item() == pytest.approx(ref, rel=1e-6)
            if mask[i, t]:
                ws.append(ref)
                ds.append(abs(old[i, t].item() - rollout[i, t].item()))
    assert max(ws) == 2.0 and min(ws) < 1.0, "test data must hit the cap and go below 1"
    assert m["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(sum(ws) / len(ws), rel=1e-6)
    assert m["sampling/importance_sampling_ratio/max"].item() == pytest.approx(2.0)
    assert m["sampling/sampling_logp_difference/mean"].item() == pytest.approx(sum(ds) / len(ds), rel=1e-6)
    assert m["sampling/sampling_logp_difference/max"].item() == pytest.approx(max(ds), rel=1e-6)
    with pytest.raises(QerlError, match="cap"):
        tis_weights(old, rollout, mask, cap=0.5)


def test_masked_mean_and_entropy_stats():
    ent = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert masked_mean(ent, mask).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(ent, mask, dim=-1), torch.tensor([1.5, 3.0, 0.0]))
    stats = masked_entropy_stats(ent, mask)
    assert stats["entropy"].item() == pytest.approx(2.0)
    assert stats["entropy/seq_min"].item() == pytest.approx(1.5)
    assert stats["entropy/seq_max"].item() == pytest.approx(3.0)


# ------------------------------------------------------------------------------------ chunked log-probs
@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    return model


def _padded_batch(vocab, seed=0):
    """Left-padded prompts (3, 6) + right-padded completions (3, 5), TRL's layout."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (3, 6), generator=g)
    completion = torch.randint(0, vocab, (3, 5), generator=g)
    p_mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    c_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    return torch.cat([prompt, completion], 1), torch.cat([p_mask, c_mask], 1), c_mask


def _full_logits_reference(model, ids, attn, keep, temperature):
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -keep - 1:-1].float()
    logp_all = torch.log_softmax(logits / temperature, -1)
    lp = logp_all.gather(-1, ids[:, -keep:, None]).squeeze(-1)
    return lp, -(logp_all.exp() * logp_all).sum(-1)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare_with_full_logits(model, ids, attn, c_mask, temperature=0.7, chunk_size=4):
    weights = torch.randn(c_mask.shape, generator=torch.Generator().manual_seed(1)) * c_mask
    model.zero_grad()
    lp_ref, ent_ref = _full_logits_reference(model, ids, attn, c_mask.shape[1], temperature)
    (lp_ref * weights).sum().backward()
    g_ref = _grads(model)
    model.zero_grad()
    lp, ent = token_logprobs(model, ids, attn, c_mask.shape[1], temperature=temperature, chunk_size=chunk_size)
    (lp * weights).sum().backward()
    g = _grads(model)
    assert lp.shape == ent.shape == c_mask.shape
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref.detach(), rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys() and len(g) > 0
    for name in g:
        # float32 sums in another order (chunks vs one pass): entries near zero get an absolute error on the
        # scale of the tensor's largest ones (AVX2-only CPUs: 1e-5 at |g| ~ 6 in the embedding gradient)
        atol = max(1e-6, 1e-5 * g_ref[name].abs().max().item())
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=atol, msg=name)
    model.zero_grad()


@pytest.mark.parametrize("attn_impl", ["sdpa", "eager"])
def test_token_logprobs_match_full_logits_with_padding(tiny_model, attn_impl):
    ids, attn, c_mask = _padded_batch(tiny_model.config.vocab_size)
    previous = tiny_model.config._attn_implementation
    tiny_model.set_attn_implementation(attn_impl)
    try:  # 15 completion tokens in chunks of 4: ragged last chunk
        _compare_with_full_logits(tiny_model, ids, attn, c_mask, temperature=0.7, chunk_size=4)
    finally:
        tiny_model.set_attn_implementation(previous)


def test_token_logprobs_through_peft(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    ids, attn, c_mask = _padded_batch(base.config.vocab_size, seed=2)
    _compare_with_full_logits(model, ids, attn, c_mask, temperature=1.0, chunk_size=7)
    with model.disable_adapter():  # the KL reference path: adapter off, same call
        lp_off, _ = token_logprobs(model, ids, attn, 5)
    clean = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # never saw LoRA
    lp_base, _ = _full_logits_reference(clean, ids, attn, 5, 1.0)
    lp_on, _ = token_logprobs(model, ids, attn, 5)
    assert (lp_on - lp_base).abs().max() > 1e-3, "the adapter must change the log-probs for this to test anything"
    torch.testing.assert_close(lp_off, lp_base.detach(), rtol=1e-5, atol=1e-5)


def test_token_logprobs_never_keep_full_logits_for_backward(tiny_model):
    """Saved-for-backward tensors stay below one chunk of logits: the (B, T, V) tensor is never kept."""
    ids, attn, c_mask = _padded_batch(tiny_model.config.vocab_size)
    vocab, chunk = tiny_model.config.vocab_size, 4
    biggest = []

    def pack(t):
        if t.dim() >= 1 and t.shape[-1] == vocab:
            biggest.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = token_logprobs(tiny_model, ids, attn, 5, chunk_size=chunk)
    assert max(biggest, default=0) <= chunk * vocab
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the hook does see the plain path
        _full_logits_reference(tiny_model, ids, attn, 5, 1.0)
    assert max(biggest) >= 3 * 5 * vocab


@pytest.mark.parametrize("dtype,temperature,tol", [(torch.float32, 1.0, 1e-5), (torch.float32, 0.7, 1e-5),
                                                     (torch.bfloat16, 0.6, 1e-2)])
def test_target_logprob_matches_float64_log_softmax(dtype, temperature, tol):
    """The in-place log-prob Function: values, entropy and gradient vs float64 log_softmax + gather."""
    from qerl.grpo import TargetLogProb

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 301, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 301, (9,), generator=g)
    weights = torch.randn(9, generator=g)
    ref_in = logits.double().requires_grad_()
    logp_all = torch.log_softmax(ref_in / temperature, -1)
    lp_ref = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent_ref = -(logp_all.exp() * logp_all).sum(-1)
    (lp_ref * weights.double()).sum().backward()
    x = logits.clone().requires_grad_()
    lp, ent = TargetLogProb.apply(x, targets, temperature)
    (lp * weights).sum().backward()
    assert not ent.requires_grad and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=tol, atol=tol)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), ref_in.grad, rtol=tol, atol=tol)
    assert torch.equal(x.detach(), logits), "the input logits must be left as they were"


def test_token_logprobs_bad_input(tiny_model):
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(QerlError, match="logits_to_keep"):
        token_logprobs(tiny_model, ids, torch.ones_like(ids), 4)
    with pytest.raises(QerlError, match="attention_mask"):
        token_logprobs(tiny_model, ids, torch.ones(2, 3), 2)
    with pytest.raises(QerlError, match="causal LM"):
        token_logprobs(torch.nn.Linear(2, 2), ids, torch.ones_like(ids), 2)


@pytest.mark.gpu
def test_token_logprobs_gpu_bf16_peak_memory_and_values():
    """On the device: a Qwen2.5-vocab model in bf16, B=8 x 1024 completion tokens. The chunked path's peak
    (forward + backward) must stay far below the full-logits path's, with the same log-probs and gradients."""
    from transformers import Qwen2ForCausalLM

    from qerl.resources import tiny_qwen2_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(151936, hidden_size=256, intermediate_size=512))
    model = model.to("cuda", torch.bfloat16)
    B, P, T = 8, 64, 1024
    ids = torch.randint(0, 151936, (B, P + T), device="cuda")
    attn = torch.ones_like(ids)
    attn[1::2, :17] = 0  # left padding on every other row
    weights = torch.randn(B, T, device="cuda")

    def measure(fn):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = fn()
        (lp * weights).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return lp.detach(), peak, model.lm_head.weight.grad.clone()

    lp, peak, g = measure(lambda: token_logprobs(model, ids, attn, T, chunk_size=1024)[0])
    nonfinite = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not nonfinite, f"left padding gave non-finite gradients in {nonfinite[:3]}"
    lp_ref, peak_ref, g_ref = measure(lambda: _full_logits_reference(model, ids, attn, T, 1.0)[0])
    print(f"\npeak GiB full-logits {peak_ref / 2**30:.2f} chunked {peak / 2**30:.2f}; "
          f"max |dlogp| {(lp - lp_ref).abs().max().item():.3e}")
    assert peak < peak_ref / 4
    assert (lp - lp_ref).abs().mean() < 5e-3 and (lp - lp_ref).abs().max() < 1e-1
    g, g_ref = g.double(), g_ref.double()
    rows = torch.isfinite(g_ref).all(-1)  # the plain path's NaN (embedding rows of pad tokens) is not ours
    g, g_ref = g[rows].flatten(), g_ref[rows].flatten()
    cos = (g @ g_ref / (g.norm() * g_ref.norm())).item()
    print(f"lm_head grad cosine {cos:.6f}")
    assert cos > 0.999


def test_mixed_precision_runs_lora_in_the_model_dtype(tiny_model_dir):
    """train.mixed_precision=auto on a bf16 model with fp32 adapters: the LoRA matmuls see bf16 inputs (no fp32
    copy of each layer input), the log-probs and gradients stay close to the fp32-LoRA path, the master weights
    and their gradients stay fp32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.e2e_workers import make_trainer
    from qerl.trainer import Batch

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    trainer = make_trainer(model, tok, prompts, fp4=False, num_generations=2, completion_len=4, micro_batch_size=2,
                           lora_r=4, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (2, 10), generator=g)
    batch = Batch(ids, torch.ones_like(ids), torch.ones(2, 4), torch.zeros(2, 4), torch.randn(2, generator=g))
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
             for name, m in model.named_modules() if name.endswith("lora_A.default")]
    results = {}
    try:
        for mode in ("off", "auto"):
            trainer.cfg = trainer.cfg.model_copy(update={"mixed_precision": mode})
            seen.clear()
            model.zero_grad()
            lp, _ = trainer.logprobs(batch, slice(0, 2))
            (lp * torch.linspace(-1, 1, 4)).sum().backward()
            results[mode] = (lp.detach().float(), [p.grad.clone() for p in trained], set(seen))
    finally:
        for h in hooks:
            h.remove()
    assert trainer._autocast_dtype() == torch.bfloat16
    assert results["off"][2] == {torch.float32} and results["auto"][2] == {torch.bfloat16}
    torch.testing.assert_close(results["auto"][0], results["off"][0], rtol=0, atol=5e-2)
    for g_auto, g_off in zip(results["auto"][1], results["off"][1]):
        assert g_auto.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g_auto.flatten().double(), g_off.flatten().double(), dim=0)
        assert cos > 0.99
    trainer.cfg = trainer.cfg.model_copy(update={"mixed_precision": "auto"})
    model.float()  # an fp32 model has nothing to autocast to
    assert trainer._autocast_dtype() is None


def test_training_forward_and_backward_leave_cudnn_attention_out_unless_asked(tiny_model_dir):
    """train.cudnn_attention false (default): every SDPA call of the training forward, and of backward's
    gradient-checkpoint recompute, runs with cuDNN disabled (it builds a graph per new sequence length); true
    leaves SDPA's choice alone; outside the update the global setting is untouched."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.e2e_workers import make_trainer
    from qerl.trainer import Batch

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    trainer = make_trainer(model, tok, [[5, 6, 7, 8]], fp4=False, num_generations=2, completion_len=4,
                           micro_batch_size=2, lora_r=4, seed=0)
    ids = torch.randint(0, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids, torch.ones_like(ids), torch.ones(2, 4), torch.zeros(2, 4), torch.ones(2))
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(*args, **kwargs)

    before = torch.backends.cuda.cudnn_sdp_enabled()
    F.scaled_dot_product_attention = spy
    try:
        for flag, packed in ((False, False), (True, False), (False, True)):
            trainer.cfg = trainer.cfg.model_copy(update={"cudnn_attention": flag, "gradient_checkpointing": True})
            trainer.packable, trainer.prompts_packed = packed, False  # rows padded or packed, a prompt per row
            seen.clear()
            model.train()  # as the update: transformers checkpoints layers only in training mode
            lp, _ = trainer.logprobs(batch, slice(0, 2))
            with trainer._forward_precision(backward=True):
                lp.sum().backward()
            layers = model.config.num_hidden_layers
            # the forward, then backward's recompute of each layer; packed on the CPU: one call per row
            assert len(seen) == 2 * layers * (2 if packed else 1), seen
            assert {enabled for _, enabled in seen} == {flag and before}
    finally:
        F.scaled_dot_product_attention = sdpa
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
