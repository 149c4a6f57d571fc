"""A hook-free copy of a sharded model for the rollout engines (qerl.fsdp.GatheredPolicy, qerl.fp4_rollout): the
same class built on the meta device from a copy of the model's config, the model's buffers shared, parameters
filled from the FSDP2 shards' full tensors by the owner.

    module = meta_copy(model)            # no storage yet: the owner allocates its parameters
    share_buffers(module, model)         # once the model sits on its device
    p.copy_(full_tensor(shard))          # an all-gather for a DTensor (every rank calls), the tensor itself else
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def meta_copy(model: nn.Module) -> nn.Module:
    """type(model) on the meta device, in eval mode, no gradients, with its own config (the engines swap the
    attention implementation in it) and the model's generation_config (the EOS ids the engines read)."""
    with torch.device("meta"):
        module = type(model)(copy.deepcopy(model.config))
    module.generation_config = model.generation_config
    module.requires_grad_(False).eval()
    return module


def share_buffers(module: nn.Module, model: nn.Module) -> None:
    """Give `module` the model's buffers (rotary frequencies; FSDP leaves buffers whole), by name."""
    for name, buf in model.named_buffers():
        owner, _, key = name.rpartition(".")
        module.get_submodule(owner)._buffers[key] = buf


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (an all-gather: every rank calls), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
