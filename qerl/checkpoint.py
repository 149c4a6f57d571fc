"""Training checkpoints: everything needed to continue a run bit-exactly after a kill -9.

A checkpoint is a directory `step-000010/` holding the trainable tensors (LoRA, and norms or all weights when
trained), optimizer and scheduler state, torch RNG state and the trainer state (step, log history). It is
written to a temporary sibling and renamed, so a kill during the save leaves the previous checkpoint intact.
Rollout seeds, AQN noise and data order derive from (seed, step), so no other state is needed.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from qerl.io import atomic_dir

_STEP_DIR = re.compile(r"^step-(\d+)$")


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(root: str | Path, step: int, model, optimizer, scheduler, state: dict[str, Any],
                    keep: int = 2) -> Path:
    root = Path(root)
    target = root / f"step-{step:06d}"
    with atomic_dir(target) as tmp:
        torch.save(trainable_state(model), tmp / "trainable.pt")
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state()}, tmp / "optim.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def list_checkpoints(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))
             and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> dict[str, Any]:
    """Restore tensors and states in place; return the trainer state (with 'step' = steps completed)."""
    path = Path(path)
    tensors = torch.load(path / "trainable.pt", map_location="cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(params[name].device))
    optim = torch.load(path / "optim.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(optim["optimizer"])
    scheduler.load_state_dict(optim["scheduler"])
    torch.set_rng_state(optim["torch_rng"])
    return json.loads((path / "trainer_state.json").read_text())


TRAINED_NORMS_FILE = "trained_norms.safetensors"


def save_trained_norms(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """RMSNorm scales trained beside LoRA (train_norms), keyed by their name in the plain base model.

    peft's adapter format has no place for them; qerl.merge copies them into the merged checkpoint.
    """
    from safetensors.torch import save_file

    prefix = "base_model.model."
    norms = {n[len(prefix):] if n.startswith(prefix) else n: p.detach().cpu().contiguous()
             for n, p in model.named_parameters() if p.requires_grad and "norm" in n and "lora_" not in n}
    path = Path(out_dir) / TRAINED_NORMS_FILE
    save_file(norms, str(path))
    return path
