"""NVFP4/MXFP4 reference vs compressed-tensors' own compressors (bit-exact)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors")  # the reference under test; absent on the bare GPU image

from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from qerl.errors import QerlError
from qerl.quant.format import (
    dequantize, dequantize_mxfp4, dequantize_nvfp4, e2m1_values, pack_fp4, quantize_nvfp4, unpack_fp4,
)

SHAPES = [(32, 48), (8, 80), (24, 208), (64, 128), (3, 16)]


def _scheme(name: str) -> QuantizationScheme:
    return preset_name_to_scheme(name, ["Linear"])


def _ct_compress_nvfp4(w: torch.Tensor) -> dict:
    """compressed-tensors' path: generate_gparam + calculate_qparams (what llmcompressor's min-max observer
    calls) then NVFP4PackedCompressor.compress."""
    scheme = _scheme("NVFP4A16")
    groups = w.reshape(w.shape[0], -1, 16)
    gs = generate_gparam(-w.abs().amax().reshape(1), w.abs().amax().reshape(1))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale, "weight_global_scale": gs}
    return NVFP4PackedCompressor.compress(sd, scheme)


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.05
    w[0, :16] = 0.0  # an all-zero group exercises the FP8-eps scale path
    w[-1, -1] = -1e-9  # a tiny negative rounds to -0 (code 8)
    return w.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_bit_exact_with_compressed_tensors(shape, dtype):
    w = _weight(shape, dtype, seed=shape[0] * 1000 + shape[1])
    ref = _ct_compress_nvfp4(w)
    packed, scale, gs = quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (shape[0], shape[1] // 16)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert torch.equal(packed, ref["weight_packed"])
    assert torch.equal(scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(gs, ref["weight_global_scale"])


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_bit_exact_with_compressed_tensors(shape):
    w = _weight(shape, torch.float32, seed=7 + shape[1])
    ref = _ct_compress_nvfp4(w)
    dense = NVFP4PackedCompressor.decompress(ref, _scheme("NVFP4A16"))["weight"]  # bf16 by construction
    ours = dequantize_nvfp4(ref["weight_packed"], ref["weight_scale"], ref["weight_global_scale"],
                            dtype=torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), dense.view(torch.int16))  # bitwise, incl. -0.0
    assert torch.equal(dequantize(ref["weight_packed"], ref["weight_scale"], ref["weight_global_scale"]),
                       dequantize_nvfp4(ref["weight_packed"], ref["weight_scale"], ref["weight_global_scale"]))


def test_dequantized_error_is_small_and_float64_consistent():
    w = _weight((16, 208), torch.float32, seed=3).double()
    packed, scale, gs = quantize_nvfp4(w.float())
    deq = dequantize_nvfp4(packed, scale, gs, dtype=torch.float64)
    # float64 reference: E2M1 value times scale / global scale
    codes = unpack_fp4(packed).long()
    mags = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    vals = mags[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    ref = vals * (scale.double() / gs.double()).repeat_interleave(16, dim=1)
    assert torch.allclose(deq, ref, rtol=1e-6, atol=0)
    rel = (deq - w).norm() / w.norm()
    assert 0 < rel < 0.15  # 4-bit RTN on gaussians is ~8-10 %


@pytest.mark.parametrize("shape", [(8, 64), (5, 96), (16, 160)])
def test_mxfp4_dequant_bit_exact_with_compressed_tensors(shape):
    scheme = _scheme("MXFP4A16")
    w = _weight(shape, torch.bfloat16, seed=shape[1])
    groups = w.reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    comp = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    assert comp["weight_scale"].dtype == torch.uint8
    dense = MXFP4PackedCompressor.decompress(comp, scheme)["weight"]
    ours = dequantize_mxfp4(comp["weight_packed"], comp["weight_scale"], dtype=torch.bfloat16)
    assert torch.equal(ours.view(torch.int16), dense.view(torch.int16))
    assert torch.equal(dequantize(comp["weight_packed"], comp["weight_scale"], None), ours.float())


def test_pack_unpack_roundtrip_and_layout():
    codes = torch.randint(0, 16, (4, 10), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(unpack_fp4(packed), codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)  # even column in the low nibble
    vals = e2m1_values(torch.tensor([[0x71, 0x8F]], dtype=torch.uint8))
    assert vals.tolist() == [[0.5, 6.0, -6.0, -0.0]]


def test_bad_shapes_raise_one_line_errors():
    with pytest.raises(QerlError, match="multiple of the group size 16"):
        quantize_nvfp4(torch.randn(4, 40))
    packed, scale, gs = quantize_nvfp4(torch.randn(4, 32))
    with pytest.raises(QerlError, match="weight_scale"):
        dequantize_nvfp4(packed, scale[:, :1], gs)


def test_rounding_ties_match_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    from qerl.quant.format import round_to_e2m1_codes

    grid = torch.arange(-6.5, 6.5 + 1e-9, 0.125, dtype=torch.float32)  # hits every tie point exactly
    grid = torch.cat([grid, torch.tensor([-0.0, 0.0, -0.1, 0.1])])
    grid = grid[: grid.numel() // 2 * 2].reshape(1, -1)
    ref = pack_fp4_to_uint8(cast_to_fp4(grid.clamp(-6, 6).clone()))
    assert torch.equal(pack_fp4(round_to_e2m1_codes(grid.clamp(-6, 6))), ref)


def test_the_e2m1_table_is_built_once_per_device_and_outlives_inference_mode():
    """The byte -> (low, high) table is cached per device (building it copies to the device, which waits for the
    GPU): a second call reuses it, even when the first came under inference_mode, and the cached table is an
    ordinary tensor that a later autograd forward can use."""
    from qerl.quant import format as fmt

    fmt._pair_table.cache_clear()
    packed = torch.tensor([[0x71, 0x8F, 0x00, 0xFF]], dtype=torch.uint8)
    with torch.inference_mode():
        first = e2m1_values(packed)
    table = fmt._pair_table(torch.device("cpu"))
    assert not table.is_inference() and fmt._pair_table.cache_info().currsize == 1
    scale = torch.ones(1, requires_grad=True)
    second = e2m1_values(packed) * scale  # in an autograd graph
    second.sum().backward()
    assert fmt._pair_table.cache_info().currsize == 1 and fmt._pair_table.cache_info().hits >= 2
    expected = [0.5, 6.0, -6.0, -0.0, 0.0, 0.0, -6.0, -6.0]
    assert torch.equal(first, second.detach()) and first.flatten().tolist() == expected
    assert scale.grad.item() == sum(expected)
