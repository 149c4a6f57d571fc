"""FP4Linear forward/backward vs dense references; nothing dequantized is saved for backward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qerl.quant import reference
from qerl.quant.format import dequantize_nvfp4
from qerl.quant.linear import FP4Linear


def _layer(n_out=48, n_in=80, bias=True, seed=0):
    torch.manual_seed(seed)
    dense = torch.nn.Linear(n_in, n_out, bias=bias)
    return FP4Linear.from_linear(dense)


@pytest.mark.parametrize("chunk", [reference.CHUNK_ELEMENTS, 80 * 5])  # one block / many 5-row blocks
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_grad_input_match_dense_reference(monkeypatch, chunk, bias):
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk)
    layer = _layer(bias=bias)
    w = dequantize_nvfp4(layer.weight_packed, layer.weight_scale, layer.weight_global_scale)
    x = torch.randn(3, 7, 80, requires_grad=True)
    y = layer(x)
    ref = F.linear(x.detach(), w, layer.bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)

    # float64 reference of both forward and grad_input
    x64 = x.detach().double().requires_grad_()
    y64 = F.linear(x64, w.double(), None if layer.bias is None else layer.bias.double())
    g = torch.randn_like(y)
    y.backward(g)
    y64.backward(g.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)

    # and autograd through the dequantized fp32 weight
    x2 = x.detach().clone().requires_grad_()
    F.linear(x2, w, layer.bias).backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_backward_saves_only_packed_tensors_and_no_weight_grad():
    layer = _layer(n_out=64, n_in=128)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    x = torch.randn(4, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    assert sorted(saved, key=str) == sorted([(torch.uint8, (64, 64)), (torch.float8_e4m3fn, (64, 8)),
                                             (torch.float32, (1,))], key=str)
    y.sum().backward()
    assert x.grad is not None
    assert all(b.grad is None for b in layer.buffers())
    assert layer.bias.grad is None  # frozen like the weight


def test_bias_gradient_when_bias_is_trained():
    layer = _layer()
    layer.bias.requires_grad_(True)
    x = torch.randn(5, 80)
    g = torch.randn(5, 48)
    layer(x).backward(g)
    torch.testing.assert_close(layer.bias.grad, g.sum(0))


@pytest.mark.parametrize("chunk", [reference.CHUNK_ELEMENTS, 80 * 5])  # one block / many 5-row blocks
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
def test_bf16_biased_layer_is_bit_identical_to_nn_linear(monkeypatch, chunk, bias_dtype):
    # Each output element is one K-long dot product plus its bias, rounded once to bf16 by the same CPU GEMM that
    # nn.Linear calls, so there is no tolerance to justify: adding the bias after a bf16 rounding changed ~27%.
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk)
    layer = _layer(n_out=64, n_in=80).to(torch.bfloat16)
    layer.bias.data = layer.bias.data.to(bias_dtype)  # a bias kept in fp32 is used in the compute dtype
    dense = torch.nn.Linear(80, 64, dtype=torch.bfloat16)
    dense.weight.data.copy_(layer.dequantize_weight(torch.bfloat16))
    dense.bias.data.copy_(layer.bias.data)
    x = torch.randn(3, 9, 80, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, dense(x)), f"{(y != dense(x)).float().mean():.1%} of outputs differ"


def test_mxfp4_layer_forward():
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("MXFP4A16", ["Linear"])
    w = torch.randn(16, 64)
    groups = w.reshape(16, -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    comp = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    layer = FP4Linear(64, 16, bias=False, fmt="mxfp4")
    layer.weight_packed.copy_(comp["weight_packed"])
    layer.weight_scale.copy_(comp["weight_scale"])
    dense = MXFP4PackedCompressor.decompress(comp, scheme)["weight"].float()
    x = torch.randn(3, 64, requires_grad=True)
    torch.testing.assert_close(layer(x), x.detach() @ dense.T)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, dense.sum(0).expand(3, 64))


def test_module_dtype_casts_keep_the_format():
    layer = _layer()
    packed, scale, gs = (layer.weight_packed.clone(), layer.weight_scale.clone(), layer.weight_global_scale.clone())
    model = torch.nn.Sequential(layer).to(torch.bfloat16)
    assert layer.compute_dtype == torch.bfloat16 and layer.bias.dtype == torch.bfloat16
    assert layer.weight_scale.dtype == torch.float8_e4m3fn and layer.weight_global_scale.dtype == torch.float32
    assert torch.equal(layer.weight_packed, packed) and torch.equal(layer.weight_global_scale, gs)
    assert torch.equal(layer.weight_scale.view(torch.uint8), scale.view(torch.uint8))
    model.float()
    assert layer.compute_dtype == torch.float32 and layer.weight_scale.dtype == torch.float8_e4m3fn
    assert layer.dequantize_weight().dtype == torch.float32
