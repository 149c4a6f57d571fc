"""Scratch buffers the kernels keep between launches: split-K partials and the arrival counters of "the last program
to arrive finishes the tile" (the Triton FP4 kernels, the CUDA few-row kernel's x @ A.T, the paged attention merge).

    part = scratch("triton_fp4.part", device, numel, torch.float32)             # contents undefined
    cnt = scratch("triton_fp4.arrivals", device, tiles, torch.int32, zeroed=True)  # zeros, left at 0 by every launch

One buffer per (name, device, stream): launches on one stream run in order and can share it; a launch on another
stream (LoRA's side stream) gets its own. A buffer only grows, at least doubling; an outgrown one is kept for the
process, because a CUDA graph captured before still addresses it (freed, its memory could go to a tensor that every
replay would then overwrite, or leave counters that are not 0), and doubling bounds what is kept to the current
buffer's size. Warm a shape up before a capture, so that no buffer is allocated inside it.
"""
from __future__ import annotations

import torch

_HELD: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def _stream_key(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return (device.index if device.index is not None else torch.cuda.current_device(),
                torch.cuda.current_stream(device).cuda_stream)
    return -1, 0  # Triton's CPU interpreter (TRITON_INTERPRET=1): one host "stream"


def scratch(name: str, device: torch.device, numel: int, dtype: torch.dtype, zeroed: bool = False,
            minimum: int = 1 << 14) -> torch.Tensor:
    """At least `numel` elements of `dtype` (a 1-D buffer, longer as it may be) for kernel scratch `name` on the
    current stream of `device`; zeroed: allocated as zeros (counters that every launch leaves at zero)."""
    key = (name, device.type, *_stream_key(device))
    held = _HELD.get(key)
    if held is None or held.numel() < numel or held.dtype != dtype:
        size = max(numel, minimum, 2 * held.numel() if held is not None and held.dtype == dtype else 0)
        if held is not None:
            _RETIRED.append(held)
        held = _HELD[key] = (torch.zeros if zeroed else torch.empty)(size, dtype=dtype, device=device)
    return held


def held(name: str, device: torch.device) -> torch.Tensor | None:
    """The buffer `scratch` hands out now for `name` on the current stream of `device` (tests read counters)."""
    return _HELD.get((name, device.type, *_stream_key(device)))


def retired_bytes() -> int:
    """Bytes of outgrown buffers kept for graphs captured before they were outgrown."""
    return sum(t.numel() * t.element_size() for t in _RETIRED)
