"""One rollout batch as padded tensors in TRL's layout (left-padded prompts, right-padded completions), and the
update's micro-batches of it.

    ids, attn, rollout_lp = pad_rollout(engine_output, pad_id)
    for rows in micro_batch_rows(batch, size=16):      # ordered by completion length, longest first
        sub = micro_batch(batch, rows)                  # cut to its own longest completion
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def pad_rollout(out, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, rollout log-probs (rows, completion length)) of a RolloutOutput in TRL's layout:
    left-padded prompt, then right-padded completion."""
    plen = max(len(p) for p in out.prompt_ids)
    clen = max(1, max(len(c) for c in out.completion_ids))
    rows = len(out.completion_ids)
    ids = torch.full((rows, plen + clen), pad_id, dtype=torch.long)
    attn = torch.zeros((rows, plen + clen), dtype=torch.long)
    logprobs = torch.zeros((rows, clen), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(out.prompt_ids, out.completion_ids, out.logprobs)):
        ids[i, plen - len(p):plen] = torch.tensor(p, dtype=torch.long)
        attn[i, plen - len(p):plen + len(c)] = 1
        if c:
            ids[i, plen:plen + len(c)] = torch.tensor(c, dtype=torch.long)
            logprobs[i, :len(c)] = torch.tensor(lp, dtype=torch.float32)
    return ids, attn, logprobs


@dataclass
class Batch:
    """One rollout batch as padded tensors (TRL layout: left-padded prompt, right-padded completion)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def completion_len(self) -> int:
        return self.completion_mask.shape[1]


def micro_batch(batch: Batch, rows: slice | torch.Tensor) -> Batch:
    """`rows` (a slice or row indices) of the batch, completions cut after the longest one among them: right
    padding past it changes no log-prob (causal attention), and a long-tailed rollout would otherwise compute every
    micro-batch at the step's longest completion."""
    plen = batch.input_ids.shape[1] - batch.completion_len
    real = batch.attention_mask[rows, plen:].bool().any(dim=0).nonzero()
    width = int(real[-1]) + 1 if len(real) else 1
    return Batch(input_ids=batch.input_ids[rows, :plen + width],
                 attention_mask=batch.attention_mask[rows, :plen + width],
                 completion_mask=batch.completion_mask[rows, :width],
                 rollout_logprobs=batch.rollout_logprobs[rows, :width], advantages=batch.advantages[rows])


def micro_batch_rows(batch: Batch, size: int, unit: int = 1, by_length: bool = True) -> list[torch.Tensor]:
    """Row indices of the update's micro-batches of `size` rows. by_length: units of `unit` consecutive rows (a
    prompt's G samples when their prompt is computed once, else single rows) ordered by their longest completion,
    longest first, so that each micro-batch pads close to its own rows' lengths (log-normal RL lengths padded to the
    longest of 16 consecutive rows compute ~1.9x the real tokens; ordered, ~1.03x) and the largest one runs first.
    For a loss that is a sum over rows with constant normalisers the gradient is the same (to float rounding);
    else (by_length False) consecutive rows."""
    rows, device = batch.input_ids.shape[0], batch.attention_mask.device  # indices where the batch is
    if not by_length or size % unit or rows % unit or rows <= size:  # one micro-batch: nothing to gain
        return [torch.arange(i, min(i + size, rows), device=device) for i in range(0, rows, size)]
    plen = batch.input_ids.shape[1] - batch.completion_len
    lengths = batch.attention_mask[:, plen:].sum(dim=1).view(-1, unit).amax(dim=1)
    order = torch.sort(lengths, descending=True, stable=True).indices
    units = (order[:, None] * unit + torch.arange(unit, device=device)).reshape(-1)
    return list(units.split(size))
