"""Quantize a HF checkpoint with llmcompressor into a compressed-tensors checkpoint (what vLLM and our loader read).

    from qerl.quant.compress import quantize_checkpoint
    report = quantize_checkpoint("Qwen/Qwen2.5-7B-Instruct", "results/exp/quantized", "nvfp4")

Schemes: nvfp4 (NVFP4A16, data-free round-to-nearest), nvfp4-awq (AWQ smoothing calibrated on the given texts,
then NVFP4A16), mxfp4 (MXFP4A16), bf16 (plain bf16 copy, the baseline), nf4 (bitsandbytes NF4, QLoRA's;
qerl.quant.nf4: CUDA, or CPU with bitsandbytes >= 0.47).
The returned report holds the paper's "model size" numbers (bytes on disk by tensor kind vs bf16) and the
relative weight error ||W - deq(Q(W))|| / ||W|| per quantized layer (W after AWQ smoothing for nvfp4-awq, since
smoothing is exact and folded into the preceding norm).
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from torch import nn

from qerl.errors import QerlError
from qerl.checkpoint_guard import check_config_matches_weights, drop_remote_code
from qerl.hub import check_checkpoint

SCHEMES = {"nvfp4": "NVFP4A16", "nvfp4-awq": "NVFP4A16", "mxfp4": "MXFP4A16", "bf16": None, "nf4": None}
GROUP_SIZE = {"nvfp4": 16, "nvfp4-awq": 16, "mxfp4": 32}  # weights sharing one scale, along in_features
_SCALE_SUFFIXES = ("weight_scale", "weight_global_scale", "weight_zero_point", "input_global_scale")


def _load_dense(model_path: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    return model, tokenizer


def _calibration_dataset(tokenizer, texts, num_samples: int, max_seq_length: int):
    """Tokenized calibration rows (the training prompts, as the paper calibrates AWQ)."""
    from datasets import Dataset

    texts = [t for t in (texts or []) if t][:num_samples]
    if not texts:
        raise QerlError("calibration_texts: scheme nvfp4-awq needs at least one calibration text")
    enc = tokenizer(texts, truncation=True, max_length=max_seq_length)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


@contextlib.contextmanager
def _cpu_safe_calibration():
    """llmcompressor 0.14 pins cached activations for faster host-to-device copies even without an accelerator,
    which fails on CPU-only machines; pinning is only an optimisation, so skip it there."""
    if torch.cuda.is_available():
        yield
        return
    from unittest import mock

    from llmcompressor.pipelines.cache import IntermediatesCache

    with mock.patch.object(IntermediatesCache, "pin_memory", lambda self, *args, **kwargs: None):
        yield


def _recipe(scheme: str):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    quant = QuantizationModifier(targets="Linear", scheme=SCHEMES[scheme], ignore=["lm_head"])
    if scheme != "nvfp4-awq":
        return [quant]
    try:
        from llmcompressor.modifiers.transform.awq import AWQModifier
    except ImportError as err:
        raise QerlError(f"scheme nvfp4-awq: this llmcompressor has no AWQModifier ({err})") from err
    return [AWQModifier(), quant]


def _fake_quant_errors(model: nn.Module) -> dict[str, float]:
    """||W - deq(Q(W))|| / ||W|| for every calibrated module, with the module's own scales (what gets saved)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    errors = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None or not hasattr(module, "weight_scale"):
            continue
        w = module.weight.detach()
        q = fake_quantize(w, module.weight_scale, getattr(module, "weight_zero_point", None), scheme.weights,
                          global_scale=getattr(module, "weight_global_scale", None))
        errors[name] = _rel_error(w, q)
    return errors


def _rel_error(w: torch.Tensor, q: torch.Tensor) -> float:
    w = w.detach().double()
    return float((w - q.detach().double()).norm() / w.norm().clamp(min=1e-30))


def _check_group_size(model: nn.Module, scheme: str, model_path) -> None:
    """Every quantized Linear's in_features must split into whole scale groups; llmcompressor fails deep inside
    otherwise."""
    group = GROUP_SIZE[scheme]
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head" and module.in_features % group:
            raise QerlError(f"{model_path}: layer {name} has in_features {module.in_features}, not a multiple of "
                            f"{group}: scheme {scheme} scales each group of {group} input weights together")


def _quantize_llmcompressor(model_path, out_dir: Path, scheme, texts, num_samples, max_seq_length) -> dict:
    from llmcompressor import oneshot

    model, tokenizer = _load_dense(model_path, "auto")
    _check_group_size(model, scheme, model_path)
    kwargs = {}
    if scheme == "nvfp4-awq":
        kwargs = dict(dataset=_calibration_dataset(tokenizer, texts, num_samples, max_seq_length),
                      num_calibration_samples=num_samples, max_seq_length=max_seq_length, tokenizer=tokenizer)
    with _cpu_safe_calibration():
        oneshot(model=model, recipe=_recipe(scheme), **kwargs)
    errors = _fake_quant_errors(model)
    model.save_pretrained(str(out_dir), save_compressed=True)
    tokenizer.save_pretrained(str(out_dir))
    return errors


def _save_bf16(model_path, out_dir: Path) -> dict:
    """The unquantized baseline: a bf16 copy; 'error' is the bf16 rounding of each Linear (0 for bf16 sources)."""
    model, tokenizer = _load_dense(model_path, "auto")
    errors = {n: _rel_error(m.weight, m.weight.detach().to(torch.bfloat16))
              for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return errors


def _save_nf4(model_path, out_dir: Path) -> dict:
    """bitsandbytes NF4 with double quantization (the QLoRA baseline), quantized on the GPU if there is one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.quant.nf4 import nf4_config, require_nf4

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bnb = require_nf4(device, "scheme nf4")
    source = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16)
    dense = {n: m.weight.detach().float() for n, m in source.named_modules()
             if isinstance(m, nn.Linear) and n != "lm_head"}
    del source
    model = AutoModelForCausalLM.from_pretrained(str(model_path), quantization_config=nf4_config(torch.bfloat16),
                                                 dtype=torch.bfloat16, device_map={"": device})
    errors = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and name in dense:
            deq = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float().cpu()
            errors[name] = _rel_error(dense[name], deq)
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(str(out_dir))
    return errors


def _tensor_kind(name: str, dtype: str = "") -> str:
    # bitsandbytes keeps the packed NF4 codes under the layer's plain ".weight" name, as bytes
    if name.endswith("weight_packed") or (dtype == "U8" and name.endswith(".weight")):
        return "packed_weights"
    if name.endswith(_SCALE_SUFFIXES) or name.endswith((".absmax", ".quant_map", ".nested_absmax",
                                                        ".nested_quant_map", ".quant_state.bitsandbytes__nf4")):
        return "scales"
    if ".weight." in name and ("quant" in name or "absmax" in name):
        return "scales"
    return "other"


def _stored_tensors(path: Path):
    """(name, numel, bytes, safetensors dtype) of every tensor in a directory's safetensors files, read from the headers only."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise QerlError(f"{path}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                yield key, numel, numel * _DTYPE_BYTES[sl.get_dtype()], sl.get_dtype()


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E8M0": 1}


def size_report(out_dir: Path, model_path: Path | str) -> dict:
    """Bytes of the saved tensors by kind, and bytes the source model would take in bf16 (its tensor count x 2)."""
    by_kind = {"packed_weights": 0, "scales": 0, "other": 0}
    for name, _, nbytes, dtype in _stored_tensors(out_dir):
        by_kind[_tensor_kind(name, dtype)] += nbytes
    total = sum(by_kind.values())
    bf16 = 2 * sum(numel for _, numel, _, _ in _stored_tensors(Path(model_path)))
    files = sum(f.stat().st_size for f in Path(out_dir).glob("*.safetensors"))
    # the quantized Linears alone: 2 weights per packed byte, vs 2 bytes per weight in bf16
    linear_bf16 = 4 * by_kind["packed_weights"]
    linear = {"bytes": by_kind["packed_weights"] + by_kind["scales"], "bf16_bytes": linear_bf16,
              "ratio": (by_kind["packed_weights"] + by_kind["scales"]) / linear_bf16 if linear_bf16 else None}
    return {"bytes": {**by_kind, "total": total}, "bf16_bytes": bf16, "size_ratio_vs_bf16": total / bf16,
            "safetensors_file_bytes": files, "quantized_linears": linear}


def quantize_checkpoint(model_path, out_dir, scheme: str, calibration_texts=None, num_calibration_samples: int = 64,
                        max_seq_length: int = 512) -> dict:
    """Quantize model_path into out_dir (compressed-tensors, save_compressed) and return the quantize report."""
    if scheme not in SCHEMES:
        raise QerlError(f"scheme: {scheme!r} is not one of {sorted(SCHEMES)}")
    model_path, out_dir = check_checkpoint(model_path, "model_path"), Path(out_dir)
    check_config_matches_weights(model_path)  # a config that lies must not size the model we build
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if scheme == "bf16":
        errors = _save_bf16(model_path, out_dir)
    elif scheme == "nf4":
        errors = _save_nf4(model_path, out_dir)
    else:
        errors = _quantize_llmcompressor(model_path, out_dir, scheme, calibration_texts, num_calibration_samples,
                                         max_seq_length)
    drop_remote_code(out_dir, model_path)  # auto_map / .py files the save copied: never part of an output
    seconds = time.perf_counter() - start
    values = list(errors.values())
    report = {"scheme": scheme, "preset": SCHEMES[scheme], "seconds": seconds, **size_report(out_dir, model_path),
              "relative_weight_error": {"mean": sum(values) / len(values) if values else 0.0,
                                        "max": max(values, default=0.0), "num_layers": len(values),
                                        "per_layer": errors}}
    if scheme == "nvfp4-awq":
        report["num_calibration_samples"] = min(num_calibration_samples, len(calibration_texts or []))
    return report
