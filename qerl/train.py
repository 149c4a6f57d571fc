"""Stage 2: GRPO/DAPO training of LoRA adapters over the frozen (NVFP4) base, with AQN.

    python -m qerl.train --experiment demo --model results/demo/quantized --out results/demo/adapter \
        --resume --config config/config.yaml

Writes the PEFT adapter (or, for train.mode full, the whole model) plus trainer_state.json (log history),
metrics.csv and training_curves.png, all with every step; MLflow gets each metric's mean over every
train.logging_steps steps (TRL's logging_steps), and the log a line per logging step. Checkpoints every
train.save_steps into <checkpoint-dir> (default: <results-dir>/<experiment>/checkpoints, the rule's)
/<fingerprint[:16]>/step-NNNNNN (qerl.checkpoint: the fingerprint covers the train config, the data
and the model). --resume continues from the newest checkpoint of the same fingerprint, and starts fresh when there
is none: a changed config never resumes another config's checkpoint. The data are read and validated first, so a
bad data file fails in seconds.

train.num_gpus > 1: data parallel over that many ranks of one node (qerl.distributed), launched by torchrun with
the same arguments (the workflow's train rule does it):

    torchrun --standalone --nproc-per-node 2 -m qerl.train --experiment demo ...

Rank 0 alone logs to MLflow and writes checkpoints and the adapter; a checkpoint resumes under any rank count.
train.mode full shards parameters, gradients and AdamW states over the ranks with FSDP2 (qerl.fsdp).
"""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Callable

from qerl.errors import QerlError
from qerl.io import atomic_dir
from qerl.paths import Layout
from qerl.stage import default_run_file, load_section, require_dir, run_main, stage_parser, tracking_args

log = logging.getLogger("qerl.train")


def _load_data(cfg) -> list[dict]:
    from qerl.data import load_records

    d = cfg.data
    return load_records(d.source, split=d.split, question_field=d.question_field, answer_field=d.answer_field,
                        config_name=d.config_name, limit=d.limit, answer_kind=d.answer_kind)


def _setup_data(cfg, tokenizer, records: list[dict] | None = None) -> tuple[list[list[int]], list[str]]:
    from qerl.data import encode_prompts

    records = _load_data(cfg) if records is None else records
    ids = encode_prompts(tokenizer, [r["question"] for r in records], cfg.data.template)
    keep = [i for i, p in enumerate(ids) if len(p) <= cfg.max_prompt_length]
    if not keep:  # else the trainer would stop on "no usable prompts" with no hint of the lengths
        raise QerlError(f"train.max_prompt_length={cfg.max_prompt_length} is shorter than every prompt of "
                        f"{cfg.data.source}: all {len(ids)} dropped, the shortest is {min(map(len, ids))} tokens "
                        f"(template {cfg.data.template[:40]!r}); raise max_prompt_length")
    if len(keep) < len(ids):
        log.warning("dropped %d of %d prompt(s) longer than max_prompt_length=%d (the shortest dropped: %d tokens)",
                    len(ids) - len(keep), len(ids), cfg.max_prompt_length,
                    min(len(p) for p in ids if len(p) > cfg.max_prompt_length))
    return [ids[i] for i in keep], [records[i]["answer"] for i in keep]


def _setup_rewards(cfg):
    from qerl.rewards import get_reward_fn

    weights = cfg.reward_weights or [1.0] * len(cfg.rewards)
    return [(name.split(":")[-1].split(".")[-1], get_reward_fn(name), w) for name, w in zip(cfg.rewards, weights)]


def _setup_checkpoints(cfg, records: list[dict], model_dir: str, checkpoint_dir: Path, resume: bool):
    """This run's checkpoint folder, named by the fingerprint of its config, data and model."""
    import time

    from qerl.checkpoint import CheckpointRun, run_fingerprint

    t0 = time.perf_counter()
    fingerprint = run_fingerprint(cfg.model_dump(mode="json"), records, model_dir,
                                  about={"data_source": str(cfg.data.source)})
    run = CheckpointRun(checkpoint_dir, fingerprint)
    log.info("checkpoints of this run: %s (fingerprint %s, %.1f s)", run.dir, fingerprint.digest,
             time.perf_counter() - t0)
    existing = run.checkpoints()
    if existing and not resume:
        raise QerlError(f"{run.dir} already holds {len(existing)} checkpoint(s) of this config, data and model "
                        f"(newest {existing[-1].name}): pass --resume to continue, or delete {run.dir} to start over")
    if not resume:
        run.log_others()
    return run


def _setup_model(cfg, model_dir: str, ranks=None):
    from qerl.distributed import SINGLE
    from qerl.fsdp import sharded
    from qerl.policy import LoraSpec, load_policy
    from qerl.trainer import resolve_device_dtype

    ranks = ranks or SINGLE
    device, dtype = resolve_device_dtype(cfg.dtype)
    if sharded(cfg, ranks):  # FSDP2 moves each unit's shards to the GPU
        device = "cpu"
    elif device == "cuda":  # this rank's GPU (qerl.distributed set it), also for loaders that read "cuda" as cuda:0
        import torch

        device = f"cuda:{torch.cuda.current_device()}"
    lora = None if cfg.mode == "full" else LoraSpec(r=cfg.lora.lora_r, alpha=cfg.lora.lora_alpha,
                                                    dropout=cfg.lora.lora_dropout,
                                                    target_modules=tuple(cfg.lora.target_modules),
                                                    fused=cfg.lora.fused)
    # sharded: rank 0 reads the weights, the others receive their shards from it (qerl.fsdp)
    return load_policy(model_dir, mode=cfg.mode, dtype=dtype, device=device, lora=lora,
                       train_norms=cfg.train_norms, gradient_checkpointing=cfg.gradient_checkpointing,
                       empty=sharded(cfg, ranks) and not ranks.is_main)


class LoggingWindow:
    """Forwards each metric's mean over every `every` steps (and over the steps left at the last one), as TRL's
    logging_steps does, and logs one progress line each time."""

    def __init__(self, log_fn: Callable[[dict[str, float], int], None], every: int, total_steps: int):
        self.log_fn, self.every, self.total_steps = log_fn, every, total_steps
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            if v is not None:
                self.sums[k] = self.sums.get(k, 0.0) + float(v)
                self.counts[k] = self.counts.get(k, 0) + 1
        if step % self.every and step != self.total_steps:
            return
        means = {k: self.sums[k] / self.counts[k] for k in self.sums}
        self.sums, self.counts = {}, {}
        self.log_fn(means, step)
        shown = " ".join(f"{k} {means[k]:.4g}" for k in ("reward", "entropy", "aqn/sigma", "timing/step") if k in means)
        log.info("step %d/%d: %s", step, self.total_steps, shown)


def write_history(history: list[dict], out_dir: Path) -> None:
    """metrics.csv (one row per step) and training_curves.png (the report's figure: reward first, every curve)."""
    from qerl.report import metrics_from_history, plot_training_curves

    keys = sorted({k for row in history for k in row})
    with open(out_dir / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(history)
    plot_training_curves(metrics_from_history(history), out_dir / "training_curves.png")


def save_outputs(trainer, tokenizer, cfg, out: str, model=None, *, base: str | None = None,
                 experiment: str | None = None, eval_json: str | Path | None = None) -> None:
    """model: what to save (default trainer.model; under FSDP the plain model gathered from the shards);
    base, experiment, eval_json: what the model card names (the checkpoint trained on, the experiment, where its
    accuracy will be)."""
    from qerl.model_card import adapter_card

    model = trainer.model if model is None else model
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # over peft's empty template
        (tmp / "README.md").write_text(adapter_card(cfg, base=base or "the base checkpoint", experiment=experiment,
                                                    history=trainer.log_history, eval_json=eval_json))
        if cfg.train_norms and cfg.mode != "full":
            from qerl.checkpoint import save_trained_norms
            save_trained_norms(model, tmp)
        state = {"total_steps": trainer.total_steps, "mode": cfg.mode, "log_history": trainer.log_history}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        write_history(trainer.log_history, tmp)


def checkpoint_dir(args) -> Path:
    """--checkpoint-dir, else where the rule puts them, so a hand run resumes the rule's checkpoints."""
    return Path(args.checkpoint_dir or Layout(args.results_dir).checkpoints(args.experiment))


class _NoRun:
    """The tracking run of ranks other than 0: they compute, rank 0 logs."""

    def __getattr__(self, name):
        return lambda *a, **kw: None


def main(argv: list[str] | None = None) -> None:
    p = stage_parser("python -m qerl.train", __doc__)
    p.add_argument("--model", required=True, help="checkpoint to train on (results/<exp>/quantized)")
    p.add_argument("--out", required=True, help="adapter output directory")
    p.add_argument("--checkpoint-dir", help="default: <results-dir>/<experiment>/checkpoints (as the rule)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint of the same config, data and model; start fresh if none")
    args = p.parse_args(argv)
    cfg = load_section(args, "train")
    require_dir(args.model, "--model")

    from qerl.distributed import close, init_ranks

    ranks = init_ranks(cfg.num_gpus, cfg.num_nodes)
    if not ranks.is_main:  # one log: rank 0's
        logging.getLogger().setLevel(logging.WARNING)
    if ranks.enabled:
        import torch.distributed as dist

        log.info("data parallel over %d ranks (torch.distributed backend %s; %s)", ranks.world_size,
                 dist.get_backend(), "FSDP2 shards of every weight" if cfg.mode == "full" else "replicated weights")
    try:
        _train(args, cfg, ranks)
    finally:
        close(ranks)


def _train(args, cfg, ranks) -> None:
    import contextlib

    import torch

    from qerl.tracking import stage_run
    from qerl.trainer import GRPOTrainer

    from transformers import AutoTokenizer

    records = _load_data(cfg)  # before the model: a bad data file or reward name fails in seconds
    rewards = _setup_rewards(cfg)
    # prompts too: the checkpoint's own tokenizer (what load_policy returns) loads in a second
    prompts, answers = _setup_data(cfg, AutoTokenizer.from_pretrained(args.model), records)
    checkpoints = _setup_checkpoints(cfg, records, args.model, checkpoint_dir(args), args.resume)
    torch.manual_seed(cfg.seed)
    params = {"model": args.model, **cfg.model_dump(mode="json")}
    tracking = stage_run(experiment=args.experiment, stage="train", params=params,
                         run_file=default_run_file(args, "train"), **tracking_args(args)) \
        if ranks.is_main else contextlib.nullcontext(_NoRun())
    with tracking as run:
        run.set_tags({"qerl.checkpoints": str(checkpoints.dir)})
        model, tokenizer = _setup_model(cfg, args.model, ranks)
        trainer = GRPOTrainer(cfg, model, tokenizer, prompts, answers, rewards,
                              checkpoint_dir=checkpoints.root, fingerprint=checkpoints.fingerprint, ranks=ranks)
        trainer.progress_label = f"train {args.experiment}"
        # the window needs the trainer's step count to flush at the last step; resume replays through it too
        trainer.log_metrics = LoggingWindow(lambda m, s: run.log_metrics(m, step=s), cfg.logging_steps,
                                            trainer.total_steps)
        if args.resume:
            trainer.resume()
        history = trainer.train()
        with trainer.parallel.gathered() as whole:  # FSDP: every rank gathers, rank 0 writes the plain model
            if ranks.is_main:
                _save_and_log(trainer, whole, tokenizer, cfg, args, run, history)
            ranks.barrier()  # no rank exits (and tears the group down) before the adapter is written
    if ranks.is_main:
        print(f"trained {trainer.total_steps} steps -> {args.out}")


def _save_and_log(trainer, model, tokenizer, cfg, args, run, history: list[dict]) -> None:
    out = args.out
    save_outputs(trainer, tokenizer, cfg, out, model, base=args.model, experiment=args.experiment,
                 eval_json=Layout(args.results_dir).eval_json(args.experiment))
    for name in ("trainer_state.json", "metrics.csv", "training_curves.png", "README.md"):
        run.log_artifact(Path(out) / name)
    run.log_artifact(Path(out), artifact_path="adapter")
    # the headline goes to the description: each final value is already the last point of its curve
    from qerl.report import metrics_from_history, training_markdown

    run.describe(f"{training_markdown(metrics_from_history(history))}\n\nadapter: `{out}`")


if __name__ == "__main__":
    run_main(main)
