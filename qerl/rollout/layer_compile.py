"""torch.compile of the decoder layers one by one (regional compilation) for the rollout's captured decode steps.

    layers = LayerCompile(model, options=compile_options(device))
    with layers.active():          # each decoder layer (and the final norm) runs its compiled call
        logits = decode_forward(model, ids, positions, meta)

Every decoder layer runs the same code, so dynamo compiles it once and the other layers reuse that code (their
weights are graph inputs): a 28-layer 7B compiles like a 1-layer model, where one whole-model graph took minutes.
Inside a layer inductor fuses what eager runs as separate kernels (RMSNorm's seven, rotary, residual adds,
SiLU(gate) * up, LoRA's scaling and add). The paged attention call stays eager between the compiled pieces
(qerl.rollout.paged_attention disables dynamo there): its kernels are custom ops anyway, and tracing it would bake
each layer's index into the code (28 recompiles). Only the engine's eager warm-up and capture steps run Python;
replays of the captured graphs run the compiled kernels without it. Nothing is changed outside `active()`: the
training forward never sees the compiled calls. Meanwhile the training-only forward swaps (qerl.fused_elementwise,
qerl.tiled_mlp: per-instance objects that dynamo would guard on one by one) step aside.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from qerl.forward_swap import class_forwards

BACKEND = "inductor"  # tests on CPU use "aot_eager" (no C++ toolchain needed)
_RECOMPILE_LIMIT = 64  # the layers, the final norm and their resume frames share nn.Module._call_impl's cache


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers (the ModuleList of config.num_hidden_layers modules of one class) and the final norm."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    count = getattr(cfg, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and count and \
                len({type(m) for m in module}) == 1:
            owner = next((m for m in model.modules() if any(c is module for c in m.children())), None)
            norm = getattr(owner, "norm", None)
            return [*module, *([norm] if isinstance(norm, nn.Module) else [])]
    return []


class LayerCompile:
    """The compiled calls of a model's decoder layers, made once and switched on around a forward."""

    def __init__(self, model: nn.Module, options: dict | None = None, backend: str | None = None):
        self.layers = decoder_layers(model)
        backend = backend or BACKEND
        kw = {"options": options} if options and backend == "inductor" else {}
        self.calls = [torch.compile(layer._call_impl, dynamic=True, backend=backend, **kw) for layer in self.layers]

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def active(self):
        limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        for layer, call in zip(self.layers, self.calls):
            layer._compiled_call_impl = call
        try:
            with torch._dynamo.config.patch(**{limit: max(_RECOMPILE_LIMIT, getattr(torch._dynamo.config, limit))}), \
                    class_forwards([m for layer in self.layers for m in layer.modules()]):
                yield
        finally:
            for layer in self.layers:
                layer._compiled_call_impl = None
