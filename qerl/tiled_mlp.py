"""Token-tiled MLPs for training memory.

    n = tile_mlps(model, chunks=4)     # every decoder layer's MLP; tile_mlps(model, 1) puts the originals back

While autograd records, each decoder layer's MLP runs over `chunks` slices of the tokens, each slice under its own
non-reentrant activation checkpoint, so a backward pass holds the (tokens, intermediate_size) tensors of one slice
at a time (gate and up outputs, the activation, their gradients; Qwen2.5-7B at 2304 tokens: 87 MB each in bf16)
instead of those of all tokens. An MLP acts on each token alone, so outputs and gradients are the untiled ones;
the price is one more MLP forward per slice in backward (the TiledMLP of long-sequence training recipes). With
`torch.no_grad()` (rollouts, evaluation) the original forward runs unchanged.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qerl.forward_swap import restore_forward, swap_forward

_ORIGINAL = "_qerl_untiled_forward"


def decoder_mlps(model: nn.Module) -> list[nn.Module]:
    """The `mlp` submodule of every decoder layer (a module with both `self_attn` and `mlp`)."""
    return [m.mlp for m in model.modules() if isinstance(getattr(m, "mlp", None), nn.Module)
            and hasattr(m, "self_attn")]


def _tiled_forward(original, chunks: int, x: torch.Tensor, *args, **kwargs):
    if not torch.is_grad_enabled() or x.dim() < 2 or x.shape[-2] < 2 or args or kwargs:
        return original(x, *args, **kwargs)
    size = math.ceil(x.shape[-2] / chunks)
    return torch.cat([checkpoint(original, part, use_reentrant=False) for part in x.split(size, dim=-2)], dim=-2)


def tile_mlps(model: nn.Module, chunks: int) -> int:
    """Tile every decoder layer's MLP over `chunks` token slices (1: untiled); returns how many MLPs it set."""
    if chunks < 1:
        raise ValueError(f"chunks: expected >= 1, got {chunks}")
    mlps = decoder_mlps(model)
    for mlp in mlps:
        if hasattr(mlp, _ORIGINAL):  # untile first: what `forward` was before (an instance hook, or the class's)
            restore_forward(mlp, _ORIGINAL)
        if chunks > 1:
            swap_forward(mlp, _ORIGINAL, functools.partial(_tiled_forward, mlp.forward, chunks))
    return len(mlps)
