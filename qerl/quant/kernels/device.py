"""What the kernels ask of the GPU and the environment when they launch: compute capability, and QERL_PDL
(programmatic dependent launch). Which kernel runs is decided above, in qerl.quant.dispatch.choose_kernel.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch


def auto_on_off(name: str, environ=None) -> str:
    """The environment variable `name` as "auto" (unset), "0" or "1"; anything else is a ValueError naming it."""
    value = (os.environ if environ is None else environ).get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{name}: expected auto, 0 or 1, got {value!r}")
    return value


def pdl_mode() -> str:
    """QERL_PDL: "auto" (default: programmatic dependent launch on sm_90+ while a CUDA graph is being captured, the
    decode step's case, and in that step's eager warm-up: decode_step_launches), "1" (on sm_90+ for every launch),
    "0" (off). With it a launch starts loading its weights while the previous kernel finishes: the FP4 base must
    not be written by the kernel just before the matmul (it never is in a decode step; "1" puts every eager launch
    under the same rule)."""
    return auto_on_off("QERL_PDL")


_DECODE_STEP = contextvars.ContextVar("qerl_decode_step_launches", default=False)


@contextlib.contextmanager
def decode_step_launches():
    """The eager run of a decode step that is captured next (its warm-up): launches as in the captured graph, with
    PDL under "auto", so that they compile the kernels the capture replays (launch_pdl is a Triton compile option:
    otherwise each kernel compiled once for the warm-up and once more for the capture). The same step, the same
    kernel order: what makes PDL safe in the graph makes it safe here."""
    token = _DECODE_STEP.set(True)
    try:
        yield
    finally:
        _DECODE_STEP.reset(token)


def in_decode_step() -> bool:
    """Inside a decode step's warm-up (decode_step_launches) or a CUDA-graph capture: launches that a captured
    graph keeps."""
    return _DECODE_STEP.get() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def use_pdl(device_index: int) -> bool:
    how = pdl_mode()
    if how == "0" or not hopper(device_index):
        return False
    return how == "1" or torch.cuda.is_current_stream_capturing() or _DECODE_STEP.get()


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def hopper(index: int) -> bool:
    """sm_90+: thread-block clusters, griddepcontrol (programmatic dependent launch)."""
    return capability(index)[0] >= 9
