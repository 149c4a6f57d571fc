"""humming-kernels' repacked copies of the frozen FP4 base, held for one rollout when memory allows.

    need = humming_copy_bytes(model, groups)           # before the KV pool is sized
    nbytes = attach_humming_copies(model, groups, torch.bfloat16)
    ...rollout...                                        # 17-2048 rows: humming's GEMM (qerl.quant.dispatch)
    detach_humming_copies(model, groups)                 # the update gets the memory back

With QERL_FP4_HUMMING=auto the dispatch only uses a copy that already exists, so the memory they take is decided
here, once per rollout, beside the dense copies (qerl.quant.dense_copies), never inside a forward.
"""
from __future__ import annotations

import torch
from torch import nn

from qerl.quant.dispatch import HUMMING_TABLE_ROWS, fp4_humming_mode
from qerl.quant.kernels import humming_fp4
from qerl.quant.linear import FP4Linear


def _operands(model: nn.Module, groups):
    """(weight_packed, weight_scale, weight_global_scale, segments) of every NVFP4 matmul an inference forward of
    `model` runs, in the shapes humming tiles: each FP4 projection group's stacked weight, and every FP4Linear
    outside a group."""
    grouped = set()
    found = []
    for g in groups:
        if g.kind == "fp4" and g.stacked:
            st = g.stacked
            segs = tuple(g.sizes) if st["weight_global_scale"].numel() > 1 else (st["weight_packed"].shape[0],)
            grouped.update(id(base) for base in g.bases)
            found.append((st["weight_packed"], st["weight_scale"], st["weight_global_scale"], segs))
    found += [(m.weight_packed, m.weight_scale, m.weight_global_scale, (m.weight_packed.shape[0],))
              for m in model.modules()
              if isinstance(m, FP4Linear) and m.fmt == "nvfp4" and id(m) not in grouped]
    return [op for op in found if humming_fp4.fits(op[0])]


def humming_copy_bytes(model: nn.Module, groups=()) -> int:
    """About the bytes attach_humming_copies would allocate: the packed codes and scales once more, plus per
    channel scales (copies already held count nothing)."""
    return sum(wp.numel() * wp.element_size() + ws.numel() * ws.element_size() + 2 * wp.shape[0]
               for wp, ws, _, _ in _operands(model, groups) if not humming_fp4.has_copy(wp))


def attach_humming_copies(model: nn.Module, groups=(), dtype: torch.dtype = torch.bfloat16,
                          background: bool = False) -> int:
    """Give every NVFP4 matmul of `model` (`groups`: its projection groups) its repacked copy for activations in
    `dtype`; returns the bytes the copies hold. Idempotent. Their kernels are compiled here for the row counts the
    dispatcher sends to humming (QERL_FP4_HUMMING=1: any); with `background` (QERL_FP4_HUMMING=auto only) a first
    compile runs on a background thread instead (build_copies)."""
    ops = [op for op in _operands(model, groups) if op[0].is_cuda]
    rows = None if fp4_humming_mode() == "1" else HUMMING_TABLE_ROWS
    background = background and fp4_humming_mode() == "auto"
    return sum(hw.nbytes() for hw in build_copies(ops, dtype, rows, background))


def build_copies(ops, dtype: torch.dtype, rows, background: bool = False) -> list:
    """humming_fp4.humming_weight of each (weight_packed, weight_scale, weight_global_scale, segments), in order,
    repacked here. Kernels this process has not compiled yet compile on another thread, one worker per distinct
    layer config, so humming's nvcc runs for all shapes at once (a 7B: 4 shapes x 6 kernels, ~27 s one shape after
    another on a cold cache; humming_fp4.compile_in_background); the caller waits for them, or with `background`
    goes on: a first rollout's prefill and the torch.compile of its decode step run meanwhile (a cold 7B: ~12 s of
    nvcc beside ~24 s of torch.compile)."""
    made = [humming_fp4.humming_weight(*op, dtype, rows, defer=True) for op in ops]
    fresh = [c for c in made if c.tuning is None and c.ready is None]
    for c in fresh:
        if c.compiled_before():  # a memo lookup: no thread, so later rollouts never skip a copy
            c.tuning = c.prepare()
    humming_fp4.compile_in_background([c for c in fresh if c.tuning is None])
    if not background:
        humming_fp4.wait_pending()
    return made


def detach_humming_copies(model: nn.Module, groups=()) -> None:
    """Drop the copies of `model`'s matmuls (other models' copies stay), after any compile still running for them."""
    humming_fp4.wait_pending()
    for wp, _, _, _ in _operands(model, groups):
        humming_fp4.drop(wp)
