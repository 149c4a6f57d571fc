"""An engine that stays resident across policy updates when the card has room for both: its KV pool, captured
decode graphs and weight copies kept, instead of given back at every sleep() and rebuilt (pool, graph capture,
humming's repacked copies: ~1.6 s of a 7B FP4 rollout on an H200).

    with UpdateMemory(device) as meter:                     # the trainer, around each update
        metrics = trainer._update(batch, step)
    engine.plan_update(update_reserve(meter.growth, batch_tokens, max_tokens))
    ...
    blocks = resident_blocks(need, free, utilization, reserve, update_bytes, block_bytes)   # the engine's pool

The update's need is measured (peak allocated minus allocated at its start) and scaled to the longest sequences the
config allows (activations grow with the micro-batch's padded length), plus a margin; the pool is then sized to leave
that much free: every row of a call at full length where that fits, else what is left if it is comfortably more than
the last call used. Where the card cannot, nothing changes: the pool takes its share of free memory and goes back at
every sleep().
"""
from __future__ import annotations

import math

import torch

MARGIN = 1.1  # on the measured update peak, scaled to full length: allocator rounding, a longer micro-batch
SLACK_BYTES = 1 << 30  # and this much more (the CUDA context's growth, cuBLAS workspaces of new shapes)
LAST_PEAK_MARGIN = 1.25  # a pool short of every row at full length: this much over the last call's peak blocks


class UpdateMemory:
    """Peak bytes allocated on `device` during the block beyond what was allocated when it started (`growth`;
    None off CUDA). Resets the allocator's peak counter at entry."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.growth: int | None = None
        self._start = 0

    def __enter__(self) -> "UpdateMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.device.type == "cuda" and exc_type is None:
            self.growth = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)


def update_reserve(growth: int | None, batch_tokens: int, max_tokens: int) -> int | None:
    """Bytes to keep free for later updates: the measured growth scaled from this batch's padded length to the
    longest the config allows, times MARGIN, plus SLACK_BYTES (None when nothing was measured)."""
    if growth is None or batch_tokens <= 0:
        return None
    scale = max(1.0, max_tokens / batch_tokens)
    return int(growth * scale * MARGIN) + SLACK_BYTES


def resident_blocks(need_blocks: int, free: int, utilization: float, reserve: int, update_bytes: int | None,
                    block_bytes: int, last: dict | None = None) -> int | None:
    """The blocks of a resident pool within `utilization` of the free memory that leaves `update_bytes` free
    besides the forward `reserve`: every row of the call at full length (`need_blocks`) where that fits; else all
    the budget allows, if that is at least LAST_PEAK_MARGIN x the blocks the last call used (`last`: its engine
    stats; and no fewer than its pool when it had to preempt), so that a resident pool is never the cause of
    preemption the last one did not have. None: the card cannot (or no update was planned)."""
    if update_bytes is None or block_bytes <= 0:
        return None
    budget = (int(free * utilization) - int(reserve) - int(update_bytes)) // block_bytes
    if budget >= need_blocks:
        return need_blocks if need_blocks >= 2 else None
    last = last or {}
    if not last.get("peak_blocks"):
        return None
    floor = math.ceil(LAST_PEAK_MARGIN * last["peak_blocks"])
    if last.get("preemptions"):
        floor = max(floor, int(last.get("num_blocks", 0)))
    return budget if budget >= max(floor, 2) else None
