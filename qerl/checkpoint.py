"""Training checkpoints: everything needed to continue a run bit-exactly after a kill -9, and only that run.

Layout (one folder per run fingerprint, so a changed config never resumes another config's checkpoint):

    <checkpoint-dir>/<fingerprint[:16]>/fingerprint.json     what the folder belongs to: digests, train config,
                                                              model and data source (for people deciding what to delete)
    <checkpoint-dir>/<fingerprint[:16]>/step-000010/         trainable.pt, optim.pt, trainer_state.json

The fingerprint is a sha256 over three parts, each a sha256 itself:
  config  the train config section as canonical JSON, minus `save_steps` and `logging_steps` (they only say when to
          save and log; a resumed run is bit-exact whatever they were), `num_gpus` and `num_nodes` (a checkpoint
          holds the whole trainable state whatever the rank count, gathered from FSDP2 shards in mode full, so a
          run resumes with another number of ranks);
  data    the records training reads ({id, question, answer} as qerl.data.load_records returns them, after
          `limit`), so a local file, a parquet directory and a hub dataset are all identified by content;
  model   a content sha256 of every file of the model directory except stage reports (quantize.json): weights,
          config.json, tokenizer files. Not only safetensors headers: a re-quantization with another calibration
          set keeps every shape and size and changes the bytes. It reads the model once (about 1 GB/s a core,
          files hashed in parallel), seconds next to a training run, and warms the page cache for the load.

A checkpoint stores the fingerprint in trainer_state.json and is loaded only when it equals the run's; the
fingerprint folders of other configs and checkpoints of the old flat layout (`<checkpoint-dir>/step-N`) are never
resumed, only named in the log. A checkpoint is written to a temporary sibling and renamed (a kill during the save
leaves the previous one intact), never with a non-finite trainable tensor or optimizer state, and is read with
torch.load(weights_only=True): tensors and plain containers only, so a planted file cannot run code.
Rollout seeds, AQN noise and data order derive from (seed, step), so no other state is needed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from qerl.errors import QerlError
from qerl.io import atomic_dir, atomic_write_json

log = logging.getLogger("qerl.train")

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RUN_DIR = re.compile(r"^[0-9a-f]{16}$")
FINGERPRINT_FILE = "fingerprint.json"
# keys of the train section that only say when to save and log, or over how many ranks the same batch is split
# (equal up to float summation order): a checkpoint of one value resumes under another
NON_DETERMINING_KEYS = ("save_steps", "logging_steps", "num_gpus", "num_nodes")
# optimizer options that say how it computes, not what it holds: a resumed run keeps its own
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
# written beside the weights by stages (timings change on every rerun) and never read by the model loader
MODEL_REPORT_FILES = ("quantize.json", "report.json")


# ------------------------------------------------------------------------------------------ fingerprint
def _sha256_json(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def config_digest(train_config: dict[str, Any]) -> str:
    return _sha256_json({k: v for k, v in train_config.items() if k not in NON_DETERMINING_KEYS})


def data_digest(records: Iterable[dict[str, Any]]) -> str:
    return _sha256_json(list(records))


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_digest(model_dir: str | Path) -> str:
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in MODEL_REPORT_FILES
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise QerlError(f"--model: {root} holds no files")
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:  # hashlib releases the GIL on big reads
        digests = list(pool.map(_file_sha256, files))
    return _sha256_json([[p.relative_to(root).as_posix(), d] for p, d in zip(files, digests)])


@dataclass(frozen=True)
class Fingerprint:
    """What determines a checkpoint: digests of the train config, the training data and the model."""

    parts: dict[str, str]
    about: dict[str, Any] = field(default_factory=dict, compare=False)  # for people reading fingerprint.json

    @property
    def digest(self) -> str:
        return _sha256_json(self.parts)

    @property
    def short(self) -> str:
        return self.digest[:16]

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.digest, "parts": self.parts}

    def mismatch(self, stored: Any) -> str | None:
        """Why a stored fingerprint is not this one, or None when it is."""
        if not isinstance(stored, dict) or "fingerprint" not in stored:
            return "it has no fingerprint"
        if stored["fingerprint"] == self.digest:
            return None
        theirs = stored.get("parts") or {}
        changed = [k for k in self.parts if theirs.get(k) != self.parts[k]] or ["fingerprint"]
        return f"its {', '.join(changed)} differ(s) from this run's"


def run_fingerprint(train_config: dict[str, Any], records: list[dict[str, Any]], model_dir: str | Path,
                    about: dict[str, Any] | None = None) -> Fingerprint:
    parts = {"config": config_digest(train_config), "data": data_digest(records), "model": model_digest(model_dir)}
    return Fingerprint(parts, {"train": train_config, "model": str(model_dir), **(about or {})})


# ------------------------------------------------------------------------------------------ files
def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _tensors(obj: Any, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


class NonFiniteState(QerlError):
    """A checkpoint was not written: a trainable tensor or the optimizer state holds inf/nan."""


def first_nonfinite(*named: tuple[str, Any]) -> str | None:
    """Name of the first floating tensor holding inf/nan in (label, nested state) pairs, or None."""
    for label, obj in named:
        for name, t in _tensors(obj):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{label} {name}"
    return None


def _load(path: Path, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        raise QerlError(f"{path}: refused to load: it holds Python objects, not only tensors and plain containers "
                        f"(a checkpoint of qerl never does); delete {path.parent}") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise QerlError(f"{path}: unreadable checkpoint file ({str(exc).splitlines()[0]}); "
                        f"delete {path.parent}") from None


def save_checkpoint(root: str | Path, step: int, model, optimizer, scheduler, state: dict[str, Any],
                    keep: int = 2, gathered: tuple[dict, dict] | None = None) -> Path:
    """Write <root>/step-NNNNNN atomically; refuse (QerlError naming the tensor) when a value is not finite.
    gathered: (trainable tensors by name, optimizer state dict) already gathered from sharded ranks (qerl.fsdp),
    instead of the model's and optimizer's own."""
    root = Path(root)
    tensors, optim_state = gathered or (trainable_state(model), optimizer.state_dict())
    optim = {"optimizer": optim_state, "scheduler": scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
    bad = first_nonfinite(("trainable", tensors), ("optimizer state", optim["optimizer"]["state"]))
    if bad:
        raise NonFiniteState(f"non-finite values in {bad}")
    target = root / f"step-{step:06d}"
    with atomic_dir(target) as tmp:
        torch.save(tensors, tmp / "trainable.pt")
        torch.save(optim, tmp / "optim.pt")
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


def read_state(path: str | Path) -> dict[str, Any] | None:
    try:
        state = json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def is_finite_checkpoint(path: str | Path) -> bool:
    """Both tensor files readable (weights_only) and free of inf/nan."""
    path = Path(path)
    try:
        tensors, optim = _load(path / "trainable.pt", mmap=True), _load(path / "optim.pt", mmap=True)
    except QerlError:
        return False
    return first_nonfinite(("trainable", tensors), ("optimizer state", optim["optimizer"]["state"])) is None


def load_checkpoint(path: str | Path, model, optimizer, scheduler, restore=None) -> dict[str, Any]:
    """Restore tensors and states in place; return the trainer state (with 'step' = steps completed).
    restore(tensors, optimizer state, optimizer): how sharded ranks take them (qerl.fsdp), instead of copying
    into the model's parameters and optimizer.load_state_dict."""
    path = Path(path)
    mmap = restore is not None  # every rank reads: the page cache holds one copy of a whole model's state
    tensors = _load(path / "trainable.pt", mmap=mmap)
    optim = _load(path / "optim.pt", mmap=mmap)
    bad = first_nonfinite(("trainable", tensors), ("optimizer state", optim["optimizer"]["state"]))
    if bad:
        raise QerlError(f"{path}: non-finite values in {bad}; delete this checkpoint")
    if restore is not None:
        restore(tensors, optim["optimizer"], optimizer)
    else:
        _restore_in_place(tensors, optim["optimizer"], model, optimizer)
    scheduler.load_state_dict(optim["scheduler"])
    torch.set_rng_state(optim["torch_rng"])
    return json.loads((path / "trainer_state.json").read_text())


def _restore_in_place(tensors: dict, optim_state: dict, model, optimizer) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(params[name].device))
    # how the optimizer computes (fused on one GPU, foreach under FSDP) stays this run's: a checkpoint of
    # another rank count carries the other's
    groups = [{**g, **{k: mine[k] for k in IMPLEMENTATION_KEYS if k in mine}}
              for g, mine in zip(optim_state["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**optim_state, "param_groups": groups})


# ------------------------------------------------------------------------------------------ one run's folder
class CheckpointRun:
    """The checkpoints of one fingerprint: <root>/<fingerprint[:16]>/step-NNNNNN/."""

    def __init__(self, root: str | Path, fingerprint: Fingerprint):
        self.root, self.fingerprint = Path(root), fingerprint
        self.dir = self.root / fingerprint.short

    def checkpoints(self) -> list[Path]:
        return list_checkpoints(self.dir)

    def save(self, step: int, model, optimizer, scheduler, state: dict[str, Any],
             gathered: tuple[dict, dict] | None = None) -> Path:
        if not (self.dir / FINGERPRINT_FILE).is_file():
            atomic_write_json(self.dir / FINGERPRINT_FILE, {**self.fingerprint.to_json(), **self.fingerprint.about})
        return save_checkpoint(self.dir, step, model, optimizer, scheduler,
                               {**state, "fingerprint": self.fingerprint.to_json()}, gathered=gathered)

    def resumable(self) -> Path | None:
        """The newest checkpoint whose stored fingerprint is this run's; every other one is skipped with its reason."""
        self.log_others()
        for path in reversed(self.checkpoints()):
            state = read_state(path)
            why = "unreadable trainer_state.json" if state is None else self.fingerprint.mismatch(
                state.get("fingerprint"))
            if why is None:
                return path
            log.warning("not resuming %s: %s", path, why)
        return None

    def last_good(self) -> str:
        """The newest checkpoint of this run verified finite (for error messages)."""
        for path in reversed(self.checkpoints()):
            if is_finite_checkpoint(path):
                return str(path)
        return f"none (no finite checkpoint in {self.dir})"

    def log_others(self) -> None:
        """Name what this run will never resume, so a user can delete it."""
        if not self.root.is_dir():
            return
        flat = sorted(p.name for p in self.root.iterdir() if _STEP_DIR.match(p.name))
        if flat:
            log.warning("%s holds %d checkpoint(s) of the old layout without a fingerprint (%s): they are never "
                        "resumed; delete them", self.root, len(flat), ", ".join(flat))
        others = sorted(str(p) for p in self.root.iterdir() if p.is_dir() and _RUN_DIR.match(p.name)
                        and p.name != self.fingerprint.short)
        if others:
            log.info("checkpoints of other configs, data or models are kept (delete those you no longer need; "
                     "each folder's %s says what it is): %s", FINGERPRINT_FILE, ", ".join(others))


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
