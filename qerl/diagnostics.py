"""Per-step diagnostics of a GRPO run beyond TRL's metrics: how far one step moved the trained weights, and how
far quantization moves the policy (the trainer logs them; qerl.ablation plots them per method).

    rollout_entropy(surprise, lengths)                   # rollout/entropy: -log p of the sampled tokens, averaged
    before = snapshot(params); ...optimizer steps...; update_norm(before, params)      # adapter/update_norm
    kl = token_kl(policy, twin, input_ids, attention_mask, logits_to_keep=T)          # quant/kl, per token
    QuantKL.for_config(cfg, device, dtype)               # the trainer's: the dense twin, measured every N steps

The zero-advantage groups (frac_reward_zero_std) use qerl.grpo.constant_groups, as the advantages do.
"""
from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from qerl.errors import QerlError
from qerl.grpo import _padding_safe_mask, split_causal_lm

QUANTIZED_MODES = ("qlora_fp4", "qlora_nf4")


# ------------------------------------------------------------------------------------------ rollout entropy
def rollout_entropy(surprise: Tensor, lengths: Tensor) -> float:
    """Token mean of -log p over the sampled tokens (surprise: each row's sum; lengths: its token count).

    The engines return the sampled token's log-prob under the distribution it was drawn from (AQN noise and
    temperature on), not the whole vocabulary's, and E_{x~p}[-log p(x)] = H(p): this is an unbiased estimate of
    the rollout's per-token entropy at top_p 1 and top_k 0 (else the log-probs are before truncation). The trainer's
    `entropy` is the exact full-vocabulary entropy of the noise-free policy on the same tokens.
    """
    return float(surprise.sum() / lengths.sum().clamp(min=1.0))


# ------------------------------------------------------------------------------------------ update norm
@torch.no_grad()
def snapshot(params: list[Tensor]) -> list[Tensor]:
    """Copies of the trainable parameters (LoRA: a few MB to a few hundred MB), taken before a step's updates."""
    return [p.detach().clone() for p in params]


@torch.no_grad()
def update_norm(before: list[Tensor], params: list[Tensor]) -> float:
    """||params - before||_2 over every parameter together; `before` is overwritten (no second copy)."""
    if not before:
        return 0.0
    torch._foreach_sub_(before, [p.detach() for p in params])
    return float(torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(before)])))


# ------------------------------------------------------------------------------------------ quantization KL
def _completion_states(model, input_ids: Tensor, attention_mask: Tensor, keep: int) -> Tensor:
    """(B * keep, H) hidden states that predict the last `keep` tokens of each row (as qerl.grpo.token_logprobs)."""
    body, _ = split_causal_lm(model)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = body(input_ids=input_ids, attention_mask=_padding_safe_mask(model, attention_mask),
                  position_ids=position_ids, use_cache=False).last_hidden_state
    return hidden[:, -keep - 1:-1, :].reshape(input_ids.shape[0] * keep, -1)


@torch.no_grad()
def token_kl(p_model, q_model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *,
             temperature: float = 1.0, chunk_size: int = 256) -> Tensor:
    """(B, logits_to_keep) KL(p || q) = sum_v p_v (log p_v - log q_v) of the two models' next-token distributions
    at `temperature`, over the whole vocabulary, at each of the last `logits_to_keep` positions: exact per position
    (no sampling estimate), the prefixes being the rows given. Logits live one chunk of positions at a time."""
    if temperature <= 0 or chunk_size < 1:
        raise QerlError(f"temperature must be > 0 and chunk_size >= 1, got {temperature} and {chunk_size}")
    keep = logits_to_keep
    hp = _completion_states(p_model, input_ids, attention_mask, keep)
    hq = _completion_states(q_model, input_ids, attention_mask, keep)
    head_p, head_q = split_causal_lm(p_model)[1], split_causal_lm(q_model)[1]
    out = []
    for start in range(0, hp.shape[0], chunk_size):
        lp = torch.log_softmax(head_p(hp[start:start + chunk_size]).float() / temperature, dim=-1)
        lq = torch.log_softmax(head_q(hq[start:start + chunk_size]).float() / temperature, dim=-1)
        if lp.shape != lq.shape:
            raise QerlError(f"quant_kl: the two models' vocabularies differ ({lp.shape[-1]} vs {lq.shape[-1]})")
        out.append((lp.exp() * (lp - lq)).sum(-1))
    return torch.cat(out).view(input_ids.shape[0], keep)


class QuantKL:
    """quant/kl every train.quant_kl_steps steps: the token mean over the step's completions of KL(quantized policy
    || dense base with the same adapter), both noise-free, measured before the update on the rollout it sampled:
    how far quantization alone moves the policy. Holds the dense twin (a second model: its weights' memory)."""

    def __init__(self, every: int, twin: nn.Module):
        self.every, self.twin = every, twin

    @classmethod
    def for_config(cls, cfg, device, dtype: torch.dtype) -> QuantKL | None:
        """None when off, or when the policy is dense (mode lora or full: it is its own dense twin)."""
        every, model_path = cfg.quant_kl_steps, cfg.quant_kl_model
        if not every or cfg.mode not in QUANTIZED_MODES:
            return None
        return cls(every, load_dense_twin(model_path, cfg, device, dtype))

    def due(self, step: int) -> bool:
        """Steps are 0-based here; step s is logged as s + 1."""
        return (step + 1) % self.every == 0

    @torch.no_grad()
    def measure(self, trainer, batch) -> dict[str, float]:
        """{"quant/kl", "timing/quant_kl"} of this rank's rows of `batch`, token-weighted over every rank."""
        from qerl.batch import micro_batch, micro_batch_rows

        t0 = time.perf_counter()
        sync_twin(self.twin, trainer.model)
        cfg = trainer.cfg
        plen = batch.input_ids.shape[1] - batch.completion_len
        total = torch.zeros(2, dtype=torch.float64, device=batch.input_ids.device)  # KL sum, tokens
        training = trainer.model.training
        trainer.model.eval()  # no LoRA dropout in a measurement; then the mode the update expects, as it was
        for rows in micro_batch_rows(batch, cfg.micro_batch_size):
            sub = micro_batch(batch, rows)
            mask = sub.attention_mask[:, plen:].double()
            with trainer._forward_precision():
                kl = token_kl(trainer.model, self.twin, sub.input_ids, sub.attention_mask, sub.completion_len,
                              temperature=max(cfg.rollout.temperature, 1e-6), chunk_size=cfg.logprob_chunk_size)
            total += torch.stack([(kl.double() * mask).sum(), mask.sum()])
        trainer.model.train(training)
        total = trainer.ranks.all_reduce(total)
        return {"quant/kl": float(total[0] / total[1].clamp(min=1.0)), "timing/quant_kl": time.perf_counter() - t0}


def load_dense_twin(model_path: str | None, cfg, device, dtype: torch.dtype) -> nn.Module:
    """The dense (unquantized) base at model_path (train.quant_kl_model) with the run's LoRA (and norms), frozen,
    in eval mode: the policy as it would be without quantization, once sync_twin has copied the trained weights in.
    load_policy refuses a quantized checkpoint there (mode lora)."""
    from qerl.policy import LoraSpec, load_policy

    if not model_path:
        raise QerlError("train.quant_kl_steps needs train.quant_kl_model: a local dense checkpoint of the base "
                        "(filled from the experiment's model unless it has a model_revision)")
    lora = LoraSpec(r=cfg.lora.lora_r, alpha=cfg.lora.lora_alpha, target_modules=tuple(cfg.lora.target_modules),
                    fused=cfg.lora.fused)
    twin, _ = load_policy(model_path, mode="lora", dtype=dtype, device=device, lora=lora,
                          train_norms=cfg.train_norms)
    return twin.requires_grad_(False).eval()


@torch.no_grad()
def sync_twin(twin: nn.Module, policy: nn.Module) -> None:
    """Copy every trainable parameter of `policy` (LoRA A/B, trained norms) into the twin, by name."""
    theirs = dict(twin.named_parameters())
    for name, p in policy.named_parameters():
        if not p.requires_grad:
            continue
        mine = theirs.get(name)
        if mine is None or mine.shape != p.shape:
            raise QerlError(f"train.quant_kl_model: its LoRA has no {name} of shape {tuple(p.shape)} "
                            f"({'absent' if mine is None else tuple(mine.shape)}): is it the dense original of the "
                            "quantized base?")
        mine.copy_(p)
