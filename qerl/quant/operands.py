"""The operands of the FP4 GPU kernels, checked before any launch: one QerlError naming the bad tensor or field.

    n, k = check_operands(x, weight_packed, weight_scale, weight_global_scale, 1, "x", segments)
    n1, n2 = segment_bounds(segments, n, weight_global_scale)
    lora_a, lora_b = lora_adapter(x2, lora_a, lora_b, n, k, len(segments or [n]))
"""
from __future__ import annotations

import torch

from qerl.errors import QerlError

GROUP = 16  # NVFP4 elements per FP8 scale


def check_operands(a: torch.Tensor, weight_packed, weight_scale, weight_global_scale, dim: int, name: str,
                   segments=None) -> tuple[int, int]:
    """(N, K) of the packed NVFP4 weight after checking it against the activation `a` (its last dim is K when dim
    is 1, N when 0): one QerlError naming the bad tensor."""
    if weight_packed.dtype != torch.uint8 or weight_packed.ndim != 2:
        raise QerlError(f"weight_packed: expected a 2-D uint8 tensor, got {weight_packed.dtype} "
                        f"{tuple(weight_packed.shape)}")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
    if weight_scale.dtype != torch.float8_e4m3fn or tuple(weight_scale.shape) != (n, k // GROUP):
        raise QerlError(f"weight_scale: expected float8_e4m3fn {(n, k // GROUP)}, got {weight_scale.dtype} "
                        f"{tuple(weight_scale.shape)}")
    if segments is None and weight_global_scale.numel() != 1:
        raise QerlError(f"weight_global_scale: expected one element, got shape {tuple(weight_global_scale.shape)}")
    if a.shape[-1] != (k if dim == 1 else n):
        raise QerlError(f"{name}: last dim {a.shape[-1]} does not match the weight ({n}, {k}) "
                        f"(expected {k if dim == 1 else n})")
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise QerlError(f"{name}: expected a bf16/fp16/fp32 tensor, got {a.dtype}")
    for t, tn in ((weight_packed, "weight_packed"), (weight_scale, "weight_scale"),
                  (weight_global_scale, "weight_global_scale")):
        if t.device != a.device:
            raise QerlError(f"{tn}: on {t.device}, expected {a.device} like {name}")
    if k % GROUP:
        raise QerlError(f"weight_packed: in_features {k} must be a multiple of {GROUP}")
    return n, k


def lora_adapter(x2: torch.Tensor, lora_a, lora_b, n: int, k: int, n_segments: int = 1):
    """(A, B) in x's dtype, B contiguous, after checking the adapter shapes (A stacks one (r, K) block per
    segment); (None, None) without LoRA."""
    if (lora_a is None) != (lora_b is None):
        raise QerlError("lora_a and lora_b: pass both or neither")
    if lora_a is None:
        return None, None
    r = lora_b.shape[-1]
    if lora_a.ndim != 2 or tuple(lora_a.shape) != (n_segments * r, k) or tuple(lora_b.shape) != (n, r):
        raise QerlError(f"lora_a / lora_b: expected ({n_segments} x r, {k}) and ({n}, r), got "
                        f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    return lora_a.to(x2.dtype), lora_b.to(x2.dtype).contiguous()


def segment_bounds(segments, n: int, weight_global_scale: torch.Tensor) -> tuple[int, int]:
    """(N1, N2) of at most three stacked weights along N; (n, n) for one."""
    segments = [int(v) for v in (segments or [n])]
    if not 1 <= len(segments) <= 3 or sum(segments) != n or min(segments) <= 0:
        raise QerlError(f"segments: expected 1-3 positive sizes adding up to N = {n}, got {segments}")
    if weight_global_scale.numel() != len(segments):
        raise QerlError(f"weight_global_scale: expected one per segment ({len(segments)}), got "
                        f"{weight_global_scale.numel()}")
    return stack_bounds(segments, n)


def stack_bounds(sizes, n: int) -> tuple[int, int]:
    """(N1, N2): where the second and the third of up to three members stacked along N start; n for absent ones."""
    bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)] + [n, n]
    return bounds[0], bounds[1]
