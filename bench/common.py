"""What several benchmarks share: the device sync around timed parts and the RL workload's command-line options."""
from __future__ import annotations

import argparse

import torch


def sync(device: str | None = None) -> None:
    """Wait for the GPU (no-op on CPU, or when device names another kind)."""
    if (device is None or str(device).startswith("cuda")) and torch.cuda.is_available():
        torch.cuda.synchronize()


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
