"""Load a compressed-tensors NVFP4/MXFP4 checkpoint into a HF model whose quantized Linears stay packed.

    from qerl.quant.loader import load_quantized_model
    model = load_quantized_model("results/exp/quantized", dtype=torch.bfloat16, device="cuda")

transformers' own loader decompresses to dense weights (and a packed model breaks peft). Here the model skeleton is
built on the meta device, every quantized Linear is swapped for an `FP4Linear` before any memory is allocated, and
the safetensors tensors are assigned in place: packed bytes and scales as stored, the rest (embeddings, norms,
biases, an untied lm_head) in `dtype`. A dense copy of a quantized weight never exists.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from qerl.errors import QerlError
from qerl.checkpoint_guard import check_config_matches_weights
from qerl.hub import check_checkpoint, read_json
from qerl.quant.linear import FP4Linear

SUPPORTED_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
# tensors kept in their stored dtype: packed codes, FP8/E8M0 scales, FP32 global scales
_QUANT_TENSORS = ("weight_packed", "weight_scale", "weight_global_scale")


def _read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise QerlError(f"{cfg_file}: not found (expected a HF checkpoint directory)")
    return read_json(cfg_file)


def is_quantized_checkpoint(path: str | Path) -> bool:
    """True when config.json carries a quantization_config (of any method); load_quantized_model reads the
    compressed-tensors NVFP4/MXFP4 ones and rejects the others with a clear error."""
    path = Path(path)
    return (path / "config.json").is_file() and "quantization_config" in _read_config(path)


def checkpoint_format(path: str | Path) -> str:
    """'dense', 'nf4' (bitsandbytes, QLoRA's base), or the compressed-tensors 'nvfp4' / 'mxfp4' of a checkpoint
    directory; a one-line error for any other quantization_config."""
    from qerl.quant.nf4 import is_nf4_checkpoint

    path = Path(path)
    qcfg = read_json(path / "config.json").get("quantization_config")
    if not qcfg:
        return "dense"
    return "nf4" if is_nf4_checkpoint(qcfg) else quantization_format(qcfg, path / "config.json")


def quantization_format(qcfg: dict, cfg_file: Path) -> str:
    """'nvfp4' or 'mxfp4' from a compressed-tensors quantization_config; one-line error for anything else."""
    method = qcfg.get("quant_method")
    if method != "compressed-tensors":
        raise QerlError(f"{cfg_file}: quantization_config.quant_method is {method!r}, expected 'compressed-tensors'")
    formats = {qcfg.get("format")} | {g.get("format") for g in qcfg.get("config_groups", {}).values()}
    formats.discard(None)
    unsupported = formats - SUPPORTED_FORMATS.keys()
    if not formats or unsupported or len(formats) > 1:
        raise QerlError(f"{cfg_file}: quantization_config.format is {sorted(formats) or None}, expected one of "
                        f"{sorted(SUPPORTED_FORMATS)}")
    return SUPPORTED_FORMATS[formats.pop()]


def _matches(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors target syntax: 're:<regex>' on the module name, else a module name or a class name."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target or type(module).__name__ == target


def quantized_module_names(model: nn.Module, qcfg: dict) -> list[str]:
    """Names of the Linear modules the config's groups target and its ignore list does not exclude."""
    targets = [t for g in qcfg.get("config_groups", {}).values() if g.get("weights") for t in g.get("targets", [])]
    ignore = qcfg.get("ignore") or []
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(_matches(name, module, t) for t in targets)
            and not any(_matches(name, module, t) for t in ignore)]


def _build_skeleton(config, qcfg: dict, fmt: str, dtype: torch.dtype) -> tuple[nn.Module, list[str]]:
    """The HF model entirely on meta (no storage allocated for any weight) with FP4Linear swapped in."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    names = quantized_module_names(model, qcfg)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        old = model.get_submodule(name)
        new = FP4Linear(old.in_features, old.out_features, old.bias is not None, fmt=fmt, compute_dtype=dtype,
                        device="meta")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model, names


def _materialize_computed_buffers(model: nn.Module, device) -> None:
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints: allocate them and let transformers'
    own `_init_weights` recompute them, as from_pretrained does."""
    for name, buf in list(model.named_non_persistent_buffers()):
        if not buf.is_meta:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        owner.register_buffer(attr, torch.empty_like(buf, device=device), persistent=False)
        model._init_weights(owner)


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(read_json(index)["weight_map"].values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise QerlError(f"{path}: no *.safetensors files")
    return files


def _read_tensors(path: Path, expected: dict[str, torch.Tensor], dtype: torch.dtype, device) -> dict:
    """Checkpoint tensors that the model expects, shape-checked, on `device`; floats outside FP4 layers in dtype."""
    from safetensors import safe_open

    loaded = {}
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key not in expected:
                    continue  # e.g. a saved lm_head of a tied model, or rotary caches of old exports
                want = expected[key]
                shape = tuple(f.get_slice(key).get_shape())
                if shape != tuple(want.shape):
                    raise QerlError(f"{file.name}: tensor {key} has shape {shape}, expected {tuple(want.shape)}")
                tensor = f.get_tensor(key)
                quant = key.rsplit(".", 1)[-1] in _QUANT_TENSORS
                if quant and tensor.dtype != want.dtype:
                    raise QerlError(f"{file.name}: tensor {key} has dtype {tensor.dtype}, expected {want.dtype}")
                loaded[key] = tensor if quant or not tensor.is_floating_point() else tensor.to(dtype)
    return loaded


def load_quantized_model(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """A HF causal LM from a compressed-tensors NVFP4/MXFP4 checkpoint, quantized Linears as packed FP4Linear."""
    from transformers import AutoConfig

    path = Path(path)
    cfg_file = path / "config.json"
    raw = _read_config(path)
    check_checkpoint(path)  # weight files readable, model_type known: one line before any tensor is read
    check_config_matches_weights(path)  # packed shapes bound the skeleton the config would build
    if "quantization_config" not in raw:
        raise QerlError(f"{cfg_file}: quantization_config missing (not a quantized checkpoint; quantize it first)")
    qcfg = raw["quantization_config"]
    fmt = quantization_format(qcfg, cfg_file)
    config = AutoConfig.from_pretrained(str(path))
    # the skeleton must not go through transformers' compressed-tensors quantizer (it would add dense weights)
    config.quantization_config = None
    model, names = _build_skeleton(config, qcfg, fmt, dtype)
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if v.device.type == "meta"}
    loaded = _read_tensors(path, expected, dtype, device)
    model.load_state_dict(loaded, strict=False, assign=True)
    model.tie_weights()
    _materialize_computed_buffers(model, device)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise QerlError(f"{path}: tensor {missing[0]} missing from the checkpoint ({len(missing)} missing in all)")
    for name in names:
        model.get_submodule(name).requires_grad_(False)
    model.config.quantization_config = qcfg
    model.name_or_path = str(path)
    return model.to(device).eval()
