"""Merge a trained LoRA adapter into its base and write a plain HF checkpoint (what evaluation and vLLM serve).

    from qerl.merging import merge_adapter
    report = merge_adapter("results/exp/quantized", "results/exp/adapter", "results/exp/merged")

An FP4 base is dequantized exactly in float32, an NF4 base (bitsandbytes, QLoRA's) by bitsandbytes' own
dequantize_4bit in float32 (what its float32 forward multiplies by); peft's merge_and_unload merges the adapter
into that dense model, trained RMSNorm scales (qerl.checkpoint's trained_norms.safetensors) are copied in, and the
result is cast to `dtype` once and saved without scale tensors or quantization_config. The report's max_abs_diff is
recomputed from the files alone: saved weight vs deq(W) + B @ A * scaling in float64. Its merged_from names the
base, its format and quantization_config, and the adapter with its rank, alpha and scaling.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from qerl.errors import QerlError
from qerl.hub import check_checkpoint, read_json, resolve_model, safetensors_header, tensor_shapes

TRAINED_NORMS_FILE = "trained_norms.safetensors"  # written by qerl.checkpoint.save_trained_norms


def _dense_model(base_dir: Path, state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh float32 HF model of base_dir's architecture holding state: no quantization_config, and none of
    from_pretrained's load-time weight conversions, which save_pretrained would try to reverse."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qerl.quant.loader import _materialize_computed_buffers

    config = AutoConfig.from_pretrained(str(base_dir))
    del config.quantization_config
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(state, strict=False, assign=True)
    dense.tie_weights()
    _materialize_computed_buffers(dense, "cpu")
    return dense


def _dense_from_fp4(base_dir: Path) -> nn.Module:
    """A float32 HF model whose quantized Linears hold deq(W) (exact: E2M1 x FP8 / FP32 fits in float32)."""
    from qerl.quant.loader import load_quantized_model

    fp4 = load_quantized_model(base_dir, dtype=torch.float32)
    state = {}
    for name, tensor in fp4.state_dict().items():
        module_name, _, leaf = name.rpartition(".")
        if leaf in ("weight_packed", "weight_scale", "weight_global_scale"):
            if leaf == "weight_packed":
                state[f"{module_name}.weight"] = fp4.get_submodule(module_name).dequantize_weight(torch.float32)
        else:
            state[name] = tensor
    return _dense_model(base_dir, state)


def _load_base(base_dir: Path, fmt: str) -> nn.Module:
    """The base as a dense float32 model whose Linears hold exactly the weights training multiplied by."""
    from transformers import AutoModelForCausalLM

    if fmt == "nf4":
        from qerl.quant.nf4 import dequantized_nf4_state

        # peft's merge into a bnb Linear4bit re-quantizes W + BA to NF4 (the delta lost to rounding): merge dense
        return _dense_model(base_dir, dequantized_nf4_state(base_dir, torch.float32))
    if fmt != "dense":
        return _dense_from_fp4(base_dir)
    return AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)


def _copy_trained_norms(model: nn.Module, adapter_dir: Path) -> list[str]:
    """Overwrite RMSNorm scales trained beside LoRA; names are the plain base model's."""
    from safetensors.torch import load_file

    path = adapter_dir / TRAINED_NORMS_FILE
    if not path.is_file():
        return []
    params = dict(model.named_parameters())
    norms = load_file(str(path))
    for name, value in norms.items():
        if name not in params or params[name].shape != value.shape:
            want = tuple(params[name].shape) if name in params else "no such parameter"
            raise QerlError(f"{path}: tensor {name} {tuple(value.shape)} does not fit the base model ({want})")
        with torch.no_grad():
            params[name].copy_(value)
    return sorted(norms)


def _save_plain(model: nn.Module, base_dir: Path, adapter_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.to(dtype).save_pretrained(str(out_dir))
    tok_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    AutoTokenizer.from_pretrained(str(tok_src)).save_pretrained(str(out_dir))
    if (base_dir / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(str(base_dir)).save_pretrained(str(out_dir))


def _adapter_config(adapter_dir: Path) -> dict:
    file = adapter_dir / "adapter_config.json"
    cfg = read_json(file)
    missing = [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]
    if missing:
        raise QerlError(f"{file}: missing {', '.join(missing)} (expected a PEFT LoRA adapter config)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise QerlError(f"{file}: peft_type is {cfg['peft_type']!r}, expected 'LORA'")
    if not isinstance(cfg["r"], int) or cfg["r"] <= 0 or not isinstance(cfg["lora_alpha"], (int, float)):
        raise QerlError(f"{file}: r must be a positive integer and lora_alpha a number "
                        f"(got r={cfg['r']!r}, lora_alpha={cfg['lora_alpha']!r})")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise QerlError(f"{file}: rank_pattern/alpha_pattern are not supported")
    return cfg


def _lora_scaling(adapter_dir: Path) -> tuple[dict, float]:
    cfg = _adapter_config(adapter_dir)
    r = cfg["r"]
    return cfg, cfg["lora_alpha"] / (r ** 0.5 if cfg.get("use_rslora") else r)


def _linear_shape(base: dict[str, tuple[int, ...]], module: str) -> tuple[int, int] | None:
    """(out_features, in_features) of a base Linear from its stored tensor: dense, or FP4 packed two per byte."""
    if len(base.get(f"{module}.weight", ())) == 2:
        return base[f"{module}.weight"]
    if len(base.get(f"{module}.weight_packed", ())) == 2:
        rows, cols = base[f"{module}.weight_packed"]
        return rows, 2 * cols
    return None


def _base_shapes(base_dir: Path, fmt: str) -> dict[str, tuple[int, ...]]:
    """Stored tensor shapes; an NF4 layer's packed bytes are stored as (n/2, 1): its shape is in its quant state."""
    base = tensor_shapes(base_dir)
    if fmt == "nf4":
        from qerl.quant.nf4 import NF4_STATE_SUFFIX, stored_nf4_layers, stored_nf4_shape

        tensors = _Tensors(base_dir)
        base.update({f"{m}.weight": stored_nf4_shape(tensors[m + NF4_STATE_SUFFIX])
                     for m in stored_nf4_layers(tensors.keys())})
    return base


def _check_adapter_fits(adapter_dir: Path, base_dir: Path, cfg: dict, fmt: str) -> None:
    """Every LoRA pair must sit on a base Linear of its shape: an adapter trained for another base fails here,
    naming the layer, instead of deep inside peft."""
    file = adapter_dir / "adapter_model.safetensors"
    if not file.is_file():
        raise QerlError(f"{adapter_dir}: no adapter_model.safetensors (pickled adapter_model.bin is not loaded)")
    adapter = {k: tuple(t["shape"]) for k, t in safetensors_header(file).items()}
    base = _base_shapes(base_dir, fmt)
    targets, modules = cfg["target_modules"], {name.rpartition(".")[0] for name in base}
    # peft's list matching: a module name equal to a target or ending in "."+target (a str is a regex: skipped)
    if isinstance(targets, list) and not any(m == t or m.endswith("." + t) for m in modules for t in targets):
        raise QerlError(f"{adapter_dir}/adapter_config.json: target_modules {targets} are not layers of the base "
                        f"{base_dir} (adapter trained for another model?)")
    pairs = sorted(k for k in adapter if k.endswith(".lora_A.weight"))
    if not pairs:
        raise QerlError(f"{file}: no LoRA tensors (*.lora_A.weight)")
    for key in pairs:
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        want = _linear_shape(base, module)
        if want is None:
            raise QerlError(f"{file}: layer {module} is not in the base {base_dir} (adapter trained for another "
                            f"model?)")
        b_shape = adapter.get(key.replace("lora_A", "lora_B"))
        got = (b_shape[0] if b_shape else None, adapter[key][-1])
        if tuple(got) != tuple(want):
            raise QerlError(f"{file}: layer {module} LoRA maps {got[1]} -> {got[0]} features but the base {base_dir} "
                            f"layer is {want[1]} -> {want[0]} (adapter trained for another base model)")


class _Tensors:
    """Lazy name -> tensor access over a directory's safetensors files (one tensor in memory at a time)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._open = safe_open
        self.files = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), file))

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def keys(self):
        return self.files.keys()

    def __getitem__(self, key: str) -> torch.Tensor:
        with self._open(str(self.files[key]), framework="pt") as f:
            return f.get_tensor(key)

    def get(self, key: str):
        return self[key] if key in self else None


def _independent_max_diff(base_dir: Path, adapter_dir: Path, out_dir: Path) -> tuple[float, float, int]:
    """max |merged - (deq(W) + B @ A * scaling)| over the adapted layers, from the three directories' files."""
    from qerl.quant.format import dequantize
    from qerl.quant.nf4 import NF4_STATE_SUFFIX, dequantize_stored_nf4

    _, scaling = _lora_scaling(adapter_dir)
    adapter, base, merged = _Tensors(adapter_dir), _Tensors(base_dir), _Tensors(out_dir)
    max_diff, max_weight, count = 0.0, 0.0, 0
    for key in sorted(k for k in adapter.files if k.endswith("lora_A.weight")):
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        a, b = adapter[key].double(), adapter[key.replace("lora_A", "lora_B")].double()
        if module + NF4_STATE_SUFFIX in base:
            w = dequantize_stored_nf4(base, module).double()
        elif f"{module}.weight_packed" in base:
            w = dequantize(base[f"{module}.weight_packed"], base[f"{module}.weight_scale"],
                           base.get(f"{module}.weight_global_scale"), dtype=torch.float64)
        else:
            w = base[f"{module}.weight"].double()
        expected = w + (b @ a) * scaling
        got = merged[f"{module}.weight"].double()
        max_diff = max(max_diff, float((got - expected).abs().max()))
        max_weight = max(max_weight, float(expected.abs().max()))
        count += 1
    return max_diff, max_weight, count


def check_merge_inputs(base_dir, adapter_dir) -> tuple[Path, str]:
    """(checked base dir, its format) once the adapter fits the base and the base can be dequantized here; a
    one-line error naming the file or layer otherwise. Reads headers and small tensors only."""
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise QerlError(f"adapter_dir: {adapter_dir}/adapter_config.json not found (expected a PEFT adapter)")
    base_dir = check_checkpoint(resolve_model(str(base_dir), what="base_dir"), "base_dir")
    from qerl.quant.loader import checkpoint_format

    fmt = checkpoint_format(base_dir)
    if fmt == "nf4":
        from qerl.quant.nf4 import require_nf4

        require_nf4("cpu", f"base {base_dir} (bitsandbytes NF4)")  # the merge dequantizes on CPU
    _check_adapter_fits(adapter_dir, base_dir, _adapter_config(adapter_dir), fmt)
    return base_dir, fmt


def _merged_from(base_dir: Path, fmt: str, adapter_dir: Path) -> dict:
    cfg, scaling = _lora_scaling(adapter_dir)
    return {"base": str(base_dir), "base_format": fmt,
            "base_quantization_config": read_json(base_dir / "config.json").get("quantization_config"),
            "adapter": str(adapter_dir), "lora_r": cfg["r"], "lora_alpha": cfg["lora_alpha"],
            "use_rslora": bool(cfg.get("use_rslora")), "lora_scaling": scaling}


def merge_adapter(base_dir, adapter_dir, out_dir, *, dtype: torch.dtype = torch.bfloat16,
                  requantize: str | None = None) -> dict:
    """Write base + LoRA (+ trained norms) to out_dir as a plain checkpoint in dtype; return the merge report.
    With requantize (a qerl.quant.compress scheme) the merged model is also quantized into out_dir/requantized."""
    from peft import PeftModel

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    base_dir, fmt = check_merge_inputs(base_dir, adapter_dir)  # validate before the heavy work
    merged = PeftModel.from_pretrained(_load_base(base_dir, fmt), str(adapter_dir)).merge_and_unload()
    norms = _copy_trained_norms(merged, adapter_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_plain(merged, base_dir, adapter_dir, out_dir, dtype)
    max_diff, max_weight, count = _independent_max_diff(base_dir, adapter_dir, out_dir)
    report = {"base": str(base_dir), "adapter": str(adapter_dir), "base_quantized": fmt != "dense",
              "dtype": str(dtype).removeprefix("torch."), "merged_layers": count, "trained_norms_copied": len(norms),
              "max_abs_diff": max_diff, "max_abs_weight": max_weight,
              "merged_from": _merged_from(base_dir, fmt, adapter_dir)}
    if requantize:
        from qerl.quant.compress import quantize_checkpoint

        target = out_dir / "requantized"
        shutil.rmtree(target, ignore_errors=True)
        report["requantize"] = quantize_checkpoint(out_dir, target, requantize)
        report["requantized_dir"] = str(target)
    return report
