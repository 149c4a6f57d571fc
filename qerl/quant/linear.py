"""FP4Linear: a frozen Linear whose weight stays packed (NVFP4 or MXFP4) through forward AND backward.

The autograd.Function saves only the packed tensors; backward recomputes grad_input = grad_out @ deq(W) through
`fp4_matmul_t`, so activation memory holds no dequantized weight and the frozen weight gets no gradient. Buffer
names are compressed-tensors' (weight_packed, weight_scale, weight_global_scale), so a checkpoint's tensors load
into it by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qerl.quant.format import MXFP4_GROUP, NVFP4_GROUP, dequantize, quantize_nvfp4
from qerl.quant.dispatch import TMA_DENSE_MIN_ROWS, fp4_matmul, fp4_matmul_t

FORMATS = ("nvfp4", "mxfp4")
DENSE_COPY_ATTR = "dense_copy"  # a dequantized weight for a rollout or an update (qerl.quant.dense_copies)
DENSE_COPY_MIN_ROWS = TMA_DENSE_MIN_ROWS  # from here choose_kernel itself dequantizes + cuBLAS on sm_90
_FORMAT_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")


def dense_copy_used(device_type: str, rows: int) -> bool:
    """Whether an inference call of `rows` rows on this device reads a rollout's dense copy: from
    DENSE_COPY_MIN_ROWS rows on a GPU (fewer: the FP4 kernels read 4x fewer bytes), always on the CPU (no FP4 kernel:
    the reference would dequantize the whole weight on every call)."""
    return device_type == "cpu" or rows >= DENSE_COPY_MIN_ROWS


class FP4LinearFunction(torch.autograd.Function):
    """y = x @ deq(W).T + b, with W rebuilt from its packed form in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, weight_packed, weight_scale, weight_global_scale, bias):
        ctx.save_for_backward(weight_packed, weight_scale, weight_global_scale)
        return fp4_matmul(x, weight_packed, weight_scale, weight_global_scale, bias)

    @staticmethod
    def backward(ctx, grad_out):
        weight_packed, weight_scale, weight_global_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = fp4_matmul_t(grad_out, weight_packed, weight_scale, weight_global_scale)
        if ctx.needs_input_grad[4]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, None, None, None, grad_bias


class DenseCopyFunction(torch.autograd.Function):
    """y = x @ W.T + b over a frozen dense copy W held by reference, not saved: saved-tensor hooks (activation
    offloading) would copy the whole weight to the host on every forward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight, ctx.bias_grad = weight, bias is not None and bias.requires_grad
        return F.linear(x, weight, None if bias is None else bias.to(weight.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        grad_x = grad_out @ ctx.weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.bias_grad else None
        return grad_x, None, grad_bias


class FP4Linear(nn.Module):
    """Drop-in for nn.Linear over a packed 4-bit weight (frozen); `compute_dtype` is the activation dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, fmt: str = "nvfp4",
                 compute_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        group = NVFP4_GROUP if fmt == "nvfp4" else MXFP4_GROUP
        if in_features % group:
            raise ValueError(f"in_features {in_features} must be a multiple of the {fmt} group size {group}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.compute_dtype = compute_dtype
        scale_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8,
                                                          device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // group, dtype=scale_dtype,
                                                         device=device))
        gs = torch.ones(1, dtype=torch.float32, device=device) if fmt == "nvfp4" else None
        self.register_buffer("weight_global_scale", gs)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=compute_dtype, device=device),
                                  requires_grad=False) if bias else None)

    def _apply(self, fn, recurse=True):
        """Module.to(dtype)/.half()/.bfloat16() would cast the FP8 scales and FP32 global scale (floating dtypes)
        and corrupt the format: the quantization buffers only ever change device; compute_dtype follows the
        cast like any float parameter would."""
        frozen = {k: self._buffers[k] for k in _FORMAT_BUFFERS if self._buffers.get(k) is not None}
        for k in frozen:
            self._buffers[k] = None
        super()._apply(fn, recurse)
        for k, t in frozen.items():
            moved = fn(t)
            self._buffers[k] = moved if moved.dtype == t.dtype else t.to(moved.device)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype, device=self.weight_packed.device)).dtype
        return self

    @property
    def qweight(self) -> torch.Tensor:
        """peft places adapters on the device of `qweight` for quantized layers that have no `weight`."""
        return self.weight_packed

    @classmethod
    def from_linear(cls, linear: nn.Linear, global_scale: torch.Tensor | None = None) -> "FP4Linear":
        """Quantize a dense nn.Linear to NVFP4 (round-to-nearest); mostly for tests and benchmarks."""
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, compute_dtype=w.dtype,
                    device=w.device)
        packed, scale, gs = quantize_nvfp4(w, global_scale)
        layer.weight_packed.copy_(packed)
        layer.weight_scale.copy_(scale)
        layer.weight_global_scale.copy_(gs)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    def dequantize_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense (out, in) weight; allocates a full copy, so only for merging, export and tests."""
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale,
                          dtype or self.compute_dtype)

    def lora_base_ops(self, dtype: torch.dtype):
        """(forward(x), input_grad(g)) of this frozen layer in dtype, for qerl.fused_lora: over an update's dense
        copy where it has one in dtype (the same values, without a dequantize per call), else the packed weight."""
        copy = self.__dict__.get(DENSE_COPY_ATTR)
        if copy is not None and copy.dtype == dtype:
            bias = None if self.bias is None else self.bias.to(dtype)
            return (lambda x: F.linear(x, copy, bias)), (lambda g: g @ copy)
        wp, ws, gs = self.weight_packed, self.weight_scale, self.weight_global_scale

        def forward(x):
            return fp4_matmul(x, wp, ws, gs, None if self.bias is None else self.bias.to(dtype))

        return forward, (lambda g: fp4_matmul_t(g, wp, ws, gs))

    def dense_copy_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The dense copy of the weight (qerl.quant.dense_copies) when this call should use it, x in its dtype:
        a training forward always (its GEMMs are compute-bound: the copy saves a dequantize per call, forward and
        backward); inference from DENSE_COPY_MIN_ROWS rows (fewer: the FP4 kernels read 4x fewer bytes), any rows
        on the CPU (no FP4 kernel there: the reference dequantizes the whole weight on every call)."""
        weight = self.__dict__.get(DENSE_COPY_ATTR)
        if weight is None or x.dtype != weight.dtype:
            return None
        if torch.is_grad_enabled():
            return weight
        return weight if dense_copy_used(x.device.type, x.numel() // max(x.shape[-1], 1)) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.dense_copy_for(x)
        if weight is not None and not torch.is_grad_enabled():  # inference: no autograd node to build
            return F.linear(x, weight, None if self.bias is None else self.bias.to(weight.dtype))
        if weight is not None:
            return DenseCopyFunction.apply(x, weight, self.bias)
        return FP4LinearFunction.apply(x, self.weight_packed, self.weight_scale, self.weight_global_scale,
                                       self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fmt={self.fmt}, compute_dtype={self.compute_dtype}")
