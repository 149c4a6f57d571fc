"""Projection groups: FP4 LoRA layers that read the same input (q/k/v, gate/up) run as one launch at inference.

    groups = group_projections(model)        # packed weights re-laid as one stacked tensor; members hold views
    with projections_fused(groups, torch.bfloat16):
        model(...)                           # no autograd: q_proj computes q|k|v in one kernel, k/v take slices
    ungroup_projections(groups)              # members get their own tensors back

vLLM fuses these layers at load time (QKVParallelLinear, MergedColumnParallelLinear); here the model stays a
transformers + peft model, trainable as before, and only inference calls inside `projections_fused` take the
stacked path (`qerl.quant.kernels.fp4_lora_matmul` with `segments`): one FP4 launch and one x @ A.T launch per
group instead of one each per layer. Each member keeps its own global scale and adapter. The first member computes
the whole group when it is called; the others return their slice when called with the very same input tensor, and
compute on their own otherwise (a model that calls them differently stays correct, only unfused).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from qerl.quant.kernels import fp4_lora_matmul

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_STACKED = ("weight_packed", "weight_scale", "weight_global_scale")


class ProjectionGroup:
    """Layers (FP4LoraLinear, one adapter, same rank and scaling) stacked along their outputs."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        bases = [m.base_layer for m in members]
        self.stacked = {}
        with torch.no_grad():
            for name in _STACKED:
                parts = [getattr(b, name).reshape(1) if name == "weight_global_scale" else getattr(b, name)
                         for b in bases]
                self.stacked[name] = torch.cat(parts)
                start = 0
                for base, part in zip(bases, parts):
                    view = self.stacked[name][start:start + part.shape[0]]
                    base._buffers[name] = view.reshape(getattr(base, name).shape)
                    start += part.shape[0]
            self.bias = None if bases[0].bias is None else torch.cat([b.bias.detach() for b in bases])
        self.adapter = members[0].active_adapters[0]
        self.scaling = float(members[0].scaling[self.adapter])
        self.lora_a = self.lora_b = None  # stacked adapter copies in the compute dtype, filled by refresh()
        self.active = False
        self._x = None
        self._outs = None
        for i, m in enumerate(members):
            m.__dict__["_qerl_group"] = (self, i)

    @staticmethod
    def compatible(members: list[nn.Module]) -> bool:
        """Same input size, device, bias presence, one common adapter with one rank and scaling, NVFP4 bases,
        output sizes that a kernel tile boundary can separate (multiples of 16)."""
        from qerl.quant.lora import FP4LoraLinear

        if len(members) < 2 or not all(isinstance(m, FP4LoraLinear) for m in members):
            return False
        first = members[0]
        if len(first.active_adapters) != 1:
            return False
        name = first.active_adapters[0]

        def signature(m):
            base = m.base_layer
            if name not in m.lora_A.keys() or list(m.active_adapters) != [name]:
                return None
            return (base.fmt, base.in_features, base.weight_packed.device, base.bias is None,
                    m.r[name], float(m.scaling[name]), m.out_features % 16 == 0)

        sigs = [signature(m) for m in members]
        return sigs[0] is not None and sigs[0][0] == "nvfp4" and sigs[0][-1] and all(s == sigs[0] for s in sigs)

    def refresh(self, dtype: torch.dtype) -> None:
        """Stack the members' current adapter weights in `dtype` (into the same buffers when shapes allow, so a
        captured CUDA graph keeps reading valid addresses)."""
        with torch.no_grad():
            a = torch.cat([m.lora_A[self.adapter].weight for m in self.members]).to(dtype)
            b = torch.cat([m.lora_B[self.adapter].weight for m in self.members]).to(dtype)
            if self.lora_a is None or self.lora_a.shape != a.shape or self.lora_a.dtype != dtype:
                self.lora_a, self.lora_b = a, b
            else:
                self.lora_a.copy_(a)
                self.lora_b.copy_(b)

    def member_forward(self, index: int, x: torch.Tensor):
        """The output of member `index` from the stacked call, or None when it must compute on its own."""
        if not self.active or torch.is_grad_enabled():
            return None
        if index == 0:
            self._outs = self._x = None
            if self._usable(x):
                out = fp4_lora_matmul(x, self.stacked["weight_packed"], self.stacked["weight_scale"],
                                      self.stacked["weight_global_scale"], self.bias, self.lora_a, self.lora_b,
                                      self.scaling, self.sizes)
                self._outs, self._x = out.split(self.sizes, dim=-1), x
                return self._outs[0]
            return None
        if self._outs is None or x is not self._x:
            return None
        out = self._outs[index]
        if index == len(self.members) - 1:
            self._outs = self._x = None
        return out

    def _usable(self, x: torch.Tensor) -> bool:
        first = self.members[0]
        if self.lora_a is None or x.dtype != self.lora_a.dtype or first.disable_adapters:
            return False
        for m in self.members:
            drop = m.lora_dropout[self.adapter]
            if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0:
                return False
        return True

    def ungroup(self) -> None:
        """Give every member contiguous tensors of its own again and detach it from the group."""
        with torch.no_grad():
            for m in self.members:
                for name in _STACKED:
                    m.base_layer._buffers[name] = m.base_layer._buffers[name].clone()
                m.__dict__.pop("_qerl_group", None)
        self.stacked, self.lora_a, self.lora_b, self._outs, self._x = {}, None, None, None, None


def group_projections(model: nn.Module, groups=GROUPS) -> list[ProjectionGroup]:
    """A ProjectionGroup for every module whose children named by one of `groups` are compatible FP4 LoRA
    layers (peft-wrapped FP4Linear); other models get none. Memory: the packed weights move, nothing is copied
    twice (the members' buffers become views of the stacked tensors)."""
    found = []
    for module in model.modules():
        for names in groups:
            members = [getattr(module, n, None) for n in names]
            if all(m is not None for m in members) and not any("_qerl_group" in m.__dict__ for m in members) \
                    and ProjectionGroup.compatible(members):
                found.append(ProjectionGroup(members))
    return found


def ungroup_projections(groups: list[ProjectionGroup]) -> None:
    for group in groups:
        group.ungroup()


@contextlib.contextmanager
def projections_fused(groups: list[ProjectionGroup], dtype: torch.dtype):
    """Inside: inference forwards of the grouped layers take the stacked path, with the adapters as they are now
    (copied in `dtype`, the activations' dtype)."""
    for group in groups:
        group.refresh(dtype)
        group.active = True
    try:
        yield
    finally:
        for group in groups:
            group.active = False
            group._outs = group._x = None
