"""The trainable policy: a frozen base (FP4, NF4 or dense) with LoRA, or a fully trainable dense model.

    from qerl.policy import LoraSpec, load_policy
    model, tok = load_policy("results/exp/quantized", mode="qlora_fp4", dtype=torch.bfloat16, device="cuda",
                             lora=LoraSpec(r=32, alpha=64), train_norms=False, gradient_checkpointing=True)

Modes (the paper's table rows): qlora_fp4 = NVFP4/MXFP4 base kept packed (qerl.quant) + LoRA; lora = dense base +
LoRA; qlora_nf4 = bitsandbytes NF4 base (an NF4 checkpoint from the quantize stage, or a dense one quantized
while loading) + peft's LoRA for bitsandbytes layers (QLoRA; CUDA, or CPU with bitsandbytes >= 0.47); full =
every parameter trainable.
With train_norms the RMSNorm scales train too (they are what AQN perturbs).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qerl.checkpoint_guard import check_config_matches_weights
from qerl.errors import QerlError
from qerl.hub import check_checkpoint, resolve_model

MODES = ("qlora_fp4", "lora", "qlora_nf4", "full")
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyper-parameters (TRL's lora_r / lora_alpha / lora_dropout) and the modules it wraps; fused: each
    layer trains as one autograd node (qerl.fused_lora) in modes lora and qlora_fp4."""

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    fused: bool = True

    def __post_init__(self):
        if self.r <= 0:
            raise QerlError(f"lora.r: expected a positive rank, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise QerlError(f"lora.dropout: expected a value in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise QerlError("lora.target_modules: expected at least one module name")

    def to_config(self):
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none", task_type="CAUSAL_LM")


def _check_args(model_path, mode: str, lora: LoraSpec | None) -> Path:
    """The checkpoint directory (a hub name resolves to its cached snapshot), after the cheap argument checks."""
    if mode not in MODES:
        raise QerlError(f"mode: {mode!r} is not one of {list(MODES)}")
    if mode == "full" and lora is not None:
        raise QerlError("lora: mode 'full' trains every weight; leave lora unset")
    if mode != "full" and lora is None:
        raise QerlError(f"lora: mode {mode!r} needs a LoraSpec(r, alpha)")
    path = check_checkpoint(resolve_model(str(model_path), what="model_path"), "model_path")
    check_config_matches_weights(path)
    return path


def _load_base(model_path: Path, mode: str, dtype: torch.dtype, device, empty: bool = False) -> nn.Module:
    """The base model in the form the mode trains on; the checkpoint kind must match the mode."""
    from transformers import AutoModelForCausalLM

    from qerl.quant.loader import is_quantized_checkpoint, load_quantized_model

    quantized = is_quantized_checkpoint(model_path)
    if mode == "qlora_nf4":
        return _load_nf4(model_path, dtype, device, quantized)
    if mode == "qlora_fp4":
        if not quantized:
            raise QerlError(f"mode qlora_fp4: {model_path} has no quantization_config; run the quantize stage "
                            f"(scheme nvfp4) and point the policy at its output")
        return load_quantized_model(model_path, dtype=dtype, device=device)
    if quantized:
        raise QerlError(f"mode {mode}: {model_path} is a quantized checkpoint; use the dense (bf16) model")
    if empty:
        return _empty_base(model_path, dtype)
    return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device)


def _empty_base(model_path: Path, dtype: torch.dtype) -> nn.Module:
    """The checkpoint's model with every tensor on the meta device: its config is read, its weights are not."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_path)), dtype=dtype)
    with contextlib.suppress(OSError):  # as from_pretrained: the checkpoint's own EOS ids, when it has a file
        model.generation_config = GenerationConfig.from_pretrained(str(model_path))
    return model


def _load_nf4(model_path: Path, dtype: torch.dtype, device, quantized: bool) -> nn.Module:
    """QLoRA's base: bitsandbytes NF4 with double quantization, computing in dtype; an NF4 checkpoint as saved
    by the quantize stage (scheme nf4), or a dense one quantized as it loads."""
    from transformers import AutoModelForCausalLM

    from qerl.hub import read_json
    from qerl.quant.nf4 import is_nf4_checkpoint, load_nf4_model, nf4_config, prepare_nf4_layers, require_nf4

    require_nf4(device, "mode qlora_nf4")
    if quantized:
        if not is_nf4_checkpoint(read_json(model_path / "config.json").get("quantization_config")):
            raise QerlError(f"mode qlora_nf4: {model_path} is quantized, but not with bitsandbytes NF4; use the dense "
                            f"model or the quantize stage's output of scheme nf4")
        return load_nf4_model(model_path, dtype, device)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, device_map={"": torch.device(device)},
                                                 quantization_config=nf4_config(dtype))
    prepare_nf4_layers(model, dtype)
    return model


def _norm_parameters(model: nn.Module):
    """The scale of every RMSNorm (decoder layers and the final norm)."""
    for module in model.modules():
        if "RMSNorm" in type(module).__name__ and isinstance(getattr(module, "weight", None), nn.Parameter):
            yield module.weight


def check_target_modules(base: nn.Module, targets: tuple[str, ...]) -> None:
    """Every lora.target_modules name must name a layer, as peft matches a list (the module's name, or its last
    dotted parts): a typo would otherwise train fewer layers than asked, or stop inside peft."""
    names = [name for name, _ in base.named_modules() if name]
    missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        layers = sorted({name.rsplit(".", 1)[-1] for name, m in base.named_modules()
                         if name and hasattr(m, "in_features") and not list(m.children())})
        raise QerlError(f"lora.target_modules {missing} name no layer of the model; its linear layers are: "
                        f"{', '.join(layers) or 'none'}")


def _attach_lora(base: nn.Module, mode: str, lora: LoraSpec) -> nn.Module:
    from peft import get_peft_model

    from qerl.fused_lora import register_fused_lora, set_fused

    check_target_modules(base, lora.target_modules)
    config = lora.to_config()
    if mode == "qlora_fp4":
        from qerl.quant.lora import register_fp4_lora

        register_fp4_lora(config)
    if mode in ("lora", "qlora_fp4"):  # not qlora_nf4: bitsandbytes layers need peft's own dispatch
        register_fused_lora(config)
    model = get_peft_model(base, config)
    set_fused(model, lora.fused)
    return model


def load_policy(model_path, *, mode: str, dtype: torch.dtype = torch.float32, device="cpu",
                lora: LoraSpec | None = None, train_norms: bool = False, gradient_checkpointing: bool = False,
                empty: bool = False):
    """(model, tokenizer): the base frozen except LoRA (and RMSNorm scales with train_norms), or all of it in
    mode 'full'. The model is returned in train mode. empty (mode full): its tensors on the meta device, the
    weights unread (an FSDP2 rank other than 0 receives its shards from rank 0: qerl.fsdp)."""
    from transformers import AutoTokenizer

    model_path = _check_args(model_path, mode, lora)
    if empty and mode != "full":
        raise QerlError(f"mode {mode}: only mode full loads an empty model (its weights come from rank 0)")
    base = _load_base(model_path, mode, dtype, device, empty)
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    base.requires_grad_(mode == "full")
    if gradient_checkpointing:
        # non-reentrant: works with a frozen embedding and recomputes FP4Linear through its own backward
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = base if mode == "full" else _attach_lora(base, mode, lora)
    if train_norms:
        for weight in _norm_parameters(model):
            weight.requires_grad_(True)
    return model.train(), tokenizer


def trainable_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters the optimizer will update, in model order."""
    return [name for name, p in model.named_parameters() if p.requires_grad]
