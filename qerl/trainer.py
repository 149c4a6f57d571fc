"""GRPO/DAPO trainer with Adaptive Quantization Noise, on torch + peft + transformers.

One step: take `batch_size` prompts -> sample `num_generations` completions each from the rollout engine while
AQN noise sits on the RMSNorm scales -> rewards -> group advantages -> (noise removed) clean log-probs chunk by
chunk -> clipped token loss (+ TIS, + KL) -> LoRA update, `num_iterations` times per rollout batch.
Metrics keep TRL's names. Everything random derives from (seed, step), so a resumed run equals an unbroken one.
Data parallel (qerl.distributed, torchrun): each rank rolls out and trains on its share of the step's prompt
groups; rewards, the loss normaliser, gradients and metrics are combined so N ranks give the 1-rank result.
Mode full on several ranks shards the model with FSDP2 (qerl.fsdp) and rolls out on a gathered copy.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from qerl.aqn import aqn_sigma, aqn_stage
from qerl.batch import Batch, micro_batch, micro_batch_rows, pad_rollout  # noqa: F401 (re-exported)
from qerl.checkpoint import CheckpointRun, NonFiniteState, load_checkpoint
from qerl.distributed import SINGLE, Ranks
from qerl.diagnostics import QuantKL, rollout_entropy, snapshot, update_norm
from qerl.errors import QerlError, out_of_memory_names
from qerl.fsdp import data_parallel, fuse_as_rank0
from qerl.grpo import constant_groups, group_advantages, masked_mean, policy_loss, tis_weights, token_logprobs
from qerl.optim import build_optimizer
from qerl.packing import (grouped_packed_token_logprobs, packed_attention, packed_token_logprobs, packing_possible,
                          positions_computed, shares_prompts)
from qerl.prefix import grouped_token_logprobs
from qerl.rollout import SamplingParams, make_engine
from qerl.rollout.attention import sdpa_without_cudnn
from qerl.rollout.residency import UpdateMemory, update_reserve
from qerl.tiled_mlp import tile_mlps
from qerl.update_copies import update_copies

if TYPE_CHECKING:  # pydantic is not on the GPU image; the trainer only reads the config's attributes
    from qerl.checkpoint import Fingerprint
    from qerl.config import TrainConfig

log = logging.getLogger("qerl.train")


def resolve_device_dtype(dtype: str) -> tuple[str, torch.dtype]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        return device, torch.bfloat16 if device == "cuda" else torch.float32
    return device, getattr(torch, dtype)


def _step_seed(seed: int, step: int, salt: int) -> int:
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**31 - 1)


def engine_options(cfg: TrainConfig) -> dict[str, Any]:
    """make_engine's keyword arguments for the configured rollout engine."""
    r = cfg.rollout
    if r.engine == "paged":  # plain_projections off: the trained weights (mode full) stay the optimizer's tensors
        return {"gpu_memory_utilization": r.gpu_memory_utilization, "block_size": r.block_size, "compile": r.compile,
                "max_num_batched_tokens": r.max_num_batched_tokens, "max_num_seqs": r.max_num_seqs,
                "resident": "auto" if r.keep_resident else False, "plain_projections": False}
    if r.engine == "torch":
        return {"compile": r.compile, "plain_projections": False}
    if r.engine == "vllm":
        return {"gpu_memory_utilization": r.gpu_memory_utilization, "max_lora_rank": max(64, cfg.lora.lora_r)}
    return {}

class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, model, tokenizer, prompts: list[list[int]], answers: list[str],
                 reward_fns: list[tuple[str, Callable, float]], *, checkpoint_dir: str | Path,
                 fingerprint: Fingerprint | None = None,
                 log_metrics: Callable[[dict[str, float], int], None] | None = None, ranks: Ranks = SINGLE):
        """fingerprint (qerl.checkpoint.run_fingerprint) names this run's checkpoint folder; train() and resume()
        need it, a trainer only stepped by hand (benchmarks) does not. ranks: this process's data-parallel place
        (qerl.distributed.init_ranks); rank 0 alone writes checkpoints."""
        if len(prompts) == 0:
            raise QerlError("train.data: no usable prompts (empty dataset, or all longer than max_prompt_length)")
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.update_need: int | None = None  # bytes an update needs free, once one measured it (qerl.rollout.residency)
        self.prompts, self.answers, self.reward_fns = prompts, answers, reward_fns
        self.checkpoint_dir = Path(checkpoint_dir)
        self.checkpoints = CheckpointRun(checkpoint_dir, fingerprint) if fingerprint is not None else None
        self.log_metrics = log_metrics or (lambda m, s: None)
        self.ranks = ranks
        ranks.share(cfg.batch_size, "prompts of a step (train.batch_size)")  # fails early when uneven
        if cfg.fused_elementwise:  # before tiling: a tiled MLP's slices then run the compiled activation
            fuse_as_rank0(model, cfg, ranks)  # sharded, the other ranks' models are empty here: rank 0 probes
        tile_mlps(model, cfg.mlp_chunks)  # 1: untiled
        self.parallel = data_parallel(model, cfg, ranks)  # after the forward swaps: they probe the weights
        packable = packing_possible(model, bool(cfg.padding_free))  # the padded rows where the model needs them
        self.prompts_packed = packable and shares_prompts(cfg)  # each prompt once per group, in packed rows
        self.packable = self.prompts_packed or (packable and not self.share_prefix)  # a packed forward runs
        self.device = next(p for p in model.parameters()).device
        self.total_steps = cfg.max_steps or math.ceil(cfg.num_train_epochs * len(prompts) / cfg.batch_size)
        params = self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise QerlError("model has no trainable parameters (check train.mode and lora settings)")
        # fused on CUDA (as TRL's default adamw_torch_fused): one kernel per step instead of foreach's chains
        options = self.parallel.optimizer_options() or {"fused": all(p.is_cuda for p in params) or None}
        self.optimizer = build_optimizer(model, params, cfg, **options)  # train.optim, betas, decay groups
        from transformers import get_scheduler

        updates = self.total_steps * cfg.num_iterations
        self.scheduler = get_scheduler(cfg.lr_scheduler_type, self.optimizer,
                                       num_warmup_steps=math.ceil(cfg.warmup_ratio * updates),
                                       num_training_steps=updates)
        self.engine = make_engine(cfg.rollout.engine, self.parallel.rollout_model, tokenizer, **engine_options(cfg))
        self.quant_kl = QuantKL.for_config(cfg, self.device, resolve_device_dtype(cfg.dtype)[1])  # None: off
        self.step, self.log_history = 0, []
        self.progress_label = "train"  # the progress lines' name (the train stage adds the experiment)
        self._perms: dict[int, torch.Tensor] = {}

    # ---- data order: a fixed permutation per epoch, position = step * batch_size ----
    def batch_indices(self, step: int) -> list[int]:
        n, out = len(self.prompts), []
        for pos in range(step * self.cfg.batch_size, (step + 1) * self.cfg.batch_size):
            epoch, offset = divmod(pos, n)
            if epoch not in self._perms:
                g = torch.Generator().manual_seed(self.cfg.seed + epoch)
                self._perms = {epoch: torch.randperm(n, generator=g)}
            out.append(int(self._perms[epoch][offset]))
        return out

    def sampling(self, step: int, first_row: int = 0) -> SamplingParams:
        """The step's sampling; first_row: the global index of this call's first row (its rank's share)."""
        r = self.cfg.rollout
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=tuple(r.stop),
                              max_tokens=self.cfg.max_completion_length, seed=_step_seed(self.cfg.seed, step, 1),
                              first_row=first_row)

    def sigma(self, step: int) -> tuple[float, int]:
        a = self.cfg.aqn
        if a is None or a.schedule == "none":
            return 0.0, 0
        return (aqn_sigma(step, self.total_steps, sigma_start=a.sigma_start, sigma_end=a.sigma_end,
                          num_stages=a.num_stages, schedule=a.schedule),
                aqn_stage(step, self.total_steps, a.num_stages))

    # ---- rollout ----
    def rollout(self, step: int) -> Batch:
        """This rank's share of the step's prompt groups, rolled out and scored; advantages and reward metrics
        come from every rank's rewards, as one process holding the whole batch computes them."""
        g = self.cfg.num_generations
        groups = self.ranks.share(self.cfg.batch_size, "prompts of a step (train.batch_size)")
        idx = self.batch_indices(step)[groups]
        prompts = [self.prompts[i] for i in idx]
        answers = [self.answers[i] for i in idx for _ in range(g)]
        sigma, stage = self.sigma(step)
        t0, cfg = time.perf_counter(), self.cfg
        knobs = (f"lower train.rollout.gpu_memory_utilization (now {cfg.rollout.gpu_memory_utilization}), "
                 f"max_completion_length (now {cfg.max_completion_length}) or the rows of a step (batch_size x "
                 f"num_generations); `python -m qerl.config memory` prints the estimate per GPU")
        with out_of_memory_names(f"the rollout of step {step + 1}", knobs):
            out, noise_stats = self._generate(step, prompts, self.sampling(step, first_row=groups.start * g), sigma)
        t_rollout = time.perf_counter() - t0
        values, timeouts = self._reward_values(out.texts(self.tokenizer), answers)
        lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.float32)
        clipped = torch.tensor([r == "length" for r in out.finish_reasons], dtype=torch.float32)
        surprise = torch.tensor([-sum(lp) for lp in out.logprobs], dtype=torch.float32)  # for rollout/entropy
        table = self.ranks.all_gather(torch.cat([values, surprise[:, None], lengths[:, None], clipped[:, None]], 1))
        rewards = self._weighted_total(table[:, :-3])
        adv = group_advantages(rewards, g, self.cfg.scale_rewards)[groups.start * g:groups.stop * g]
        batch = self.collate(out, adv)
        # the decode steps' compile, warm-up and capture inside that rollout (the paged engine's graphs)
        graphs = {"timing/rollout_graph_build": float(out.stats["graph_build_s"])} if "graph_build_s" in out.stats \
            else {}
        metrics = self.ranks.reduce_metrics({"rewards/grading_timeouts": float(timeouts), "timing/rollout": t_rollout,
                                             **graphs, **noise_stats},
                                            sums=("rewards/grading_timeouts",),
                                            maxima=("timing/rollout", *graphs))
        metrics.update(self._reward_metrics(table, rewards), **{"aqn/sigma": sigma, "aqn/stage": stage})
        batch.metrics = metrics
        return batch

    def _generate(self, step: int, prompts: list[list[int]], sampling: SamplingParams, sigma: float):
        """The engine's rollout of `prompts` from the trained weights (under FSDP, their gathered copy) with this
        step's AQN noise (the same vector on every rank)."""
        noise_gen = torch.Generator().manual_seed(_step_seed(self.cfg.seed, step, 2))
        with self.parallel.gathered() as policy:
            return self.engine.policy_rollout(policy, prompts, self.cfg.num_generations, sampling, sigma, noise_gen)

    def _reward_metrics(self, table: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
        """Reward and completion metrics of the whole step from its (rows, reward functions + 3) table: each
        function's value, then each row's sum of -log p of its sampled tokens, its length and truncation flag.
        rollout/entropy: qerl.diagnostics.rollout_entropy; frac_reward_zero_std counts groups of equal rewards."""
        g = self.cfg.num_generations
        surprise, lengths, clipped = table[:, -3], table[:, -2], table[:, -1]
        grouped = rewards.view(-1, g)
        metrics = {f"rewards/{name}/mean": table[:, j].mean().item() for j, (name, _, _) in enumerate(self.reward_fns)}
        for j, (name, _, _) in enumerate(self.reward_fns):
            if name == "correctness":  # groups where only the other rewards can tell completions apart
                metrics["frac_groups_none_correct"] = (table[:, j].view(-1, g).amax(dim=1) <= 0).float().mean().item()
        metrics.update({
            "reward": rewards.mean().item(), "reward_std": grouped.std(dim=1).mean().item(),
            "frac_reward_zero_std": constant_groups(rewards, g).float().mean().item(),
            "rollout/entropy": rollout_entropy(surprise, lengths),
            "completions/mean_length": lengths.mean().item(), "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": float(clipped.sum()) / len(clipped), "rollout_tokens": float(lengths.sum()),
        })
        return metrics

    def _reward_values(self, texts: list[str], answers: list[str]) -> tuple[torch.Tensor, int]:
        """(rows, reward functions) unweighted rewards and the number of gradings that timed out."""
        from qerl.rewards import GradingStats, call_reward

        stats, columns = GradingStats(), []
        limit = self.cfg.grading_timeout_s  # seconds per completion; past it the reward is 0
        for name, fn, _ in self.reward_fns:
            values = torch.tensor(call_reward(fn, texts, answers=answers, kind=self.cfg.data.answer_kind,
                                              timeout_s=limit, stats=stats), dtype=torch.float32)
            if values.shape != (len(texts),):
                raise QerlError(f"reward '{name}' returned {values.numel()} values for {len(texts)} completions")
            columns.append(values)
        return torch.stack(columns, dim=1), stats.timeouts

    def _weighted_total(self, values: torch.Tensor) -> torch.Tensor:
        return sum((w * values[:, j] for j, (_, _, w) in enumerate(self.reward_fns)), torch.zeros(len(values)))

    def score(self, texts: list[str], answers: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """Weighted total reward per completion and the per-function means (one process's rows)."""
        values, timeouts = GRPOTrainer._reward_values(self, texts, answers)
        metrics = {f"rewards/{name}/mean": values[:, j].mean().item() for j, (name, _, _) in enumerate(self.reward_fns)}
        metrics["rewards/grading_timeouts"] = float(timeouts)
        return GRPOTrainer._weighted_total(self, values), metrics

    def collate(self, out, advantages: torch.Tensor) -> Batch:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids, attn, rlp = pad_rollout(out, pad)
        cmask = attn[:, ids.shape[1] - rlp.shape[1]:].float()
        if self.cfg.mask_truncated_completions:
            truncated = torch.tensor([r == "length" for r in out.finish_reasons])
            cmask[truncated] = 0.0
        return Batch(*(t.to(self.device) for t in (ids, attn, cmask, rlp, advantages)))

    # ---- update ----
    @property
    def share_prefix(self) -> bool:
        """Each prompt computed once per group where micro-batches hold whole groups: packed (qerl.packing) or over a
        KV cache (qerl.prefix), which gradient checkpointing disables."""
        whole = self.cfg.micro_batch_size % self.cfg.num_generations == 0
        return whole and (self.prompts_packed or not self.cfg.gradient_checkpointing)

    def _autocast_dtype(self) -> torch.dtype | None:
        """The half dtype the training forward autocasts to (train.mixed_precision), None when it does not."""
        if self.cfg.mixed_precision == "off":
            return None
        frozen = {p.dtype for p in self.model.parameters() if not p.requires_grad and p.is_floating_point()}
        trained = {p.dtype for p in self.model.parameters() if p.requires_grad}
        half = frozen & {torch.bfloat16, torch.float16}
        return next(iter(half)) if len(half) == 1 and trained == {torch.float32} else None

    def _forward_precision(self, backward: bool = False):
        """torch.autocast in the model's half dtype with peft's fp32 input casts off, or nothing; backward: only the
        casts off (checkpoints recompute under the autocast state they recorded, without fp32 input copies). Both
        keep cuDNN out of SDPA unless train.cudnn_attention (a host graph build per new length stalled the GPU)."""
        stack = contextlib.ExitStack()
        stack.enter_context(packed_attention(self.model) if self.packable else contextlib.nullcontext())  # recompute
        if not self.cfg.cudnn_attention:
            stack.enter_context(sdpa_without_cudnn())  # backward's recompute too
        dtype = self._autocast_dtype()
        if dtype is None:
            return stack
        from peft.helpers import disable_input_dtype_casting

        if not backward:
            stack.enter_context(torch.autocast(device_type=self.device.type, dtype=dtype))
        stack.enter_context(disable_input_dtype_casting(self.model))
        return stack

    def logprobs(self, batch: Batch, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token log-probs, entropy) of `rows` of the batch (all of them by default)."""
        rows = slice(0, batch.input_ids.shape[0]) if rows is None else rows
        with self._forward_precision():
            return self.parallel.run(self._logprobs, batch, rows)  # the FSDP root's forward when sharded

    def _logprobs(self, batch: Batch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        options = {"temperature": max(self.cfg.rollout.temperature, 1e-6), "chunk_size": self.cfg.logprob_chunk_size}
        plen = batch.input_ids.shape[1] - batch.completion_len
        if self.share_prefix:
            g = self.cfg.num_generations
            groups = slice(rows.start // g, rows.stop // g)
            grouped = grouped_packed_token_logprobs if self.prompts_packed else grouped_token_logprobs
            return grouped(
                self.model, batch.input_ids[::g][groups, :plen], batch.attention_mask[::g][groups, :plen],
                batch.input_ids[rows, plen:], batch.attention_mask[rows, plen:], g, **options)
        forward = packed_token_logprobs if self.packable else token_logprobs  # rows without their padding
        return forward(self.model, batch.input_ids[rows], batch.attention_mask[rows], batch.completion_len, **options)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, rows: slice | None = None) -> torch.Tensor | None:
        if self.cfg.beta == 0:
            return None
        if not hasattr(self.model, "disable_adapter"):
            raise QerlError("train.beta > 0 needs a LoRA mode (the reference is the base with the adapter off)")
        with self.model.disable_adapter():
            return self.logprobs(batch, rows)[0]

    def _saved_tensors(self):
        """Where autograd keeps what backward needs: on the GPU, or in pinned CPU memory (offload_activations)."""
        if self.cfg.offload_activations:
            return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        return contextlib.nullcontext()

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        """num_iterations optimizer steps on this rank's rows; the loss is normalised by the whole step's token and
        micro-batch counts (every rank's) and the gradients summed over ranks before clipping: N ranks of B/N prompts
        give one rank's update of B. Over dense copies of an FP4 base where they fit (qerl.update_copies)."""
        cfg = self.cfg
        knobs = (f"lower train.micro_batch_size (now {cfg.micro_batch_size}) or max_completion_length (now "
                 f"{cfg.max_completion_length}), or turn on gradient_checkpointing (now {cfg.gradient_checkpointing}) "
                 f"and offload_activations (now {cfg.offload_activations})")
        for key, on in (("rollout.keep_resident", getattr(self.engine, "resident_now", False)),  # pool, graphs
                        ("train.dense_weights", cfg.mode == "qlora_fp4" and cfg.dense_weights is not False)):  # copies
            knobs += f", or set {key}: false" if on else ""
        with out_of_memory_names(f"the update of step {step + 1}", knobs), \
                update_copies(self.model, cfg.dense_weights, self.update_need) as made, \
                UpdateMemory(self.device) as meter:
            metrics = self._update(batch, step)
        metrics["update_dense_copies_gib"] = made / 2**30
        self.update_need = update_reserve(meter.growth, batch.input_ids.shape[1],  # without the copies
                                          cfg.max_prompt_length + cfg.max_completion_length)
        if hasattr(self.engine, "plan_update"):  # what later updates need free beside a resident engine
            self.engine.plan_update(None if self.update_need is None else self.update_need + made)
        return metrics

    def _update(self, batch: Batch, step: int) -> dict[str, float]:
        cfg = self.cfg
        # bnpo's token mean is per micro-batch: its rows stay as they came; every other loss sums over rows
        slices = micro_batch_rows(batch, cfg.micro_batch_size, cfg.num_generations if self.share_prefix else 1,
                                  by_length=cfg.loss_type != "bnpo")
        n_tokens = self.ranks.all_reduce(batch.completion_mask.sum())
        accumulation = len(slices) * self.ranks.world_size
        subs = [micro_batch(batch, s) for s in slices]  # each cut to its own longest completion
        refs = [self.reference_logprobs(sub) for sub in subs]
        olds = [None] * len(slices)
        if cfg.num_iterations > 1:
            with torch.no_grad():
                olds = [self.logprobs(sub)[0] for sub in subs]
        sums: dict[str, float] = {}
        before = snapshot(self.trainable) if cfg.mode != "full" else None  # full: a second copy of the model
        t0 = time.perf_counter()
        self.model.train()
        for _ in range(cfg.num_iterations):
            finite = torch.ones((), dtype=torch.bool, device=self.device)  # read once: no sync per micro-batch
            for sub, old, ref in zip(subs, olds, refs):
                with self._saved_tensors():
                    lp, ent = self.logprobs(sub)
                mask, metrics, is_w = sub.completion_mask, {}, None
                if cfg.rollout_correction == "tis":
                    base = lp.detach() if old is None else old
                    is_w, metrics = tis_weights(base, sub.rollout_logprobs, mask, cap=cfg.tis_cap)
                loss, lm = policy_loss(lp, old, sub.advantages, mask, loss_type=cfg.loss_type,
                                       epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, beta=cfg.beta,
                                       ref_logprobs=ref, is_weights=is_w,
                                       max_completion_length=cfg.max_completion_length,
                                       num_items_in_batch=n_tokens, gradient_accumulation_steps=accumulation)
                finite &= torch.isfinite(loss.detach())
                with self._forward_precision(backward=True):
                    loss.backward()
                metrics.update(lm, loss=loss.detach(), entropy=masked_mean(ent, mask))
                for k, v in metrics.items():  # tensors stay on the device until the update ends
                    v = v.detach() if isinstance(v, torch.Tensor) else v
                    sums[k] = sums.get(k, 0.0) + v / (len(slices) * cfg.num_iterations)
            if not bool(finite):  # before the optimizer: a non-finite loss is never applied
                self.optimizer.zero_grad(set_to_none=True)
                raise QerlError(f"non-finite loss at step {step + 1}; the last good checkpoint is "
                                f"{self.last_good_checkpoint()}")
            sums["grad_norm"] = self.parallel.reduce_and_clip(self.trainable, cfg.max_grad_norm)
            if not math.isfinite(sums["grad_norm"]):  # clipping scaled the gradients by nan: never apply them
                raise QerlError(f"non-finite gradient norm at step {step + 1} (update not applied); the last good "
                                f"checkpoint is {self.last_good_checkpoint()}")
            sums["learning_rate"] = self.scheduler.get_last_lr()[0]
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if before is not None:  # how far this step's updates moved the adapter (the same on every rank)
            sums["adapter/update_norm"] = update_norm(before, self.trainable)
        sums = {k: float(v) for k, v in sums.items()}
        sums["timing/update"] = time.perf_counter() - t0
        # positions the forwards computed per real token (padding, and prompts computed once per group)
        group = cfg.num_generations if self.share_prefix else 1
        computed = sum(positions_computed(s.attention_mask, s.completion_len, self.packable, group) for s in subs)
        sums["update/padded_tokens_ratio"] = computed / max(int(batch.attention_mask.sum()), 1)
        sums = self.ranks.reduce_metrics(sums, maxima=("timing/update",))  # equal micro-batches per rank: means
        sums["loss"] *= accumulation  # one update's loss is the sum over its micro-batches (every rank's)
        return sums

    # ---- loop ----
    def _checkpoint_run(self) -> CheckpointRun:
        if self.checkpoints is None:
            raise ValueError("GRPOTrainer needs fingerprint= to save or resume checkpoints")
        return self.checkpoints

    def last_good_checkpoint(self) -> str:
        return self.checkpoints.last_good() if self.checkpoints is not None else "none (no checkpoint folder)"

    def resume(self) -> None:
        """Continue from the newest checkpoint of this fingerprint, replaying its metrics to log_metrics (the
        new tracking run then holds the whole curve); without one, start fresh."""
        run = self._checkpoint_run()
        found = run.resumable()
        if found is None:
            log.info("no checkpoint of this config, data and model in %s: starting fresh", run.dir)
            return
        state = load_checkpoint(found, self.model, self.optimizer, self.scheduler,  # on every rank: any count
                                restore=self.parallel.restore)
        self.step, self.log_history = state["step"], state.get("log_history", [])
        for row in self.log_history:
            self.log_metrics({k: v for k, v in row.items() if k != "step"}, row["step"])
        log.info("resumed from %s (step %d of %d)", found, self.step, self.total_steps)

    def save(self) -> Path:
        """Rank 0 writes (the trainable state is the same on every rank, or gathered from the FSDP shards); the
        others wait until it is on disk."""
        run = self._checkpoint_run()
        gathered = self.parallel.checkpoint_state(self.optimizer)  # a collective under FSDP
        if self.ranks.is_main:
            try:
                run.save(self.step, self.model, self.optimizer, self.scheduler,
                         {"log_history": self.log_history, "total_steps": self.total_steps}, gathered=gathered)
            except NonFiniteState as err:
                raise QerlError(f"{err} after step {self.step} (checkpoint not written); the last good checkpoint "
                                f"is {self.last_good_checkpoint()}") from None
        self.ranks.barrier()
        return run.dir / f"step-{self.step:06d}"

    def train(self) -> list[dict[str, Any]]:
        from qerl.progress import StepProgress

        self.parallel.start(self.trainable)  # replicas: rank 0's start, whatever each rank's init drew
        bar = StepProgress(self.progress_label, self.total_steps, self.step, enabled=self.ranks.is_main)
        while self.step < self.total_steps:
            t0 = time.perf_counter()
            batch = self.rollout(self.step)
            self.engine.sleep()  # the KV pool (paged) or vLLM's memory goes to the update; generate takes it back
            kl = self.quant_kl.measure(self, batch) if self.quant_kl and self.quant_kl.due(self.step) else {}
            metrics = {**batch.metrics, **kl, **self.update(batch, self.step)}
            metrics["timing/step"] = time.perf_counter() - t0
            metrics["tokens_per_second"] = metrics.pop("rollout_tokens") / max(metrics["timing/rollout"], 1e-9)
            self.step += 1
            self.log_history.append({"step": self.step, **metrics})
            self.log_metrics(metrics, self.step)
            bar.step(reward=float(metrics["reward"]), step_s=float(metrics["timing/step"]))
            if self.step % self.cfg.save_steps == 0 or self.step == self.total_steps:
                self.save()
        bar.close()
        return self.log_history
