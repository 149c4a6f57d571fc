"""Data-parallel GRPO over torch.distributed: one process (rank) per GPU, launched by torchrun.

    torchrun --standalone --nproc-per-node 2 -m qerl.train --experiment demo --model results/demo/quantized \
        --out results/demo/adapter --resume --config config/config.yaml      # train.num_gpus: 2
    python -m qerl.launch --nodes 2 --nproc-per-node 4 -- --experiment ...  # num_nodes 2: a torchrun per node

Each rank owns whole prompt groups of every step (rows [rank * R, (rank + 1) * R) of the step's B * G rows,
R = B * G / world_size, so group advantages stay local) and runs its own rollout engine on its own copy of the
frozen base. Data order, rollout row seeds (by global row index) and the AQN noise derive from (seed, step, row)
as on one rank. Per step the ranks exchange only: every row's reward components, length and truncation flag
(all-gathered, so advantages with scale_rewards 'batch' and the reward metrics are the 1-rank ones), the
completion-token count (the global loss normaliser), the trainable gradients (one all-reduce per optimizer step,
after gradient accumulation) and the remaining metrics. The frozen base is never communicated.

Why no DDP wrapper: the loss runs the decoder body and lm_head separately (qerl.grpo.split_causal_lm), never the
model's own forward, so DDP's forward hook would never arm its reducer; one explicit all-reduce of the trainable
gradients after accumulation sends what DDP under no_sync would, and nothing else.

Failure: torchrun's agent ends every rank as soon as one exits (kill, OOM, error; --max-restarts 0), within a
second. A rank that hangs alive is caught by the process-group timeout (QERL_DIST_TIMEOUT_S, default 600 s:
above the rank-to-rank imbalance of long rollouts, since the fastest rank waits at the next collective); the
waiting ranks then end with one line. NCCL keeps torch's defaults: TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears the
process down on a timed-out or failed collective, and its heartbeat monitor ends a rank whose watchdog hangs (on 2
H200s, torch 2.11, the watchdog wrote its debug dump for about a minute past the timeout before the abort).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from qerl.errors import QerlError

TIMEOUT_ENV = "QERL_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
_BUCKET_BYTES = 64 * 2**20  # gradients all-reduced in flat buckets of this size: few launches, bounded memory


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise QerlError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return value


@dataclass(frozen=True)
class Ranks:
    """This process's place in the data-parallel world; the single-process world makes every method a no-op."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, total: int, what: str = "rows") -> slice:
        """This rank's contiguous share of `total` items (an equal share each)."""
        if total % self.world_size:
            raise QerlError(f"{total} {what} cannot be split evenly over {self.world_size} ranks")
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    # ---- collectives: each failure (a peer died or timed out) ends as one line naming this rank ----
    def _collective(self, what: str, fn, *args):
        global collective_failed
        try:
            return fn(*args)
        except RuntimeError as exc:  # DistBackendError and gloo's timeouts are RuntimeErrors
            collective_failed = True
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise QerlError(f"rank {self.rank} of {self.world_size}: {what} failed ({first}): another rank died or "
                            f"hung (timeout {timeout_s():g} s, {TIMEOUT_ENV}); its log says why") from None

    def barrier(self) -> None:
        if self.enabled:
            self._collective("barrier", dist.barrier)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's (n, ...) tensor concatenated in rank order (equal n on every rank)."""
        if not self.enabled:
            return t
        dev = _comm_device()
        parts = [torch.empty_like(t, device=dev) for _ in range(self.world_size)]
        self._collective("all_gather", dist.all_gather, parts, t.to(dev).contiguous())
        return torch.cat(parts).to(t.device)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """A reduced copy of t (sum, max or min over ranks)."""
        if not self.enabled:
            return t
        out = t.detach().to(_comm_device(), copy=True).contiguous()
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        self._collective(f"all_reduce ({op})", dist.all_reduce, out, red)
        return out.to(t.device)

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the gradients of `params` over ranks in place (a missing gradient counts as zeros)."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params]):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self._collective("gradient all_reduce", dist.all_reduce, flat)
            _unflatten_into(flat, bucket)

    def broadcast_params(self, params: list[torch.nn.Parameter]) -> None:
        """Rank 0's values of `params` on every rank (the trainable state starts equal whatever each rank drew)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for bucket in _buckets([p.data for p in params]):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                self._collective("broadcast", dist.broadcast, flat, 0)
                _unflatten_into(flat, bucket)

    def from_main(self, value):
        """Rank 0's `value` (any picklable object) on every rank."""
        if not self.enabled:
            return value
        box = [value if self.is_main else None]
        self._collective("broadcast_object_list", dist.broadcast_object_list, box, 0)
        return box[0]

    def reduce_metrics(self, metrics: dict[str, float], *, sums: tuple[str, ...] = (),
                       maxima: tuple[str, ...] = ()) -> dict[str, float]:
        """The same dict on every rank: keys in `sums` summed, in `maxima` maxed, the rest averaged (every rank
        holds an equal share of rows and micro-batches, so the plain mean is the row-weighted one)."""
        if not self.enabled:
            return dict(metrics)
        keys = sorted(metrics)
        values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
        summed = self.all_reduce(values, "sum")
        maxed = self.all_reduce(values, "max")
        out = {}
        for i, k in enumerate(keys):
            out[k] = float(maxed[i]) if k in maxima else float(summed[i]) if k in sums else \
                float(summed[i]) / self.world_size
        return out


def _comm_device() -> torch.device:
    """Where collectives run: the current GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def _buckets(tensors: list[torch.Tensor]):
    """Consecutive runs of same-dtype, same-device tensors of about _BUCKET_BYTES each."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device
                       or size + t.numel() * t.element_size() > _BUCKET_BYTES):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


SINGLE = Ranks()


class Replicated:
    """Every rank holds the whole trainable state (LoRA modes, or one rank): the trainable gradients all-reduced
    explicitly, the engine rolls out the very model, checkpoints read the model and optimizer as they are. The
    sharded counterpart, for mode full on several ranks, is qerl.fsdp.FullySharded."""

    sharded = False

    def __init__(self, model: torch.nn.Module, ranks: Ranks):
        self.model, self.ranks = model, ranks

    @property
    def rollout_model(self) -> torch.nn.Module:
        return self.model

    def run(self, fn, *args):
        return fn(*args)

    def optimizer_options(self) -> dict:
        return {}

    def start(self, params: list[torch.nn.Parameter]) -> None:
        self.ranks.broadcast_params(params)  # rank 0's start, whatever each rank's init drew

    def reduce_and_clip(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        self.ranks.all_reduce_grads(params)
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    @contextlib.contextmanager
    def gathered(self):
        yield self.model

    def checkpoint_state(self, optimizer) -> None:
        return None  # qerl.checkpoint reads the model and optimizer itself

    restore = None


def init_ranks(num_gpus: int, num_nodes: int = 1) -> Ranks:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or the
    single-process world without one. train.num_nodes x train.num_gpus must match the launch."""
    world, expected = int(os.environ.get("WORLD_SIZE", "1")), num_nodes * num_gpus
    if world != expected:
        launch, what = f"torchrun --standalone --nproc-per-node {num_gpus} -m qerl.train", f"train.num_gpus is {num_gpus}"
        if expected == 1:
            launch = "python -m qerl.train"
        elif num_nodes > 1:
            launch = f"python -m qerl.launch --nodes {num_nodes} --nproc-per-node {num_gpus} -- ..."
            what = f"train.num_nodes x num_gpus is {num_nodes} x {num_gpus}"
        raise QerlError(f"{what} but this process was launched as one of {world} rank(s): "
                        f"run {launch} (the workflow's train rule does)")
    if world == 1:
        return SINGLE
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise QerlError(f"rank {rank}: LOCAL_RANK {local} but this node shows {torch.cuda.device_count()} "
                            f"GPU(s); train.num_gpus {os.environ.get('LOCAL_WORLD_SIZE', world)} needs as many "
                            "(CUDA_VISIBLE_DEVICES?)")
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s()),
                                device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s()))
        _share_cpus(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return Ranks(rank, world, local)


def _share_cpus(local_world: int) -> None:
    """CPU ranks of one node split its cores (each would otherwise start a thread per core)."""
    if not os.environ.get("QERL_NUM_THREADS"):
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))


collective_failed = False  # set by a failed collective: the interpreter's teardown may then abort in the backend


def exit_now_is_safer() -> bool:
    """A process group is still up, or a collective of this process failed: after the error line, exit without
    the interpreter's teardown, where gloo's threads can abort ("terminate called without an active exception")."""
    return collective_failed or (dist.is_available() and dist.is_initialized())


def close(ranks: Ranks) -> None:
    if ranks.enabled and dist.is_initialized():
        dist.destroy_process_group()
