"""quantize_checkpoint on the tiny model: report numbers recomputed independently; both loaders agree."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("llmcompressor")  # absent on the bare GPU image

from qerl.errors import QerlError  # noqa: E402
from qerl.quant.compress import quantize_checkpoint
from qerl.quant.format import dequantize
from qerl.quant.linear import FP4Linear
from qerl.quant.loader import load_quantized_model

IDS = torch.tensor([[5, 77, 1000, 31, 2, 640, 9, 12]])


def _hf_dequantized(path):
    """transformers + compressed-tensors' own loading (decompresses to bf16 dense Linears)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    return AutoModelForCausalLM.from_pretrained(str(path), quantization_config=CompressedTensorsConfig(
        dequantize=True)).float()


def _check_both_loads_agree(path):
    ours = load_quantized_model(path)
    theirs = _hf_dequantized(path)
    fp4 = {n: m for n, m in ours.named_modules() if isinstance(m, FP4Linear)}
    assert len(fp4) == 14
    for name, module in fp4.items():  # same weights, bit for bit, at the bf16 they decompress to
        assert torch.equal(module.dequantize_weight(torch.bfloat16).float(), theirs.get_submodule(name).weight)
    with torch.no_grad():
        a, b = ours(IDS).logits, theirs(IDS).logits
    # ours keeps the float32 dequantization, theirs rounds W to bf16: agree to bf16 resolution
    torch.testing.assert_close(a, b, rtol=0, atol=2e-2 * b.abs().max().item())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_nvfp4_report_and_loads(nvfp4_dir, tiny_model_dir):
    report = json.loads((nvfp4_dir / "report.json").read_text())
    assert report["scheme"] == "nvfp4" and report["seconds"] > 0
    saved = load_file(str(nvfp4_dir / "model.safetensors"))
    source = load_file(str(tiny_model_dir / "model.safetensors"))
    packed = sum(t.numel() for k, t in saved.items() if k.endswith("weight_packed"))
    scales = sum(t.numel() * t.element_size() for k, t in saved.items() if "scale" in k)
    other = sum(t.numel() * t.element_size() for k, t in saved.items() if k.rsplit(".", 1)[-1] in ("weight", "bias"))
    assert report["bytes"] == {"packed_weights": packed, "scales": scales, "other": other,
                               "total": packed + scales + other}
    assert report["bf16_bytes"] == 2 * sum(t.numel() for t in source.values())
    assert report["quantized_linears"]["ratio"] == pytest.approx((packed + scales) / (4 * packed))
    assert 0.28 < report["quantized_linears"]["ratio"] < 0.29  # 4.5 bits + 32 bits per tensor, vs 16

    # per-layer errors recomputed from the saved file against the source weights
    errors = report["relative_weight_error"]
    assert errors["num_layers"] == 14
    for name, err in errors["per_layer"].items():
        w = source[f"{name}.weight"].double()
        q = dequantize(saved[f"{name}.weight_packed"], saved[f"{name}.weight_scale"],
                       saved[f"{name}.weight_global_scale"], dtype=torch.float64)
        assert err == pytest.approx(float((w - q).norm() / w.norm()), rel=1e-5)
    assert 0.05 < errors["mean"] <= errors["max"] < 0.15
    _check_both_loads_agree(nvfp4_dir)


def test_mxfp4_scheme(tiny_model_dir, tmp_path):
    report = quantize_checkpoint(tiny_model_dir, tmp_path, "mxfp4")
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "mxfp4-pack-quantized"
    assert report["bytes"]["scales"] == report["bytes"]["packed_weights"] * 2 // 32  # one uint8 per 32 weights
    _check_both_loads_agree(tmp_path)


@pytest.mark.slow  # ~20 s of AWQ grid search on 2 CPU cores
def test_nvfp4_awq_calibrates_and_loads(tiny_model_dir, tmp_path):
    texts = ["What is 17 * 23? Think step by step.", "A train covers 120 km in 1.5 hours; find its speed.",
             "Solve for x: 3x + 5 = 20.", "How many primes are below 30?"]
    report = quantize_checkpoint(tiny_model_dir, tmp_path, "nvfp4-awq", calibration_texts=texts,
                                 num_calibration_samples=4, max_seq_length=32)
    assert report["num_calibration_samples"] == 4 and report["relative_weight_error"]["num_layers"] == 14
    model = load_quantized_model(tmp_path)
    with torch.no_grad():
        assert torch.isfinite(model(IDS).logits).all()
    with pytest.raises(QerlError, match="calibration_texts"):
        quantize_checkpoint(tiny_model_dir, tmp_path / "x", "nvfp4-awq", calibration_texts=[])


def test_bf16_baseline_and_bad_schemes(tiny_model_dir, tmp_path):
    report = quantize_checkpoint(tiny_model_dir, tmp_path / "bf16", "bf16")
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert report["bytes"]["total"] == report["bf16_bytes"] and report["size_ratio_vs_bf16"] == 1.0
    assert 0 < report["relative_weight_error"]["max"] < 5e-3  # bf16 rounding of the float32 source
    with pytest.raises(QerlError, match="scheme: 'int8'"):
        quantize_checkpoint(tiny_model_dir, tmp_path / "x", "int8")
