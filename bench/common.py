"""What several benchmarks share: the device sync around timed parts, where code waits for the GPU, and the RL
workload's command-line options."""
from __future__ import annotations

import argparse
import collections
import contextlib
import traceback
import warnings

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message


def sync(device: str | None = None) -> None:
    """Wait for the GPU (no-op on CPU, or when device names another kind)."""
    if (device is None or str(device).startswith("cuda")) and torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def sync_sites(markers: tuple[str, ...] = ("/qerl/", "/bench/", "/transformers/", "/peft/", "/torch/utils/")):
    """Count the host-device synchronisations inside the block by call site: CUDA's sync debug mode reports each
    (an .item(), a nonzero, a copy to the host), and the site is the innermost three frames whose file path holds
    one of `markers`. Yields the Counter; without CUDA nothing reports (only warnings raised by hand count)."""
    counts: collections.Counter = collections.Counter()
    previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if SYNC_WARNING not in str(message):
                return shown(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if any(m in f.filename for m in markers)][-3:]
            counts[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))] += 1

        warnings.showwarning = record
        if previous is not None:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if previous is not None:
                torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = shown


def ints(text: str) -> list[int]:
    """A comma list of ints ("8,64"; empty items skipped)."""
    return [int(x) for x in text.split(",") if x]


def add_workload_args(p: argparse.ArgumentParser, *, prompt_len: int, micro_batch: int, lengths: bool = True,
                      lora_help: str = "LoRA rank (alpha = 2 r)") -> None:
    """The GRPO workload: completions per prompt, prompt length, the log-normal completion lengths, rows per
    forward/backward and the LoRA rank."""
    # not --n: torchrun reads an option abbreviating its own (--nnodes, --nproc-per-node) anywhere on its line
    p.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    if lengths:
        p.add_argument("--median", type=float, default=400.0, help="median completion length of the log-normal")
        p.add_argument("--sigma", type=float, default=0.6, help="sigma of log(length)")
    p.add_argument("--micro-batch", type=int, default=micro_batch, help="rows per forward/backward")
    p.add_argument("--lora-r", type=int, default=32, help=lora_help)
