"""load_quantized_model: packed FP4Linear modules, no dense copy of a quantized weight, one-line errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qerl.errors import QerlError
from qerl.quant.format import dequantize_nvfp4
from qerl.quant.linear import FP4Linear
from qerl.quant.loader import is_quantized_checkpoint, load_quantized_model

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_loads_packed_modules_and_matches_dense_reference(nvfp4_dir, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = load_quantized_model(nvfp4_dir)
    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    assert len(fp4) == 2 * len(PROJ) and all(n.endswith(PROJ) for n in fp4)
    for m in fp4.values():
        assert not hasattr(m, "weight")
        assert m.weight_packed.dtype == torch.uint8 and m.weight_scale.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, loaded once
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))

    # dense reference: the float32 source model with each quantized weight replaced by its float64 dequantization
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64)
    tensors = load_file(str(nvfp4_dir / "model.safetensors"))
    for name in fp4:
        w = dequantize_nvfp4(tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"],
                             tensors[f"{name}.weight_global_scale"], dtype=torch.float64)
        ref.get_submodule(name).weight.data.copy_(w)
    ids = torch.tensor([[3, 17, 256, 1024, 9, 42, 7]])
    with torch.no_grad():
        ours, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(ours.double(), want, rtol=1e-4, atol=1e-5)


class _DenseAllocations(TorchDispatchMode):
    """Records every real (non-meta) floating tensor an op produces whose shape is a quantized weight's."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = set(shapes), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.is_floating_point() \
                    and tuple(t.shape) in self.shapes:
                self.seen.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_no_dense_copy_of_a_quantized_weight_is_ever_allocated(nvfp4_dir):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = load_quantized_model(nvfp4_dir)
    shapes = {(m.out_features, m.in_features) for m in model.modules() if isinstance(m, FP4Linear)}
    with _DenseAllocations(shapes) as rec:
        load_quantized_model(nvfp4_dir, dtype=torch.bfloat16)
    assert rec.seen == []
    # the recorder does see transformers' own (dequantizing) load, so the empty list above means something
    with _DenseAllocations(shapes) as rec:
        AutoModelForCausalLM.from_pretrained(str(nvfp4_dir), quantization_config=CompressedTensorsConfig(
            dequantize=True))
    assert rec.seen


def _write_big_checkpoint(path, qcfg):
    """A Qwen2 checkpoint whose Linears dominate (~55M weights), filled with random packed bytes."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=1024, intermediate_size=8192, num_hidden_layers=2,
                      num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True)
    shapes = {"q_proj": (1024, 1024), "k_proj": (256, 1024), "v_proj": (256, 1024), "o_proj": (1024, 1024),
              "gate_proj": (8192, 1024), "up_proj": (8192, 1024), "down_proj": (1024, 8192)}
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(512, 1024, generator=g),
               "model.norm.weight": torch.ones(1024)}
    for i in range(2):
        pre = f"model.layers.{i}."
        tensors[pre + "input_layernorm.weight"] = torch.ones(1024)
        tensors[pre + "post_attention_layernorm.weight"] = torch.ones(1024)
        for proj, (n, k) in shapes.items():
            mod = pre + ("mlp." if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + proj
            tensors[mod + ".weight_packed"] = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            tensors[mod + ".weight_scale"] = torch.rand(n, k // 16, generator=g).to(torch.float8_e4m3fn)
            tensors[mod + ".weight_global_scale"] = torch.ones(1)
            if proj in ("q_proj", "k_proj", "v_proj"):
                tensors[mod + ".bias"] = torch.zeros(n)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = cfg.to_dict()
    raw["quantization_config"] = qcfg
    (path / "config.json").write_text(json.dumps(raw))
    dense_bf16 = sum(2 * n * k for n, k in shapes.values()) * 2
    return dense_bf16


_PEAK_RSS = textwrap.dedent("""
    import re, sys, torch, transformers.models.qwen2.modeling_qwen2
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from qerl.quant.loader import load_quantized_model
    def kib(field):
        return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
    path = sys.argv[1]
    open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM (peak RSS) to the current RSS
    before = kib("VmRSS")
    if sys.argv[2] == "qerl":
        model = load_quantized_model(path, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
    print((kib("VmHWM") - before) * 1024)
""")


def _peak_rss_delta(path, loader: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(path), loader], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two subprocess loads of a 55M-weight model (~20 s)
def test_peak_rss_of_the_load_is_below_a_dense_bf16_copy(nvfp4_dir, tmp_path):
    qcfg = json.loads((nvfp4_dir / "config.json").read_text())["quantization_config"]
    dense_bf16 = _write_big_checkpoint(tmp_path / "big", qcfg)
    ours = _peak_rss_delta(tmp_path / "big", "qerl")
    # packed weights + scales are 0.28 of bf16; allow the mmapped file pages on top
    assert ours < 0.6 * dense_bf16, (ours, dense_bf16)
    # the measurement does see a dense load: transformers' dequantizing loader of the same checkpoint
    assert _peak_rss_delta(tmp_path / "big", "hf") > dense_bf16


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, fn):
    raw = json.loads((path / "config.json").read_text())
    fn(raw)
    (path / "config.json").write_text(json.dumps(raw))


def _one_line_error(path, match):
    with pytest.raises(QerlError, match=match) as err:
        load_quantized_model(path)
    assert "\n" not in str(err.value)


def test_missing_or_foreign_quantization_config(nvfp4_dir, tmp_path):
    d = _copy(nvfp4_dir, tmp_path / "a")
    _edit_config(d, lambda c: c.pop("quantization_config"))
    _one_line_error(d, "quantization_config missing")
    assert not is_quantized_checkpoint(d) and is_quantized_checkpoint(nvfp4_dir)

    _edit_config(d, lambda c: c.update(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True}))
    _one_line_error(d, "quant_method is 'bitsandbytes'")

    qcfg = json.loads((nvfp4_dir / "config.json").read_text())["quantization_config"]
    qcfg = json.loads(json.dumps(qcfg).replace("nvfp4-pack-quantized", "int-quantized"))
    _edit_config(d, lambda c: c.update(quantization_config=qcfg))
    _one_line_error(d, "format is \\['int-quantized'\\]")


def test_shape_mismatch_and_missing_tensor_name_the_tensor(nvfp4_dir, tmp_path):
    tensors = load_file(str(nvfp4_dir / "model.safetensors"))
    d = _copy(nvfp4_dir, tmp_path / "shape")
    bad = dict(tensors)
    bad["model.layers.0.self_attn.q_proj.weight_scale"] = bad["model.layers.0.self_attn.q_proj.weight_scale"][:, :4].contiguous()
    save_file(bad, str(d / "model.safetensors"), metadata={"format": "pt"})
    _one_line_error(d, r"tensor model\.layers\.0\.self_attn\.q_proj\.weight_scale has shape \(128, 4\), "
                       r"expected \(128, 8\)")

    missing = dict(tensors)
    del missing["model.layers.1.mlp.down_proj.weight_packed"]
    save_file(missing, str(d / "model.safetensors"), metadata={"format": "pt"})
    _one_line_error(d, r"tensor model\.layers\.1\.mlp\.down_proj\.weight_packed missing")
