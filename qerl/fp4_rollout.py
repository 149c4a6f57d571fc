"""An NVFP4 copy of a sharded model's current weights, for its rollouts (train.rollout.weights nvfp4; qerl.fsdp).

    copy = FP4RolloutCopy(model, device)   # from the plain model, before fully_shard: packed buffers allocated once
    copy.bind_buffers(model)               # once sharded: the model's buffers (rotary frequencies) shared
    copy.gather(model)                     # before each rollout, on every rank (collectives): quantized in place
    copy.module                            # what the engine rolls out on; release() frees nothing

train.mode full on several ranks rolls out, by default, on qerl.fsdp.GatheredPolicy: the whole model in bf16 on
every rank for each rollout (61 GiB at 32B). QeRL's rollouts run on 4-bit weights, which cost a quarter of that.
This copy holds every Linear of the decoder layers (q/k/v/o/gate/up/down: what the quantize stage quantizes, its
llmcompressor recipe targets Linear and ignores lm_head) as a qerl.quant.linear.FP4Linear, and the embeddings,
norms, lm_head and biases in the model's dtype: at 32B 16.3 GiB of packed weights and FP8 scales (4.5 bits a
weight) + 2.9 GiB of embeddings and lm_head.
  refresh      gather() takes one fused group of a layer at a time (q/k/v, then o, gate/up, down) from the shards
               (an all-gather per tensor), quantizes it and drops the gathered tensors: one group in the model's
               dtype (at 32B gate/up, 0.5 GiB) and a quantization chunk are the transient, never a whole model.
  numerics     qerl.quant.format.quantize_nvfp4 (round to nearest, bit-exact with compressed-tensors), with one
               global scale per fused group as llmcompressor's NVFP4 gives q/k/v and gate/up (its
               FUSED_LAYER_NAMES), so the rollout sees what a quantize stage run on these weights would write.
  addresses    the packed buffers, scales and dense parameters are allocated once and overwritten in place, so
               the engines' captured graphs and compiled steps (keyed on data_ptr: qerl.rollout.model_state) stay
               valid across steps, as qerl.rollout.lora_shadows keeps LoRA copies; nothing is freed for the update
               (qerl.memory counts the copy beside it).
The rollout policy is then the 4-bit one, not the trained bf16 one: its log-probs differ from the trainer's, which
train.rollout_correction tis corrects (truncated importance sampling); the config requires it with nvfp4.
"""
from __future__ import annotations


import torch
from torch import nn

from qerl.errors import QerlError
from qerl.plain_copy import full_tensor, meta_copy, share_buffers
from qerl.quant.format import NVFP4_GROUP, nvfp4_global_scale, quantize_nvfp4
from qerl.quant.linear import FP4Linear

# projections of one decoder layer sharing a global scale (llmcompressor's FUSED_LAYER_NAMES for Qwen2/Llama)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
CHUNK_ELEMENTS = 1 << 24  # weights quantized at once: bounds quantize_nvfp4's float32 intermediates (~64 MiB each)


def fused_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One NVFP4 global scale (1,) for weights that share it: nvfp4_global_scale of their joint absmax."""
    return nvfp4_global_scale(torch.stack([w.detach().abs().amax() for w in weights]))


@torch.no_grad()
def quantize_into(layer: FP4Linear, w: torch.Tensor, global_scale: torch.Tensor) -> None:
    """Overwrite layer's packed weight and scales in place with quantize_nvfp4(w, global_scale), a chunk of rows at
    a time (each row's groups are independent: the same bytes as one call)."""
    rows = max(1, CHUNK_ELEMENTS // w.shape[1])
    for start in range(0, w.shape[0], rows):
        packed, scale, _ = quantize_nvfp4(w[start:start + rows], global_scale)
        layer.weight_packed[start:start + rows].copy_(packed)
        layer.weight_scale[start:start + rows].copy_(scale)
    layer.weight_global_scale.copy_(global_scale.reshape(1))


def _groups(layer: nn.Module, prefix: str) -> list[list[str]]:
    """The names (under prefix) of a decoder layer's Linears, in fused groups; a Linear in no group is its own."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    groups = []
    for fused in FUSED:
        found = [n for n in linears if n.rsplit(".", 1)[-1] in fused]
        if len(found) == len(fused):  # the whole group in one module (self_attn / mlp)
            groups.append(found)
    grouped = {n for g in groups for n in g}
    groups += [[n] for n in linears if n not in grouped]
    return [[f"{prefix}{n}" for n in g] for g in sorted(groups, key=lambda g: list(linears).index(g[0]))]


class FP4RolloutCopy:
    """A hook-free copy of a model for the rollout engine: decoder-layer Linears as FP4Linear, everything else in
    the model's dtype, all allocated here once and refreshed in place by gather() (see the module docstring)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.module = meta_copy(model)
        sources = dict(model.named_parameters())
        names = {id(m): n for n, m in self.module.named_modules()}
        self.groups: list[list[str]] = []  # fused groups of FP4Linear names, layer by layer
        self.linears: dict[str, FP4Linear] = {}
        # the decoder layers as qerl.fsdp.decoder_layers finds them (which imports this module)
        for layer in [m for m in self.module.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]:
            for group in _groups(layer, names[id(layer)] + "."):
                self.groups.append(group)
                for name in group:
                    self.linears[name] = self._fp4_linear(name, sources, device)
        self.dense = self._allocate_the_rest(sources, device)

    def _fp4_linear(self, name: str, sources: dict, device: torch.device) -> FP4Linear:
        """An FP4Linear in place of the Linear `name` of the copy (zeros until gather())."""
        owner, _, key = name.rpartition(".")
        linear = self.module.get_submodule(name)
        if linear.in_features % NVFP4_GROUP:
            raise QerlError(f"rollout.weights nvfp4: {name} has in_features {linear.in_features}, not a multiple "
                            f"of {NVFP4_GROUP} (NVFP4 scales each group of {NVFP4_GROUP} inputs together)")
        fp4 = FP4Linear(linear.in_features, linear.out_features, linear.bias is not None,
                        compute_dtype=sources[f"{name}.weight"].dtype, device=device)
        fp4.requires_grad_(False)
        setattr(self.module.get_submodule(owner), key, fp4)
        return fp4

    def _allocate_the_rest(self, sources: dict, device: torch.device) -> dict[str, nn.Parameter]:
        """Storage for every parameter left on the meta device (embeddings, norms, lm_head; tied ones stay one),
        in the source's dtype; returns every dense parameter (these and the FP4Linears' biases) by name."""
        made: dict[int, nn.Parameter] = {}
        for module in self.module.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(torch.empty(0), requires_grad=False)
                    module._parameters[key] = made[id(p)]
        dense = {}
        for name, p in self.module.named_parameters():
            if name not in sources:
                raise QerlError(f"FP4RolloutCopy: {name} of the plain {type(self.module).__name__} is not in the "
                                "model")
            if p.numel() == 0 and sources[name].numel():
                p.data = torch.empty(sources[name].shape, dtype=sources[name].dtype, device=device)
            dense[name] = p
        return dense

    def bind_buffers(self, model: nn.Module) -> None:
        """Share the model's buffers (rotary frequencies; FSDP leaves buffers whole), once it sits on its device."""
        share_buffers(self.module, model)

    @torch.no_grad()
    def gather(self, model: nn.Module) -> None:
        """The current weights into the copy, in place: dense parameters whole, each fused group of Linears
        gathered, quantized with one global scale and dropped (collectives in one order on every rank)."""
        sources = dict(model.named_parameters())
        for name, p in self.dense.items():
            p.copy_(full_tensor(sources[name]))
        for group in self.groups:
            weights = [full_tensor(sources[f"{name}.weight"]) for name in group]
            scale = fused_global_scale(weights)
            for name, w in zip(group, weights):
                quantize_into(self.linears[name], w, scale)
            del weights

    def release(self) -> None:
        """Nothing: the copy keeps its storage (and addresses) through the update."""
