"""peft LoRA on FP4Linear, through peft's custom-module dispatch (`LoraConfig._register_custom_module`).

    from qerl.quant.lora import fp4_lora_config
    model = get_peft_model(fp4_model, fp4_lora_config(r=32, lora_alpha=64, target_modules=["q_proj", ...]))

peft knows nothing about packed weights, so every LoraConfig used with an FP4 model must carry the mapping
FP4Linear -> FP4LoraLinear. The adapter weights and adapter_config.json that `save_pretrained` writes are the
standard ones (the mapping is not serialized), so the adapter loads onto a bf16 model of the same architecture
with plain peft; `load_fp4_adapter` puts the mapping back when loading onto an FP4 model.
"""
from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from qerl.fused_lora import fused_training_adapter, lora_dropout_active, lora_forward
from qerl.quant.dispatch import fp4_lora_matmul
from qerl.quant.linear import FP4Linear


class FP4LoraLinear(nn.Module, LoraLayer):
    """y = FP4Linear(x) + B(A(dropout(x))) * scaling; the packed base is never merged in place. Training runs
    through qerl.fused_lora (one autograd node) unless `use_fused` is False (qerl.fused_lora.set_fused)."""

    use_fused = True

    def __init__(self, base_layer: FP4Linear, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        if config.use_dora:
            raise ValueError("FP4LoraLinear does not support DoRA (use_dora=False)")
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        return None  # vanilla LoRA only

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features  # peft's generic lookup warns on unknown layer types

    def _get_base_layer_device_and_dtype(self, base_layer):
        """Adapters live on the packed weight's device, in the layer's compute dtype (not uint8)."""
        return base_layer.weight_packed.device, base_layer.compute_dtype

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """B @ A * scaling (out, in): what merging adds to the dequantized base weight."""
        a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return (b @ a) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError("a packed FP4 weight cannot absorb a LoRA delta in place; use "
                                  "qerl.merging.merge_adapter to write a merged dense checkpoint")

    def _fused_adapter(self, x: torch.Tensor) -> str | None:
        """The one active adapter whose update can go into the FP4 kernel's epilogue: no autograd wanted (rollout,
        evaluation), dropout inactive, adapter weights already in x's dtype (TorchEngine's bf16 copies)."""
        if (torch.is_grad_enabled() or self.disable_adapters or len(self.active_adapters) != 1
                or self.base_layer.fmt != "nvfp4"):
            return None
        name = self.active_adapters[0]
        if name not in self.lora_A.keys():
            return None
        if lora_dropout_active(self, name):
            return None
        if self.lora_A[name].weight.dtype != x.dtype or self.lora_B[name].weight.dtype != x.dtype:
            return None
        return name

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        grouped = getattr(self, "_qerl_group", None)  # set by qerl.quant.grouped.ProjectionGroup
        if grouped is not None:
            out = grouped[0].member_forward(grouped[1], x)
            if out is not None:
                return out
        name = None if self.base_layer.dense_copy_for(x) is not None else self._fused_adapter(x)
        if name is not None:  # else many rows over a rollout's dense copy: cuBLAS below beats the FP4 epilogue
            base = self.base_layer
            return fp4_lora_matmul(x, base.weight_packed, base.weight_scale, base.weight_global_scale, base.bias,
                                   self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name])
        name = fused_training_adapter(self, x)
        if name is not None:
            return lora_forward(self, x, name)
        result = self.base_layer(x)
        if self.disable_adapters:
            return result
        out_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A.keys():
                continue
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            xa = self._cast_input_dtype(x, lora_a.weight.dtype)
            result = result + lora_b(lora_a(self.lora_dropout[name](xa))) * self.scaling[name]
        return result.to(out_dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_fp4_lora(config: LoraConfig) -> LoraConfig:
    """Teach this LoraConfig to wrap FP4Linear modules (in place; returns it for chaining)."""
    config._register_custom_module({FP4Linear: FP4LoraLinear})
    return config


def fp4_lora_config(**kwargs) -> LoraConfig:
    """A LoraConfig(**kwargs) that also targets FP4Linear modules."""
    return register_fp4_lora(LoraConfig(**kwargs))


def load_fp4_adapter(model: nn.Module, adapter_dir: str | Path, is_trainable: bool = False,
                     adapter_name: str = "default"):
    """PeftModel.from_pretrained for a model with FP4Linear modules (re-registers the custom dispatch)."""
    from peft import PeftModel

    config = register_fp4_lora(LoraConfig.from_pretrained(str(adapter_dir)))
    config.inference_mode = not is_trainable
    return PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=adapter_name, is_trainable=is_trainable,
                                     config=config)
