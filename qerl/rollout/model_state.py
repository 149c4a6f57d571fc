"""What every torch rollout engine (TorchEngine, PagedEngine) reads from the model it rolls out on, and the state it
holds the model in during a call.

    with inference_mode(model):                     # eval(), no autograd, gradient-checkpointing hooks lifted
        ...
    key = (model_signature(model), ...)             # a captured or compiled decode step is valid while this holds
"""
from __future__ import annotations

import contextlib

import torch

from qerl.errors import QerlError


def compute_dtype(model) -> torch.dtype:
    """The dtype the model computes in (and so K/V are in): its input embeddings' (FP4 layers hold uint8, adapters
    may be fp32)."""
    try:
        return model.get_input_embeddings().weight.dtype
    except (AttributeError, NotImplementedError):
        return next(p.dtype for p in model.parameters() if p.is_floating_point())


def eos_ids(model, tokenizer) -> set[int]:
    """EOS set = generation_config.eos_token_id (int or list) plus the tokenizer's eos token."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise QerlError("rollout: neither generation_config.eos_token_id nor tokenizer.eos_token_id is set")
    return ids


def pad_id(model, tokenizer, eos: set[int] | list[int]) -> int:
    """Any valid id works (padding is masked); prefer the declared pad token, as generate does."""
    for pad in (getattr(tokenizer, "pad_token_id", None),
                getattr(getattr(model, "generation_config", None), "pad_token_id", None), *eos, 0):
        if isinstance(pad, int):
            return pad
    return 0


def model_signature(model) -> tuple:
    """What a captured step depends on beyond tensor contents: parameter storage and peft adapter switches."""
    ptrs = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    switches = tuple((bool(getattr(m, "disable_adapters", False)), bool(getattr(m, "merged", False)),
                      tuple(getattr(m, "active_adapters", ())))
                     for m in model.modules() if hasattr(m, "active_adapters") and hasattr(m, "lora_A"))
    return hash(ptrs), hash(switches), model.training


def compile_options(device: torch.device) -> dict:
    """Inductor options of the decode forward: its Triton kernels with programmatic dependent launch on Hopper+
    (each starts while the previous kernel finishes and waits for it before reading its output; QERL_PDL=0 turns
    it off, as for qerl.quant's FP4 kernels) where this torch's inductor has the option."""
    from torch._inductor import config as inductor_config

    from qerl.quant.dispatch import pdl_mode

    if (device.type == "cuda" and pdl_mode() != "0" and hasattr(inductor_config.triton, "enable_pdl")
            and torch.cuda.get_device_capability(device)[0] >= 9):
        return {"triton.enable_pdl": True}
    return {}


_INPUT_GRAD_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")  # transformers', peft's


@contextlib.contextmanager
def inference_mode(model):
    """eval() for the call (no dropout, no gradient checkpointing), each module's own mode restored after; the
    input-embedding hooks that gradient checkpointing with adapters installs (transformers'
    `enable_input_require_grads`, peft's fallback: `output.requires_grad_(True)`) are lifted meanwhile: useless
    without autograd, and torch.compile (2.11, the GPU image's) cannot trace them: the graph break, inside a
    transformers context manager, left the model forward uncompiled and each layer compiled on its own, past
    dynamo's recompile limit (8) the later layers not at all (BENCHMARKS.md, "(b) Rollout", engine choices)."""
    modes = [(m, m.training) for m in model.modules()]
    lifted = []
    for m in model.modules():
        hooks = [(k, h) for k, h in m._forward_hooks.items() if getattr(h, "__name__", "") in _INPUT_GRAD_HOOKS]
        for k, _ in hooks:
            del m._forward_hooks[k]
        if hooks:
            lifted.append((m, hooks))
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        for m, training in modes:
            m.training = training
        for m, hooks in lifted:  # back in registration order (handle ids increase)
            merged = sorted([*m._forward_hooks.items(), *hooks], key=lambda item: item[0])
            m._forward_hooks.clear()
            m._forward_hooks.update(merged)
