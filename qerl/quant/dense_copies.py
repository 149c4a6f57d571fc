"""Dequantized copies of the frozen FP4 base weights, held for one rollout when memory allows.

    nbytes = attach_dense_copies(model, groups, torch.bfloat16)   # before the KV pool is sized
    ...rollout...                                                 # >= DENSE_COPY_MIN_ROWS rows: cuBLAS on the copy
    detach_dense_copies(model, groups)                            # the update gets the memory back

At hundreds of rows a bf16 GEMM over a dense copy beats every FP4 kernel of qerl.quant.dispatch (BENCHMARKS.md
(a): FP4 0.47-0.63x bf16 per 7B layer at 256-512 rows, where the dense path dequantizes the whole weight on every
call), while below qerl.quant.linear.DENSE_COPY_MIN_ROWS the FP4 kernels read 4x fewer bytes and win. So a continuous-batching
rollout with many rows keeps one dequantized copy per layer for its duration (the same values the dense path
computes on each call: results are unchanged) and gives it back before the update; training forwards (autograd
on) never use it. Grouped projections (qerl.quant.grouped) get one stacked copy; members hold views of it.

On the CPU there is no FP4 kernel: every call dequantizes its whole weight (qerl.quant.reference), about half of
the demo's rollout. So CPU rollouts and evaluations keep copies at any row count (`cpu_copies_fit`: when they take
at most a quarter of the available host memory); the GEMM on a copy is the reference's own GEMM on the same values.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from qerl.quant.linear import DENSE_COPY_ATTR as _ATTR
from qerl.quant.linear import FP4Linear


def dense_copy_bytes(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the dense copies of every NVFP4 FP4Linear of `model` take in `dtype`."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(m.in_features * m.out_features * size for m in model.modules()
               if isinstance(m, FP4Linear) and m.fmt == "nvfp4")


def attach_dense_copies(model: nn.Module, groups, dtype: torch.dtype) -> int:
    """Give every NVFP4 FP4Linear of `model` a dense copy in `dtype` (grouped members: views of their group's
    stacked copy, `group.dense`); returns the bytes allocated. Idempotent."""
    detach_dense_copies(model, groups)
    total = 0
    with torch.no_grad():
        for group in groups:
            if group.kind != "fp4":
                continue
            parts = [base.dequantize_weight(dtype) for base in group.bases]
            group.dense = parts[0] if len(parts) == 1 else torch.cat(parts)
            del parts
            start = 0
            for base, size in zip(group.bases, group.sizes):
                base.__dict__[_ATTR] = group.dense[start:start + size]
                base.__dict__["_dense_copy_key"] = _weight_key(base)
                start += size
            total += group.dense.numel() * group.dense.element_size()
        for module in model.modules():
            if isinstance(module, FP4Linear) and module.fmt == "nvfp4" and _ATTR not in module.__dict__:
                module.__dict__[_ATTR] = module.dequantize_weight(dtype)
                module.__dict__["_dense_copy_key"] = _weight_key(module)
                total += module.__dict__[_ATTR].numel() * module.__dict__[_ATTR].element_size()
    return total


def _weight_key(module: FP4Linear) -> tuple:
    """Identity and in-place version of a layer's packed tensors: changes whenever they are rewritten (tensors made
    under torch.inference_mode keep no version: their address only)."""
    return tuple((t.data_ptr(), -1 if t.is_inference() else t._version)
                 for t in (module.weight_packed, module.weight_scale, module.weight_global_scale) if t is not None)


def refresh_stale_copies(model: nn.Module) -> int:
    """Before a rollout: re-dequantize, in place (captured graphs keep the address), every dense copy whose packed
    weight was rewritten since (a full-parameter run's NVFP4 rollout copy, qerl.fp4_rollout, changes every step;
    a LoRA run's frozen base never does), and humming's repacked copies likewise; returns the dense copies redone."""
    from qerl.quant.kernels import humming_fp4

    humming_fp4.refresh_stale()
    redone = 0
    with torch.no_grad():
        for module in model.modules():
            copy = module.__dict__.get(_ATTR) if isinstance(module, FP4Linear) else None
            if copy is not None and module.__dict__.get("_dense_copy_key") != _weight_key(module):
                copy.copy_(module.dequantize_weight(copy.dtype))
                module.__dict__["_dense_copy_key"] = _weight_key(module)
                redone += 1
    return redone


def detach_dense_copies(model: nn.Module, groups=()) -> None:
    """Drop every dense copy (the memory goes back to the allocator)."""
    for group in groups:
        group.dense = None
    for module in model.modules():
        module.__dict__.pop(_ATTR, None)
        module.__dict__.pop("_dense_copy_key", None)


_HOST_FRACTION = 0.25  # of the available host memory a CPU rollout's dense copies may take


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else free pages x page size where the OS says, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_room(need: int) -> tuple[int, bool]:
    """(available host bytes, whether copies of `need` bytes fit the host memory rule)."""
    free = available_host_bytes() if need else None
    return free or 0, bool(need) and free is not None and need <= _HOST_FRACTION * free


def cpu_copies_fit(model: nn.Module, dtype: torch.dtype) -> bool:
    """A CPU model has NVFP4 weights whose dense copies in `dtype` fit the host memory rule."""
    return host_room(dense_copy_bytes(model, dtype))[1]


@contextlib.contextmanager
def cpu_dense_copies(model: nn.Module, groups, dtype: torch.dtype):
    """Dense copies of a CPU model's NVFP4 weights for the duration of one generate call, when they fit; yields
    whether they were made."""
    made = next(model.parameters()).device.type == "cpu" and cpu_copies_fit(model, dtype)
    if made:
        attach_dense_copies(model, groups, dtype)
    try:
        yield made
    finally:
        if made:
            detach_dense_copies(model, groups)
