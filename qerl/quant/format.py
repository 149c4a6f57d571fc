"""NVFP4 / MXFP4 weight formats in plain PyTorch: the reference every kernel is tested against.

Layout and numerics are those of compressed-tensors 0.19 (`nvfp4-pack-quantized`, `mxfp4-pack-quantized`), so a
checkpoint written by llmcompressor loads here bit-exactly and one written here loads in vLLM:

* two E2M1 codes per byte, the even column in the low nibble; code = sign bit (8) | index into
  {0, 0.5, 1, 1.5, 2, 3, 4, 6};
* NVFP4: one FP8 E4M3 scale per 16 consecutive inputs of a row, one FP32 global scale per tensor;
  w ~= e2m1 * (scale / global_scale);
* MXFP4: one E8M0 scale (uint8 biased exponent, 2**(e-127)) per 32 inputs, no global scale.

Quantization reproduces llmcompressor's data-free (min-max) NVFP4 recipe step by step, including its rounding of
ties and the dtype each intermediate is computed in, because bit-exactness is what the tests check.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from qerl.errors import QerlError

NVFP4_GROUP = 16
MXFP4_GROUP = 32
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds on |x| in E2M1 units; ties go to the even mantissa (as compressed-tensors' cast_to_fp4):
# (threshold, tie rounds up?)
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                    (5.0, False))


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    """(256, 2) float32: the two E2M1 values encoded by each byte, low nibble first (one gather per byte). Built once
    per device: its host-to-device copy waits for the GPU, once per dequantized tensor otherwise."""
    with torch.inference_mode(False), torch.no_grad():  # an ordinary tensor, whichever mode asked first
        mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
        signed = torch.cat([mags, -mags])  # codes 8..15 carry the sign bit; code 8 is -0.0 as in compressed-tensors
        byte = torch.arange(256)
        return torch.stack([signed[byte & 0xF], signed[byte >> 4]], dim=1).to(device)


def _canonical(device: torch.device) -> torch.device:
    """cuda and cuda:0 as one cache key."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 E2M1 codes (N, K) into bytes (N, K/2), column 2j in the low nibble of byte j."""
    if codes.shape[-1] % 2:
        raise QerlError(f"pack_fp4: expected an even number of columns, got shape {tuple(codes.shape)}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: bytes (N, K/2) -> uint8 codes (N, K)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Unpack bytes (N, K/2) straight to float32 E2M1 values (N, K) with a single table gather."""
    pairs = F.embedding(packed.to(torch.int32), _pair_table(_canonical(packed.device)))
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Codes of the E2M1 values nearest to x (already divided by its scale), ties to even; |x| > 6 saturates."""
    mag = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        idx += (mag >= threshold if tie_up else mag > threshold).to(torch.uint8)
    return idx | ((x < 0).to(torch.uint8) << 3)  # x < 0, not signbit: -0.0 in -> code 0, as compressed-tensors


def _check_weight(w: torch.Tensor, group: int, name: str) -> None:
    if w.ndim != 2 or not w.is_floating_point():
        raise QerlError(f"{name}: expected a 2-D float weight (out_features, in_features), got "
                        f"{tuple(w.shape)} {w.dtype}")
    if w.shape[1] % group:
        raise QerlError(f"{name}: in_features {w.shape[1]} must be a multiple of the group size {group}")


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """FP32 global scale (1,) mapping the tensor's absmax to FP8 max * FP4 max (computed in w's dtype, as
    compressed-tensors' generate_gparam does), so group scales use the whole FP8 range."""
    amax = w.detach().abs().amax().clamp(min=torch.finfo(w.dtype).tiny)
    gs = (FP8_E4M3_MAX * FP4_MAX) / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape(1)


def nvfp4_group_scales(w: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 scales (N, K/16): group absmax / 6, times the global scale, rounded to FP8; zero -> FP8 eps."""
    groups = w.detach().reshape(w.shape[0], -1, NVFP4_GROUP)
    absmax = torch.maximum(groups.amin(-1).clamp(max=0).abs(), groups.amax(-1).clamp(min=0))
    scales = global_scale.to(torch.float32) * (absmax / torch.tensor(FP4_MAX, dtype=w.dtype))
    scales = scales.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scales = torch.where(scales == 0, torch.tensor(0.125), scales)  # FP8 eps: avoids a division by zero
    return scales.to(torch.float8_e4m3fn)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest NVFP4 of a (N, K) weight -> (weight_packed uint8 (N, K/2), weight_scale fp8 (N, K/16),
    weight_global_scale fp32 (1,)). Pass global_scale to share one across fused layers (q/k/v, gate/up)."""
    _check_weight(w, NVFP4_GROUP, "quantize_nvfp4")
    w = w.detach()
    gs = nvfp4_global_scale(w) if global_scale is None else global_scale.detach().to(torch.float32).reshape(1)
    scale = nvfp4_group_scales(w, gs)
    effective = (scale.to(torch.float32) / gs).unsqueeze(-1)
    x = (w.reshape(w.shape[0], -1, NVFP4_GROUP) / effective).clamp(-FP4_MAX, FP4_MAX)
    codes = round_to_e2m1_codes(x).reshape(w.shape)
    return pack_fp4(codes), scale, gs


def dequantize_nvfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K/2) packed + (N, K/16) FP8 scales + (1,) global scale -> (N, K) in dtype.

    Computed in float32 as e2m1 * (scale / global_scale), then cast: exactly compressed-tensors' decompression."""
    values = e2m1_values(weight_packed)
    n, k = values.shape
    if weight_scale.shape != (n, k // NVFP4_GROUP):
        raise QerlError(f"weight_scale: expected shape {(n, k // NVFP4_GROUP)} for weight_packed "
                        f"{tuple(weight_packed.shape)}, got {tuple(weight_scale.shape)}")
    effective = weight_scale.to(torch.float32) / weight_global_scale.to(torch.float32)
    return (values.reshape(n, -1, NVFP4_GROUP) * effective.unsqueeze(-1)).reshape(n, k).to(dtype)


def mxfp4_scales_to_float(weight_scale: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponents (uint8) -> float32 powers of two 2**(e - 127)."""
    return torch.exp2(weight_scale.to(torch.int32).sub(127).to(torch.float32))


def dequantize_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K/2) packed + (N, K/32) E8M0 scales -> (N, K) in dtype (as compressed-tensors' MXFP4 decompression)."""
    values = e2m1_values(weight_packed)
    n, k = values.shape
    if weight_scale.shape != (n, k // MXFP4_GROUP):
        raise QerlError(f"weight_scale: expected shape {(n, k // MXFP4_GROUP)} for weight_packed "
                        f"{tuple(weight_packed.shape)}, got {tuple(weight_scale.shape)}")
    scale = mxfp4_scales_to_float(weight_scale).unsqueeze(-1)
    return (values.reshape(n, -1, MXFP4_GROUP) * scale).reshape(n, k).to(dtype)


def dequantize(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_global_scale: torch.Tensor | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Either format, told apart by the scale dtype (FP8 -> NVFP4, uint8 E8M0 -> MXFP4)."""
    if weight_scale.dtype == torch.uint8:
        return dequantize_mxfp4(weight_packed, weight_scale, dtype)
    if weight_global_scale is None:
        raise QerlError("weight_global_scale: required for NVFP4 (FP8-scaled) weights")
    return dequantize_nvfp4(weight_packed, weight_scale, weight_global_scale, dtype)
