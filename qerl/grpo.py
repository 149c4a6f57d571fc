"""GRPO/DAPO numerics as pure functions: group advantages, chunked token log-probs, the clipped token loss, TIS.

Names and normalisations follow TRL's GRPOTrainer so users feel at home (scale_rewards, loss_type, epsilon,
epsilon_high, beta, num_items_in_batch, clip_ratio/* metrics); the trainer (qerl.trainer.GRPOTrainer) owns the loop.

    adv = group_advantages(rewards, group_size=8)                       # (B*G,)
    lp, ent = token_logprobs(model, input_ids, attention_mask, logits_to_keep=T, temperature=1.0)
    w, m = tis_weights(old_lp, rollout_lp, completion_mask, cap=2.0)    # optional rollout correction
    loss, metrics = policy_loss(lp, old_lp, adv, completion_mask, loss_type="dapo", is_weights=w)
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from qerl.errors import QerlError
from qerl.fused_elementwise import target_logprobs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
PACKED_ATTENTION = "qerl_packed"  # qerl.packing's attention implementation (defined here: packing imports this module)


# --------------------------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4) -> Tensor:
    """Group-relative advantages for rewards laid out prompt-major (row i*G+j = sample j of prompt i).

    As TRL: A = r - mean_group(r), divided by (std + eps) with the unbiased std of the group ("group"), of the
    whole batch ("batch"), or not at all ("none", Dr. GRPO). A group whose rewards are all equal carries no
    learning signal; its advantages are set to exactly 0 (the mean of equal floats need not equal them bit-exactly).
    """
    if group_size < 2:
        raise QerlError(f"num_generations (group size) must be >= 2 for group-relative advantages, got {group_size}")
    if scale_rewards not in SCALE_REWARDS:
        raise QerlError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise QerlError(f"rewards must be 1-D with a length divisible by group size {group_size}, "
                        f"got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise QerlError("rewards contain NaN or inf; reward functions must return finite numbers")
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        centred = centred / (rewards.std() + eps)
    constant = constant_groups(rewards, group_size)[:, None]
    return torch.where(constant, torch.zeros_like(centred), centred).reshape(-1)


def constant_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(groups,) bool: the groups whose rewards are all equal, i.e. zero advantage and no gradient. Exact equality,
    not std == 0: torch's float32 std of one group of eight 0.1 rewards is 8e-9, not 0."""
    grouped = rewards.view(-1, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


# ------------------------------------------------------------------------------------------- log-probs
def split_causal_lm(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder body, lm_head) of an HF causal LM, directly or through a peft wrapper.

    peft's PeftModel/LoraModel forward unknown attributes to the wrapped model, so get_decoder() and
    get_output_embeddings() reach the LoRA-injected modules; calling them runs the adapters as model() would.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if head is None or body is None or body is model:
        raise QerlError(f"model {type(model).__name__}: expected a causal LM with get_decoder() and "
                        "get_output_embeddings() (transformers *ForCausalLM, optionally peft-wrapped)")
    return body, head


def _padding_safe_mask(model, attention_mask: Tensor) -> Tensor:
    """The mask to give the decoder: the 2-D one, or for left-padded batches a 4-D causal + key-padding mask in
    which each padded query attends to itself.

    Leading pad positions otherwise have every key masked; CUDA SDPA kernels then return NaN gradients for those
    rows, and the NaN spreads into every weight's gradient (measured: torch 2.11 + transformers 5.17 on an H200,
    plain model(...) too). Real tokens see exactly the keys they saw before, so log-probs do not change.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl not in ("sdpa", "eager", PACKED_ATTENTION) or bool(attention_mask[:, 0].all()):
        return attention_mask
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    empty = ~allowed.any(-1, keepdim=True)  # only leading pads: other rows keep HF's mask exactly
    allowed |= torch.eye(length, dtype=torch.bool, device=attention_mask.device)[None] & empty
    allowed = allowed[:, None]  # (B, 1, L, L)
    if impl != "eager":  # qerl.packing's scope runs unpacked calls through SDPA
        return allowed
    dtype = model.get_input_embeddings().weight.dtype  # eager adds the mask to the scores
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                      torch.finfo(dtype).min)


class TargetLogProb(torch.autograd.Function):
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T), rows of (N, V) logits.

    Memory: forward keeps one fp32 (N, V) buffer (log softmax, computed in place) and backward rewrites that
    buffer in place into the gradient (softmax * -g, + g at the target), so a chunk costs 4 N V bytes plus the
    head's own output and its gradient (and one more fp32 buffer while the entropy is summed); torch's
    log_softmax + gather + an entropy graph saved three fp32 (N, V) tensors and made as many again in backward.
    The entropy carries no gradient (it is a metric).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float):
        u = logits.to(torch.float32, copy=True)  # a copy even for fp32 logits: it becomes log p, then the grad
        if temperature != 1.0:
            u.div_(temperature)
        u.sub_(torch.logsumexp(u, dim=-1, keepdim=True))  # log softmax, in place
        logp = u.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        p = u.exp()
        entropy = -p.mul_(u).sum(-1)
        del p
        ctx.save_for_backward(u, targets)
        ctx.temperature, ctx.in_dtype = temperature, logits.dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        u, targets = ctx.saved_tensors
        g = grad_logp.float() / ctx.temperature
        grad = u.exp_().mul_(-g.unsqueeze(-1))  # d logp_t / d z = onehot(t) - softmax, times g / T
        grad.scatter_add_(-1, targets.unsqueeze(-1), g.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def _chunk_logprobs(head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float):
    """log p(target) and entropy for a (N, H) chunk; logits live only inside this call (checkpointed). A head
    marked by qerl.fused_elementwise takes the compiled path while autograd records on the GPU."""
    logits = head(hidden)
    fused = target_logprobs(head, logits, targets, temperature)
    return fused if fused is not None else TargetLogProb.apply(logits, targets, temperature)


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *,
                   temperature: float = 1.0, chunk_size: int = 512,
                   position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of the last `logits_to_keep` tokens of each row (TRL's layout: left-padded
    prompt + right-padded completion), without ever materialising the (B, T, V) logits.

    The decoder body runs once; lm_head + log_softmax then run over chunks of `chunk_size` token positions, each
    under activation checkpointing so backward also holds only one chunk's logits (O(chunk_size * V) memory).
    Logits are divided by `temperature` first, matching the rollout engine's log-probs. Position ids default to
    cumsum(attention_mask) - 1 as in generation. Returns (logprobs (B, T) with grad, entropy (B, T) detached:
    entropy is for metrics only).
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise QerlError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                        "must both be (batch, length)")
    if not 0 < logits_to_keep < input_ids.shape[1]:
        raise QerlError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}] (completion length), "
                        f"got {logits_to_keep}")
    if temperature <= 0 or chunk_size < 1:
        raise QerlError(f"temperature must be > 0 and chunk_size >= 1, got {temperature} and {chunk_size}")
    body, head = split_causal_lm(model)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = body(input_ids=input_ids, attention_mask=_padding_safe_mask(model, attention_mask),
                  position_ids=position_ids, use_cache=False).last_hidden_state
    batch, keep = input_ids.shape[0], logits_to_keep
    # position t predicts token t+1: the states before the last `keep` tokens score them
    hidden = hidden[:, -keep - 1:-1, :].reshape(batch * keep, -1)
    lp, ent = chunked_head_logprobs(head, hidden, input_ids[:, -keep:].reshape(-1), temperature, chunk_size)
    return lp.view(batch, keep), ent.view(batch, keep)


def chunked_head_logprobs(head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float,
                          chunk_size: int) -> tuple[Tensor, Tensor]:
    """lm_head + log_softmax over (N, H) states, `chunk_size` rows at a time, each chunk checkpointed.

    Returns (log p(target) (N,) with grad, entropy (N,) detached).
    """
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, en = checkpoint(_chunk_logprobs, head, h, t, temperature, use_reentrant=False)
        else:
            lp, en = _chunk_logprobs(head, h, t, temperature)
        logps.append(lp)
        ents.append(en.detach())
    return torch.cat(logps), torch.cat(ents)


# ------------------------------------------------------------------------------------------------- loss
def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over positions where mask is set (all dims, or along `dim`); 0 where nothing is set."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_entropy_stats(entropy: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Token entropy over completion tokens for logging: `entropy` (TRL's name, token mean), min/max of the
    per-sequence means (a collapsing or exploding sample stands out)."""
    entropy = entropy.detach()
    per_seq = masked_mean(entropy, mask, dim=-1)
    has_tokens = mask.sum(-1) > 0
    seq = per_seq[has_tokens] if has_tokens.any() else per_seq.new_zeros(1)
    return {"entropy": masked_mean(entropy, mask), "entropy/seq_min": seq.min(), "entropy/seq_max": seq.max()}


def _check_loss_inputs(logprobs, old_logprobs, advantages, mask, loss_type, max_completion_length):
    if loss_type not in LOSS_TYPES:
        raise QerlError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if logprobs.dim() != 2 or mask.shape != logprobs.shape:
        raise QerlError(f"logprobs {tuple(logprobs.shape)} and completion mask {tuple(mask.shape)} must be "
                        "the same (batch, completion_length)")
    if old_logprobs is not None and old_logprobs.shape != logprobs.shape:
        raise QerlError(f"old_logprobs shape {tuple(old_logprobs.shape)} != logprobs {tuple(logprobs.shape)}")
    if advantages.shape not in ((logprobs.shape[0],), logprobs.shape):
        raise QerlError(f"advantages must be (batch,) or (batch, T), got {tuple(advantages.shape)}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise QerlError("loss_type 'dr_grpo' needs max_completion_length (the fixed length normaliser)")


def _normalise(per_token: Tensor, mask: Tensor, loss_type: str, max_completion_length: int | None,
               num_items_in_batch: float | Tensor | None, gradient_accumulation_steps: int) -> Tensor:
    """Reduce the (B, T) token loss to a scalar the way TRL's loss_type does."""
    summed = per_token * mask
    if loss_type == "grpo":  # per-sequence mean, then mean over sequences
        loss = (summed.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":  # token mean over the local (micro)batch
        loss = summed.sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":  # constant normaliser: no length bias
        loss = summed.sum() / (per_token.shape[0] * max_completion_length)
    elif num_items_in_batch is not None:  # dapo: token mean over the whole (accumulated, global) batch
        return summed.sum() / torch.as_tensor(num_items_in_batch, dtype=summed.dtype).clamp(min=1.0)
    else:  # dapo without a global count degrades to the local token mean
        loss = summed.sum() / mask.sum().clamp(min=1.0)
    return loss / gradient_accumulation_steps


def policy_loss(logprobs: Tensor, old_logprobs: Tensor | None, advantages: Tensor, mask: Tensor, *,
                loss_type: str = "dapo", epsilon: float = 0.2, epsilon_high: float | None = 0.28,
                beta: float = 0.0, ref_logprobs: Tensor | None = None, is_weights: Tensor | None = None,
                max_completion_length: int | None = None, num_items_in_batch: float | Tensor | None = None,
                gradient_accumulation_steps: int = 1) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level PPO-clip loss with asymmetric clip range [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher).

    Per token: -min(r A, clip(r) A) with r = exp(logprobs - old_logprobs) (old = detached logprobs when None,
    i.e. num_iterations = 1), times `is_weights` (truncated importance weights correcting the rollout/trainer
    mismatch), plus beta * k3 KL to `ref_logprobs`. Normalised per `loss_type` as TRL: grpo = mean over sequences
    of each sequence's token mean; bnpo = token mean of this microbatch; dr_grpo = sum / (B *
    max_completion_length); dapo = sum / num_items_in_batch (completion tokens of the whole accumulated batch),
    falling back to the local token count. All but dapo-with-num_items_in_batch are divided by
    `gradient_accumulation_steps`, like TRL. Metrics are detached 0-d tensors (token means over the mask).
    """
    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, loss_type, max_completion_length)
    if beta > 0 and ref_logprobs is None:
        raise QerlError(f"beta={beta} > 0 needs ref_logprobs (log-probs of the reference policy)")
    mask = mask.to(logprobs.dtype)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if is_weights is not None:
        per_token = per_token * is_weights
    metrics = {}
    if beta > 0:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    loss = _normalise(per_token, mask, loss_type, max_completion_length, num_items_in_batch,
                      gradient_accumulation_steps)
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (adv < 0)
        high = (ratio > 1 + epsilon_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = masked_mean(low.to(mask.dtype), mask)
        metrics["clip_ratio/high_mean"] = masked_mean(high.to(mask.dtype), mask)
        metrics["clip_ratio/region_mean"] = masked_mean((low | high).to(mask.dtype), mask)
    return loss, metrics


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor,
                cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance-sampling weights min(exp(old - rollout), cap) per token.

    The rollout policy (noisy AQN weights, another engine/kernel) is not the policy the loss differentiates; the
    token-level truncated IS ratio corrects the expectation with bounded variance (Yao et al., "Your efficient RL
    framework secretly brings you off-policy RL training"). Masked tokens get weight 1. Metrics use TRL's names.
    """
    if old_logprobs.shape != rollout_logprobs.shape or mask.shape != old_logprobs.shape:
        raise QerlError(f"old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
                        f"{tuple(rollout_logprobs.shape)} and mask {tuple(mask.shape)} must have the same shape")
    if cap < 1:
        raise QerlError(f"tis cap must be >= 1, got {cap}")
    with torch.no_grad():
        diff = old_logprobs.detach() - rollout_logprobs.detach()
        on = mask.bool()
        weights = torch.where(on, torch.exp(diff).clamp(max=cap), torch.ones_like(diff))
        sel_w, sel_d = weights[on], diff[on].abs()
        if sel_w.numel() == 0:
            sel_w, sel_d = weights.new_ones(1), diff.new_zeros(1)
        metrics = {
            "sampling/importance_sampling_ratio/min": sel_w.min(),
            "sampling/importance_sampling_ratio/mean": sel_w.mean(),
            "sampling/importance_sampling_ratio/max": sel_w.max(),
            "sampling/sampling_logp_difference/mean": sel_d.mean(),
            "sampling/sampling_logp_difference/max": sel_d.max(),
        }
    return weights, metrics
