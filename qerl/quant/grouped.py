"""Projection groups: LoRA layers that read the same input (q/k/v, gate/up) run as one launch at inference, and
the single projections (o, down) as groups of one, so that every LoRA layer of an inference forward is one op.
Plain projections (a model without adapters: an evaluated checkpoint) stack the same way, from two members.

    groups = group_projections(model)        # packed weights re-laid as one stacked tensor; members hold views
    with projections_fused(groups, torch.bfloat16):
        model(...)                           # no autograd: q_proj computes q|k|v in one kernel, k/v take slices
    ungroup_projections(groups)              # members get their own tensors back

vLLM fuses these layers at load time (QKVParallelLinear, MergedColumnParallelLinear); here the model stays a
transformers + peft model, trainable as before, and only inference calls inside `projections_fused` take the
stacked path. FP4 bases (FP4LoraLinear): `qerl.quant.dispatch.fp4_lora_matmul` with `segments`, one FP4 launch
(LoRA B in its epilogue, one global scale per member; on humming's kernel and the dense copies one
`qerl.quant.dispatch.lora_expand` pass) and one x @ A.T launch per group. Dense bases (peft's LoRA Linear over
nn.Linear, e.g. the bf16 baseline): one cuBLAS GEMM over the stacked weight, one x @ A.T and one lora_expand pass
(every member's B product added to its slice of the output), instead of peft's separate A and B GEMMs, scaling and
add. In every group x @ A.T runs beside the base GEMM (qerl.quant.side_stream). A group of one keeps its tensors
(nothing is stacked or copied); in larger groups the first member
computes the whole group when it is called; the others return their slice when called with the very same input
tensor, and compute on their own otherwise (a model that calls them differently stays correct, only unfused).
In-place writes to a member's weights (load_state_dict, copy_) reach the stacked tensors; moving the model to
another device or dtype does not: ungroup first (TorchEngine.close does).
"""
from __future__ import annotations

import contextlib
import types
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from qerl.quant.dispatch import fp4_lora_matmul, run_lora_expand, shrink_around
from qerl.quant.operands import stack_bounds

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))
_STACKED = ("weight_packed", "weight_scale", "weight_global_scale")


def _kind(module: nn.Module) -> str | None:
    """"fp4" for an NVFP4 FP4LoraLinear or a plain NVFP4 FP4Linear, "dense" for peft's LoRA Linear over an
    nn.Linear or a plain nn.Linear, else None."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    from qerl.quant.linear import FP4Linear
    from qerl.quant.lora import FP4LoraLinear

    if isinstance(module, FP4LoraLinear):
        return "fp4" if module.base_layer.fmt == "nvfp4" else None
    if isinstance(module, LoraLinear) and type(module.base_layer) is nn.Linear and not module.merged:
        return "dense"
    if type(module) is FP4Linear:
        return "fp4" if module.fmt == "nvfp4" else None
    return "dense" if type(module) is nn.Linear else None


def _has_lora(module: nn.Module) -> bool:
    """A peft LoRA layer (its base in `base_layer`), not a plain projection."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A")


def _base(module: nn.Module) -> nn.Module:
    return module.base_layer if _has_lora(module) else module


@torch.library.custom_op("qerl::dense_lora_matmul", mutates_args=())
def _dense_lora_op(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scale: float, n1: int, n2: int,
                   lora_b_diag: torch.Tensor | None) -> torch.Tensor:
    """x2 @ weight.T (+ bias) + scale * per-segment (x2 @ A.T) @ B.T, inference only: x @ A.T on the side stream
    while cuBLAS runs the GEMM (qerl.quant.side_stream), then one lora_expand pass over the output."""
    out, xa = shrink_around(x2, lora_a, lambda: F.linear(x2, weight, bias))
    return run_lora_expand(out, xa, lora_b, scale, n1, n2, None, lora_b_diag, out=out)


@_dense_lora_op.register_fake
def _(x2, weight, bias, lora_a, lora_b, scale, n1, n2, lora_b_diag):
    return x2.new_empty(x2.shape[0], weight.shape[0])


def _grouped_forward(self, x, *args, **kwargs):
    """The layer's own forward (peft LoRA Linear, or a plain projection's), taking the group's stacked output when
    there is one."""
    grouped = self.__dict__["_qerl_group"]
    out = grouped[0].member_forward(grouped[1], x) if not args and not kwargs else None
    return out if out is not None else type(self).forward(self, x, *args, **kwargs)


def block_diagonal(b: torch.Tensor, sizes) -> torch.Tensor:
    """A stacked B (N, r) of members with these output sizes laid out as (N, members x r): member i's rows in
    columns i r .. (i + 1) r, zeros elsewhere (one GEMM over the stacked x @ A.T adds every member's product)."""
    r, start = b.shape[1], 0
    diag = b.new_zeros(b.shape[0], r * len(sizes))
    for i, size in enumerate(sizes):
        diag[start:start + size, i * r:(i + 1) * r] = b[start:start + size]
        start += size
    return diag


class ProjectionGroup:
    """LoRA layers of one kind (FP4LoraLinear, or peft LoRA Linear over nn.Linear), one adapter, same rank and
    scaling, stacked along their outputs."""

    def __init__(self, members: list[nn.Module]):
        self.members = members
        self.kind = _kind(members[0])
        self.lora = _has_lora(members[0])  # else plain projections: the stacked base alone
        self.sizes = [m.out_features for m in members]
        self.bases = bases = [_base(m) for m in members]
        names = _STACKED if self.kind == "fp4" else ("weight",)
        self.stacked = {}
        with torch.no_grad():
            for name in names:
                parts = [getattr(b, name).reshape(1) if name == "weight_global_scale" else getattr(b, name)
                         for b in bases]
                if len(parts) == 1:  # a group of one reads its member's own tensors
                    self.stacked[name] = parts[0].detach()
                    continue
                self.stacked[name] = torch.cat([p.detach() for p in parts])
                start = 0
                for base, part in zip(bases, parts):
                    view = self.stacked[name][start:start + part.shape[0]].reshape(getattr(base, name).shape)
                    if self.kind == "fp4":
                        base._buffers[name] = view
                    else:
                        base.weight.data = view  # the (frozen) Parameter object stays, its storage is shared
                    start += part.shape[0]
            self.bias = None if bases[0].bias is None else torch.cat([b.bias.detach() for b in bases])
        self.adapter = members[0].active_adapters[0] if self.lora else None
        self.scaling = float(members[0].scaling[self.adapter]) if self.lora else 1.0
        self.dtype = None  # the activations' dtype of the current projections_fused
        # stacked adapter copies in the compute dtype, filled by refresh(); lora_b_diag: B block-diagonal, so that
        # one GEMM over the stacked x @ A.T adds every member's update where B is a cuBLAS GEMM
        self.lora_a = self.lora_b = self.lora_b_diag = None
        self.dense = None  # a rollout's stacked dequantized weight (qerl.quant.dense_copies), members hold views
        self.active = False
        self._x = None
        self._outs = None
        for i, m in enumerate(members):
            m.__dict__["_qerl_group"] = (self, i)
            if self.patches_forward:
                m.forward = types.MethodType(_grouped_forward, m)

    @property
    def patches_forward(self) -> bool:
        """Whether the members' forward is swapped for _grouped_forward (FP4LoraLinear.forward asks its group
        itself)."""
        return self.kind == "dense" or not self.lora

    @staticmethod
    def compatible(members: list[nn.Module]) -> bool:
        """One kind (FP4 or dense base), all LoRA layers or all plain ones, same input size, device, dtype and bias
        presence, output sizes that a kernel tile boundary can separate (multiples of 16), and for LoRA layers one
        common adapter with one rank and scaling."""
        kinds = {_kind(m) for m in members}
        if not members or len(kinds) != 1 or None in kinds or len({_has_lora(m) for m in members}) != 1:
            return False
        first = members[0]
        lora = _has_lora(first)
        if lora and len(first.active_adapters) != 1:
            return False
        name = first.active_adapters[0] if lora else None

        def signature(m):
            base = _base(m)
            if lora:  # one adapter, of one rank and scaling
                if name not in m.lora_A.keys() or list(m.active_adapters) != [name] or name in m.lora_variant:
                    return None
                own = (m.r[name], float(m.scaling[name]))
            elif any(p.requires_grad for p in m.parameters(recurse=False)):
                return None  # frozen only: a trained weight stacked would be a view the optimizer and saving see
            else:
                own = ()
            data = base.weight_packed if hasattr(base, "weight_packed") else base.weight
            return (base.in_features, data.device, data.dtype, base.bias is None, *own, m.out_features % 16 == 0)

        sigs = [signature(m) for m in members]
        return sigs[0] is not None and sigs[0][-1] and all(s == sigs[0] for s in sigs)

    def refresh(self, dtype: torch.dtype) -> None:
        """Stack the members' current adapter weights in `dtype` (into the same buffers when shapes allow, so a
        captured CUDA graph keeps reading valid addresses), B also block-diagonal, so that where torch's addmm
        adds the B products (lora_expand off its one-pass kernel) one GEMM does every member's."""
        self.dtype = dtype
        if not self.lora:
            return
        with torch.no_grad():
            a = torch.cat([m.lora_A[self.adapter].weight for m in self.members]).to(dtype)
            b = torch.cat([m.lora_B[self.adapter].weight for m in self.members]).to(dtype)
            diag = block_diagonal(b, self.sizes)
            if self.lora_a is None or self.lora_a.shape != a.shape or self.lora_a.dtype != dtype:
                self.lora_a, self.lora_b, self.lora_b_diag = a, b, diag
            else:
                self.lora_a.copy_(a)
                self.lora_b.copy_(b)
                self.lora_b_diag.copy_(diag)

    def member_forward(self, index: int, x: torch.Tensor):
        """The output of member `index` from the stacked call, or None when it must compute on its own."""
        if not self.active or torch.is_grad_enabled():
            return None
        if index == 0:
            self._outs = self._x = None
            if self._usable(x):
                out = self._stacked_forward(x)
                if len(self.members) == 1:
                    return out
                self._outs, self._x = out.split(self.sizes, dim=-1), x
                return self._outs[0]
            return None
        if self._outs is None or x is not self._x:
            return None
        out = self._outs[index]
        if index == len(self.members) - 1:
            self._outs = self._x = None
        return out

    def _stacked_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp4" and self.dense is not None and self.bases[0].dense_copy_for(x) is not None:
            return self._dense_copy_forward(x)
        if self.kind == "fp4":
            return fp4_lora_matmul(x, self.stacked["weight_packed"], self.stacked["weight_scale"],
                                   self.stacked["weight_global_scale"], self.bias, self.lora_a, self.lora_b,
                                   self.scaling, self.sizes, self.lora_b_diag)
        x2 = x.reshape(-1, x.shape[-1])
        out = self._dense_lora(x2, self.stacked["weight"], self.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _dense_copy_forward(self, x: torch.Tensor) -> torch.Tensor:
        """FP4 group over its dense copy: one cuBLAS GEMM, x @ A.T, then each member's B on its output slice."""
        x2 = x.reshape(-1, x.shape[-1])
        out = self._dense_lora(x2, self.dense, None if self.bias is None else self.bias.to(self.dense.dtype))
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def _dense_lora(self, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2 @ weight.T (+ bias) + every member's B product: one op, x @ A.T beside the GEMM."""
        if not self.lora:
            return F.linear(x2, weight, bias)
        n1, n2 = stack_bounds(self.sizes, weight.shape[0])
        return _dense_lora_op(x2, weight, bias, self.lora_a, self.lora_b, self.scaling, n1, n2, self.lora_b_diag)

    def _usable(self, x: torch.Tensor) -> bool:
        if not self.lora:  # the stacked base in the activations' dtype (a dense weight must match it)
            return x.dtype == self.dtype and (self.kind == "fp4" or self.stacked["weight"].dtype == x.dtype)
        first = self.members[0]
        if self.lora_a is None or x.dtype != self.lora_a.dtype or first.disable_adapters:
            return False
        from qerl.fused_lora import lora_dropout_active

        return not any(lora_dropout_active(m, self.adapter) for m in self.members)

    def ungroup(self) -> None:
        """Give every member contiguous tensors of its own again and detach it from the group."""
        own = len(self.members) == 1  # a group of one never gave its member views
        with torch.no_grad():
            for m, base in zip(self.members, self.bases):
                if not own and self.kind == "fp4":
                    for name in _STACKED:
                        base._buffers[name] = base._buffers[name].clone()
                elif not own:
                    base.weight.data = base.weight.data.clone()
                if self.patches_forward:
                    m.__dict__.pop("forward", None)
                m.__dict__.pop("_qerl_group", None)
                base.__dict__.pop("dense_copy", None)  # a view of the stacked copy dropped below
        self.stacked, self.lora_a, self.lora_b, self._outs, self._x = {}, None, None, None, None
        self.lora_b_diag = None
        self.dense = None


def group_projections(model: nn.Module, groups=GROUPS, kinds=("fp4", "dense"),
                      plain: bool = True) -> list[ProjectionGroup]:
    """A ProjectionGroup for every module whose children named by one of `groups` are compatible LoRA layers
    (all FP4LoraLinear: kind "fp4", or all peft LoRA Linear over nn.Linear: kind "dense") of one of `kinds`, and
    one per LoRA member where they are not; with `plain`, frozen plain projections (FP4Linear, nn.Linear without
    grad: a model without adapters, as an evaluation runs a checkpoint) are stacked too, from two members (alone
    they gain nothing). Memory: the weights move, nothing is held twice (the members' weights become views of the
    stacked tensors); so a model whose weights someone else re-allocates (a rollout copy gathered from FSDP shards)
    must not get plain groups: its trainer passes plain=False."""
    found, taken = [], 0
    for module in model.modules():
        for names in groups:
            members = [getattr(module, n, None) for n in names]
            if not (all(m is not None for m in members) and _kind(members[0]) in kinds):
                continue
            if any("_qerl_group" in m.__dict__ for m in members):
                taken += 1
            elif ProjectionGroup.compatible(members) and (_has_lora(members[0]) or plain and len(members) > 1):
                found.append(ProjectionGroup(members))
            else:  # LoRA members that cannot stack (ranks, adapters differ) still run as one op each
                found += [ProjectionGroup([m]) for m in members if _has_lora(m) and ProjectionGroup.compatible([m])]
    if taken:  # grouped by another engine on this model: they run only while that engine's groups are active
        warnings.warn(f"{taken} projection groups of this model belong to another engine (close it first): they run "
                      f"ungrouped here", stacklevel=2)
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
