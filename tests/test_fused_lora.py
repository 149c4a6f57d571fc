"""qerl.fused_lora: one autograd node per LoRA layer gives peft's outputs and gradients (float64 references)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from bench.random_models import attach_lora, build_random_model
from qerl.fused_lora import (FusedLoraLinear, LoraLinearFunction, fused_training_adapter, register_fused_lora,
                             set_fused)
from qerl.quant.linear import FP4Linear
from qerl.quant.lora import FP4LoraLinear, register_fp4_lora


class _Net(nn.Module):
    def __init__(self, fp4: bool, dtype=torch.float64):
        super().__init__()
        torch.manual_seed(0)
        proj = nn.Linear(64, 48, bias=True)
        self.proj = FP4Linear.from_linear(proj.float()).to(dtype) if fp4 else proj.to(dtype)

    def forward(self, x):
        return self.proj(x)


def _lora(fp4: bool, fused: bool, dropout: float = 0.0, dtype=torch.float64):
    config = LoraConfig(r=4, lora_alpha=12, lora_dropout=dropout, target_modules=["proj"])
    if fp4:
        register_fp4_lora(config)
    register_fused_lora(config)
    model = get_peft_model(_Net(fp4, dtype), config)
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_" in name:  # B is zero at init: make the update and A's gradient non-zero
            p.data = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3
    set_fused(model, fused)
    return model.train()


def _run(model, x, dtype=torch.float64):
    x = x.clone().requires_grad_(True)
    y = model(x)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(y.dtype)
    (y * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.clone(), grads


@pytest.mark.parametrize("fp4", [False, True])
def test_outputs_and_gradients_match_peft(fp4, monkeypatch):
    x = torch.randn(3, 5, 64, dtype=torch.float64)  # leading dims are flattened and restored
    fused, plain = _lora(fp4, True), _lora(fp4, False)
    layer = fused.base_model.model.proj
    assert isinstance(layer, FP4LoraLinear if fp4 else FusedLoraLinear)
    assert fused_training_adapter(layer, x) == "default"
    calls, orig = [], LoraLinearFunction.apply
    monkeypatch.setattr(LoraLinearFunction, "apply", lambda *a: calls.append(1) or orig(*a))
    y1, gx1, g1 = _run(fused, x)
    y2, gx2, g2 = _run(plain, x)
    assert calls == [1]  # the fused model took the fused path, and only it
    torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx1, gx2, rtol=1e-12, atol=1e-12)
    assert sorted(g1) == sorted(g2) and len(g1) == 2  # lora_A and lora_B only: the base stays frozen
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-12, atol=1e-12)
    # against the formula itself, in float64: y = base(x) + s * x A^T B^T
    a, b = (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    base = layer.get_base_layer()
    w = base.dequantize_weight(torch.float64) if fp4 else base.weight
    ref = x @ w.T + base.bias + 3.0 * (x @ a.T) @ b.T
    torch.testing.assert_close(y1, ref.detach(), rtol=1e-10, atol=1e-10)


def test_autocast_computes_in_half_and_keeps_parameter_dtypes():
    """Under bf16 autocast (the trainer's forward): bf16 output, fp32 LoRA gradients, close to peft's path."""
    x = torch.randn(4, 64)
    out = {}
    for fused in (True, False):
        model = _lora(False, fused, dtype=torch.float32)
        xx = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(xx)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert all(g.dtype == torch.float32 for g in grads.values()) and len(grads) == 2
        out[fused] = (y.float(), xx.grad, grads)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=2e-2, atol=2e-2)
    for name, g in out[True][2].items():
        rel = (g - out[False][2][name]).norm() / out[False][2][name].norm()
        assert rel < 2e-2, f"{name}: {rel:.3e}"


def test_falls_back_to_peft_where_it_must():
    x = torch.randn(2, 64, dtype=torch.float64)
    layer = _lora(False, True).base_model.model.proj
    assert fused_training_adapter(layer, x) == "default"
    with torch.no_grad():  # rollouts / evaluation: no autograd node to fuse
        assert fused_training_adapter(layer, x) is None
    with layer_disabled(layer):
        assert fused_training_adapter(layer, x) is None
    layer.use_fused = False
    assert fused_training_adapter(layer, x) is None
    layer.use_fused = True
    layer.get_base_layer().weight.requires_grad_(True)  # a trained base needs its own weight gradient
    assert fused_training_adapter(layer, x) is None
    dropped = _lora(False, True, dropout=0.5).base_model.model.proj
    assert fused_training_adapter(dropped, x) is None and fused_training_adapter(dropped.eval(), x) == "default"


class _Subclass(nn.Linear):  # e.g. bitsandbytes' 4-bit layers: not F.linear of .weight
    pass


def test_nn_linear_subclasses_are_not_fused():
    config = register_fused_lora(LoraConfig(r=2, lora_alpha=4, target_modules=["proj"]))
    net = nn.Module()
    net.proj = _Subclass(8, 8)
    layer = get_peft_model(net, config).base_model.model.proj
    assert isinstance(layer, PeftLoraLinear) and fused_training_adapter(layer, torch.randn(1, 8)) is None


class layer_disabled:
    def __init__(self, layer):
        self.layer = layer

    def __enter__(self):
        self.layer.enable_adapters(False)

    def __exit__(self, *exc):
        self.layer.enable_adapters(True)


@pytest.mark.parametrize("fp4", [False, True])
def test_checkpointed_model_gradients_match_peft(fp4):
    """A Qwen2.5-shaped model with gradient checkpointing: every LoRA gradient as with peft's own ops."""
    grads = {}
    for fused in (True, False):
        model = build_random_model("tiny", fp4=fp4, device="cpu", dtype=torch.float32, seed=3)
        model = attach_lora(model, r=4, alpha=8, fp4=fp4, gradient_checkpointing=True, fused=fused)
        gen = torch.Generator().manual_seed(4)
        for name, p in model.named_parameters():
            if "lora_" in name:  # A from peft's unseeded init, B zero: both fixed here
                p.data = torch.randn(p.shape, generator=gen) * 0.05
        ids = torch.randint(0, 1000, (2, 9), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads[fused] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(grads[True]) == sorted(grads[False]) and len(grads[True]) == 2 * 7 * 2  # 2 layers x 7 x (A, B)
    for name, g in grads[True].items():
        torch.testing.assert_close(g, grads[False][name], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fp4", [False, True])
def test_gpu_many_rows_in_bf16_match_float64(fp4):
    """The update's shapes on CUDA (cuBLAS / the many-row FP4 path, 600 rows): outputs and every gradient vs
    float64 of the same (dequantized) weights, under the trainer's bf16 autocast."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, k, r = 3584, 3584, 32
    torch.manual_seed(5)
    dense = nn.Linear(k, n, bias=True, device="cuda")
    base = FP4Linear.from_linear(dense).to(torch.bfloat16) if fp4 else dense.to(torch.bfloat16)
    net = nn.Module()
    net.proj = base
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["proj"])
    if fp4:
        register_fp4_lora(config)
    model = get_peft_model(net, register_fused_lora(config))
    layer = model.base_model.model.proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    a.data = torch.randn_like(a, dtype=torch.float32) / k ** 0.5
    b.data = torch.randn_like(b, dtype=torch.float32) * 0.05
    x = torch.randn(2, 300, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 300, n, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and fused_training_adapter(layer, x) == "default"
    y.backward(g)
    w64 = (base.dequantize_weight(torch.float64) if fp4 else base.weight.double())
    x64, g64, a64, b64 = x.detach().double(), g.double(), a.detach().double(), b.detach().double()
    xa = x64 @ a64.T
    ref = x64 @ w64.T + base.bias.double() + 2.0 * xa @ b64.T
    gxa = 2.0 * g64 @ b64
    refs = {"y": (y, ref), "x": (x.grad, g64 @ w64 + gxa @ a64),
            "A": (a.grad, gxa.reshape(-1, r).T @ x64.reshape(-1, k)),
            "B": (b.grad, 2.0 * g64.reshape(-1, n).T @ xa.reshape(-1, r))}
    for name, (got, want) in refs.items():
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 1e-2, f"{name}: rel err {rel:.2e}"


def test_the_autograd_context_holds_no_cast_weight():
    """An fp32 base under bf16 autocast: what outlives the forward (saved tensors and the base ops) holds no bf16
    copy of W, which gradient checkpointing could not drop (it drops saved tensors only)."""
    model = _lora(False, True, dtype=torch.float32)
    layer = model.base_model.model.proj
    w = layer.get_base_layer().weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(4, 64, requires_grad=True))
    node = y.grad_fn
    while node is not None and "LoraLinearFunction" not in type(node).__name__:
        node = node.next_functions[0][0]
    assert node is not None
    cells = [c.cell_contents for f in node.ops for c in (f.__closure__ or ())]
    assert not any(isinstance(c, torch.Tensor) and c.shape == w.shape for c in cells)
    assert all(t.shape != w.shape for t in node.saved_tensors)
