"""Dense copies of the frozen FP4 base for a policy update, where the memory is there (train.dense_weights).

    with update_copies(model, cfg.dense_weights, reserve) as made:   # the trainer, around each update
        metrics = trainer._update(batch, step)

An update's GEMMs are compute-bound and Hopper has no FP4 tensor cores: over the packed weight every forward,
checkpoint recompute and grad_input pass dequantizes W again (chunked Triton dequantize + cuBLAS,
qerl.quant.kernels.triton_dequant), and the chunked dispatch's host work starves the GPU between micro-batches
(BENCHMARKS.md: FP4 update x0.89-0.96 of bf16 LoRA's). A dequantized copy per layer, made once per update (a 7B's
12.2 GiB written once instead of on every pass), gives the same bf16 GEMMs on the same values: FP4Linear reads it in
training forwards (qerl.quant.linear.DenseCopyFunction, qerl.fused_lora's base ops) and it is dropped when the update
ends, so the rollout's pool gets the memory back. Where the copies would not fit, nothing changes: the packed path runs.

"auto" makes them on a GPU when the copies plus what the update needs (its measured growth scaled to the longest
rows, qerl.rollout.residency.update_reserve; unknown before the first update, which runs on the packed weights)
fit in the free memory, and on the CPU under the host rule of the rollout's copies (qerl.quant.dense_copies); true
always makes them; false never. Copies the rollout engine kept through the update (a resident pool of 129+ rows)
are used as they are.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from qerl.quant import dense_copies as dc
from qerl.quant.linear import DENSE_COPY_ATTR, FP4Linear
from qerl.rollout.model_state import compute_dtype


def copies_fit(need: int, device: torch.device, reserve: int | None) -> bool:
    """"auto"'s rule: on the CPU the host rule; on a GPU, copies of `need` bytes plus the update's `reserve` fit in
    the free memory (never before the first update has measured its reserve)."""
    if not need:
        return False
    if device.type == "cpu":
        return dc.host_room(need)[1]
    if device.type != "cuda" or reserve is None:
        return False
    from qerl.rollout.kv_pool import free_device_memory

    return need + reserve <= free_device_memory(device)


@contextlib.contextmanager
def update_copies(model: nn.Module, mode, reserve: int | None):
    """Dense copies, in the dtype the model computes in, of every NVFP4 FP4Linear of `model` for the block, under
    `mode` ("auto", True or False, see the module doc); yields the bytes made (0: none made, the copies a rollout
    engine kept included)."""
    made = 0
    layers = [m for m in model.modules() if isinstance(m, FP4Linear)]
    kept = any(DENSE_COPY_ATTR in m.__dict__ for m in layers)  # the engine's, kept through the update
    if mode is not False and layers and not kept:
        dtype = compute_dtype(model)
        need = dc.dense_copy_bytes(model, dtype)
        if need and (mode is True or copies_fit(need, layers[0].weight_packed.device, reserve)):
            made = dc.attach_dense_copies(model, (), dtype)
    try:
        yield made
    finally:
        if made:
            dc.detach_dense_copies(model)
