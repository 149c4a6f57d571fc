"""A LoRA layer in training as one autograd node: y = base(x) + scaling * (x @ A.T) @ B.T, base frozen.

peft computes the update as separate ops over the (M, N) output: the B GEMM writes it, `* scaling` reads and
writes it, `result + ...` reads two and writes one; backward scales the gradient and adds the two input gradients
(base and adapter) in further passes. At GRPO's ~16k rows per micro-batch these passes cost ~1.3 ms of
memory traffic per 7B MLP projection, a third of its GEMM. Here the update goes into the base output with one
in-place addmm (cuBLAS reads and writes y once, in its epilogue), and backward adds the adapter's input gradient
into the base's with another: nothing of size (M, N) or (M, K) beyond the GEMM outputs. The frozen base is any
module with `lora_base_ops` (FP4Linear) or an nn.Linear; saved tensors are x and x @ A.T, as in peft.

Used by qerl.quant.lora.FP4LoraLinear and FusedLoraLinear (peft's lora.Linear for nn.Linear bases) whenever
autograd is recording and the layer is plain LoRA: one active adapter, no dropout in effect, no DoRA or other
variant, not merged, frozen base weight and bias. Anything else takes peft's own path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn


def _dense_ops(base: nn.Linear, dtype: torch.dtype):
    # casts at call time (no-ops for a model already in dtype): the ops outlive the forward in the autograd
    # context, where a cast copy of W would stay alive through a checkpointed forward (autocast's does not)
    def forward(x):
        return F.linear(x, base.weight.to(dtype), None if base.bias is None else base.bias.to(dtype))

    return forward, (lambda g: g @ base.weight.to(dtype))


def _has_ops(base: nn.Module) -> bool:
    # exactly nn.Linear: its subclasses (bitsandbytes' 4-bit layers, ...) compute something else than F.linear
    return hasattr(base, "lora_base_ops") or type(base) is nn.Linear


def base_ops(base: nn.Module, dtype: torch.dtype):
    """(forward(x), input_grad(g)) of a frozen base layer, computing in dtype."""
    if not _has_ops(base):
        raise TypeError(f"no fused LoRA path for base layer {type(base).__name__}")
    return base.lora_base_ops(dtype) if hasattr(base, "lora_base_ops") else _dense_ops(base, dtype)


class LoraLinearFunction(torch.autograd.Function):
    """Forward and backward of base(x) + scaling * (x @ A.T) @ B.T (A (r, K), B (N, r), all in x's dtype)."""

    @staticmethod
    def forward(ctx, x, lora_a, lora_b, scaling: float, ops):
        forward, _ = ops
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        out = forward(x)
        xa = x2 @ lora_a.T
        out.view(-1, out.shape[-1]).addmm_(xa, lora_b.T, alpha=scaling)
        ctx.save_for_backward(x, xa, lora_a, lora_b)
        ctx.scaling, ctx.ops = scaling, ops
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, xa, lora_a, lora_b = ctx.saved_tensors
        s = ctx.scaling
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gxa = (g2 @ lora_b).mul_(s)  # d loss / d (x @ A.T), (M, r)
        grad_b = (g2.T @ xa).mul_(s) if ctx.needs_input_grad[2] else None
        grad_a = gxa.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.ops[1](grad_out)
            grad_x.view(-1, grad_x.shape[-1]).addmm_(gxa, lora_a)
        return grad_x, grad_a, grad_b, None, None


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def lora_dropout_active(layer: nn.Module, adapter: str) -> bool:
    """Whether `adapter`'s dropout changes its input now (an nn.Dropout with p > 0 in training mode)."""
    drop = layer.lora_dropout[adapter]
    return isinstance(drop, nn.Dropout) and drop.training and drop.p > 0


def fused_training_adapter(layer, x: torch.Tensor) -> str | None:
    """The adapter name when `layer` (a peft LoraLayer) can run as LoraLinearFunction now, else None."""
    if (not getattr(layer, "use_fused", False) or not torch.is_grad_enabled() or layer.disable_adapters
            or layer.merged or len(layer.active_adapters) != 1):
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A.keys() or name in getattr(layer, "lora_variant", {}):
        return None
    if lora_dropout_active(layer, name):
        return None
    base = layer.get_base_layer()
    if (not _has_ops(base) or any(p.requires_grad for p in base.parameters(recurse=False))
            or not x.is_floating_point()):
        return None
    return name


def lora_forward(layer, x: torch.Tensor, name: str) -> torch.Tensor:
    """layer's output through LoraLinearFunction (after `fused_training_adapter` said yes); in the autocast dtype
    when autocast is on, else x's dtype. The casts of x, A and B are ordinary autograd ops (A's gradient arrives in
    its own dtype)."""
    dtype = _compute_dtype(x)
    a = layer.lora_A[name].weight.to(dtype)
    b = layer.lora_B[name].weight.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return LoraLinearFunction.apply(x.to(dtype), a, b, float(layer.scaling[name]),
                                        base_ops(layer.get_base_layer(), dtype))


class FusedLoraLinear(PeftLoraLinear):
    """peft's lora.Linear whose training forward is LoraLinearFunction (same parameters, files and merging)."""

    use_fused = True

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        name = None if (args or kwargs) else fused_training_adapter(self, x)
        if name is None:
            return super().forward(x, *args, **kwargs)
        return lora_forward(self, x, name)


def register_fused_lora(config):
    """Make this LoraConfig wrap nn.Linear modules in FusedLoraLinear (in place; returns it for chaining).
    The mapping is not serialized: adapter files stay peft's own. Not for bitsandbytes models (their 4-bit
    layers subclass nn.Linear and need peft's own dispatch)."""
    config._register_custom_module({nn.Linear: FusedLoraLinear})
    return config


def set_fused(model: nn.Module, enabled: bool) -> int:
    """Turn the fused training path of every LoRA layer of `model` on or off; returns how many layers have one."""
    layers = [m for m in model.modules() if hasattr(type(m), "use_fused")]
    for m in layers:
        m.use_fused = enabled
    return len(layers)
