"""Rough GPU memory of one training rank, so config validation refuses an experiment that cannot fit its GPUs.

    python -m qerl.config memory config/config.yaml      # GiB per rank and the GPUs each experiment needs

Per rank, for the Qwen2.5 shapes of `model_size` (SmolLM2-135M for 0.1B); S = max_prompt_length +
max_completion_length, the longest row; D = bytes of train.dtype (4 for float32, else 2):
  weights      linear layers x the scheme's bytes per parameter (bf16: D; nvfp4: 4.5 bits; mxfp4: 4.25; nf4:
               4.127) + embeddings and lm_head in D bytes. mode full: every parameter x 4 D (weight, gradient and
               AdamW's two states in the model's dtype) / N ranks (num_nodes x num_gpus): FSDP2 shards them; the
               gradient (1 D of the 4) is freed before each rollout
  adapter      LoRA parameters (r x (in + out) of each target projection of each layer) x 16 (fp32 weight,
               gradient and AdamW's two states)
  rollout      torch engine: its static KV cache holds every row of the rank at once, rows x S x 2 x layers x
               kv_heads x head_dim x D; vllm: rollout.gpu_memory_utilization of the card; paged: 0, since its pool
               takes that fraction of the memory left free and goes back before the update (it must hold one
               whole row: S x 2 x layers x kv_heads x head_dim x D, checked apart)
  gathered     mode full on N > 1 ranks: the whole model gathered for the rollout engine, every parameter x D; it
               is freed before the update, so it counts against activations + the update's gathered FSDP units
               (embeddings and lm_head, two decoder layers, each with its unsharded gradient: x 2 D), not beside.
               With rollout.weights nvfp4 one tensor or fused group is gathered at a time to be quantized or
               copied: the larger of the embedding matrix and one decoder layer's Linears, x D
  fp4_copy     rollout.weights nvfp4 (qerl.fp4_rollout): the rollout copy, linear layers x 4.5 bits + embeddings
               and lm_head x D, kept through the update (its addresses stay for the engines' graphs): beside
  activations  micro_batch_size x S tokens x [gradient checkpointing: layers x hidden x D (each layer's saved
               input; none with offload_activations) + one layer's saved tensors (6 hidden + 4 intermediate /
               mlp_chunks) x D; without: layers x those tensors] + the lm_head chunk (logprob_chunk_size x vocab
               x 12 bytes: fp32 log-softmax, its gradient and the entropy buffer)
  overhead     3 GiB (CUDA context, allocator slack, NCCL buffers)
Two phases: update_total = weights + adapter + rollout + fp4_copy + activations + overhead; rollout_total = the same
with gathered for activations, less mode full's gradient. total = the larger.
A card is taken as 80 GiB, a node as 8 of them. The estimate is rough (within tens of percent); it exists to refuse
what cannot fit, and to name how many GPUs (and nodes) an experiment needs.

Host memory of a train job, per node (the train rule's SLURM --mem): train_job_mem_mb, from which ranks hold a
whole model on the host (see its docstring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GPU_GIB = 80.0
MAX_GPUS_PER_NODE = 8  # train.num_gpus: the ranks of one node
MAX_NODES = 64  # train.num_nodes
OVERHEAD_GIB = 3.0
_GIB = 2**30
_BITS = {"nvfp4": 4.5, "nvfp4-awq": 4.5, "mxfp4": 4.25, "nf4": 4.127}  # 4-bit codes + their block scales


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    def projections(self) -> dict[str, tuple[int, int]]:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.projections().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)


SHAPES = {  # config.json of each Qwen2.5-*-Instruct (and SmolLM2-135M-Instruct for the CPU demo)
    "0.1B": Shape(576, 1536, 30, 9, 3, 64, 49152, True),
    "0.5B": Shape(896, 4864, 24, 14, 2, 64, 151936, True),
    "1.5B": Shape(1536, 8960, 28, 12, 2, 128, 151936, True),
    "3B": Shape(2048, 11008, 36, 16, 2, 128, 151936, True),
    "7B": Shape(3584, 18944, 28, 28, 4, 128, 152064, False),
    "14B": Shape(5120, 13824, 48, 40, 8, 128, 152064, False),
    "32B": Shape(5120, 27648, 64, 40, 8, 128, 152064, False),
}


def ranks_of(train) -> int:
    """Every node's ranks: the data-parallel world of a qerl.config.TrainConfig."""
    return train.num_nodes * train.num_gpus


def rank_memory_gib(shape: Shape, scheme: str, train, ranks: int) -> dict[str, float]:
    """The estimate's terms (GiB) for one of `ranks` ranks in all (over every node); `train` is a
    qerl.config.TrainConfig."""
    d = 4 if train.dtype == "float32" else 2
    tokens = train.max_prompt_length + train.max_completion_length
    params = shape.linear_params + shape.embedding_params
    sharded = train.mode == "full" and ranks > 1
    fp4 = sharded and train.rollout.weights == "nvfp4"
    gathered = (max(shape.vocab * shape.hidden, shape.linear_params / shape.layers) if fp4 else params) * d \
        if sharded else 0.0
    fp4_copy = shape.linear_params * _BITS["nvfp4"] / 8 + shape.embedding_params * d if fp4 else 0.0
    # what FSDP holds unsharded during the update: the root unit (embeddings, lm_head) and a layer plus the
    # prefetched next one, each with its gradient before the reduce-scatter
    units = (shape.embedding_params + 2 * shape.linear_params / shape.layers) * 2 * d if sharded else 0.0
    grads = 0.0
    if train.mode == "full":
        weights = params * 4 * d / ranks
        grads = params * d / ranks  # set to None after each optimizer step: absent while the engine rolls out
        adapter = 0.0
    else:
        weights = shape.linear_params * (_BITS[scheme] / 8 if scheme in _BITS else d) + shape.embedding_params * d
        dims = shape.projections()
        lora = sum(train.lora.lora_r * sum(dims[m]) for m in train.lora.target_modules if m in dims)
        adapter = shape.layers * lora * 16
    if train.rollout.engine == "vllm":
        rollout = train.rollout.gpu_memory_utilization * GPU_GIB * _GIB
    elif train.rollout.engine == "paged":
        rollout = 0.0
    else:
        rows = train.batch_size * train.num_generations // ranks
        rollout = rows * tokens * 2 * shape.layers * shape.kv_heads * shape.head_dim * d
    layer = (6 * shape.hidden + 4 * shape.intermediate / train.mlp_chunks) * d
    if train.gradient_checkpointing:
        saved_inputs = 0 if train.offload_activations else shape.layers * shape.hidden * d
        per_token = saved_inputs + layer
    else:
        per_token = shape.layers * layer
    activations = train.micro_batch_size * tokens * per_token + train.logprob_chunk_size * shape.vocab * 12 + units
    terms = {"weights": weights, "adapter": adapter, "rollout": rollout, "fp4_copy": fp4_copy, "gathered": gathered,
             "activations": activations}
    out = {k: v / _GIB for k, v in terms.items()}
    out["overhead"] = OVERHEAD_GIB
    # the gathered copy lives during rollouts, the activations during the update; the FP4 copy through both
    both = out["weights"] + out["adapter"] + out["rollout"] + out["fp4_copy"] + OVERHEAD_GIB
    out["update_total"] = both + out["activations"]
    out["rollout_total"] = both - grads / _GIB + out["gathered"]
    out["total"] = max(out["update_total"], out["rollout_total"])
    return out


def valid_gpu_counts(train, limit: int = MAX_GPUS_PER_NODE) -> list[int]:
    """Rank counts that split the step into whole prompt groups and whole micro-batches."""
    rows = train.batch_size * train.num_generations
    return [n for n in range(1, limit + 1)
            if train.batch_size % n == 0 and (rows // n) % train.micro_batch_size == 0]


def gpus_needed(shape: Shape, scheme: str, train) -> tuple[int, int] | None:
    """The fewest ranks that each fit a card (and, paged, whose KV pool holds a whole row), as (nodes, GPUs per node)
    with at most 8 on a node and the fewest nodes; None when no layout up to MAX_NODES nodes does.
    rollout.weights nvfp4 needs several ranks (FSDP2)."""
    for n in valid_gpu_counts(train, MAX_GPUS_PER_NODE * MAX_NODES):
        if n == 1 and train.rollout.weights == "nvfp4":
            continue
        est = rank_memory_gib(shape, scheme, train, n)
        pool, row = _pool_and_row(shape, train, est)
        if est["total"] <= GPU_GIB and (train.rollout.engine != "paged" or pool >= row):
            nodes = -(-n // MAX_GPUS_PER_NODE)
            while n % nodes:
                nodes += 1
            return nodes, n // nodes
    return None


def _layout(train) -> str:
    return f"num_gpus {train.num_gpus}" if train.num_nodes == 1 else \
        f"num_nodes x num_gpus {train.num_nodes} x {train.num_gpus}"


def check_fits(model_size: str | None, scheme: str, train) -> None:
    """Raise ValueError naming the GPUs needed when the experiment cannot fit its num_nodes x num_gpus cards;
    experiments without a model_size of known shape are not estimated."""
    if train.mode == "full" and ranks_of(train) > 1 and getattr(train, "optim", "adamw_torch") != "adamw_torch":
        raise ValueError(f"mode full on {ranks_of(train)} GPUs shards the optimizer states with FSDP2 (qerl/fsdp.py), "
                         f"which train.optim {train.optim}'s 8-bit states do not support: set optim: adamw_torch")
    shape = SHAPES.get(model_size or "")
    if shape is None:
        return
    est = rank_memory_gib(shape, scheme, train, ranks_of(train))
    if est["total"] <= GPU_GIB:
        if train.rollout.engine == "paged":
            _check_pool_holds_a_row(shape, train, est)
        return
    parts = ", ".join(f"{k} {est[k]:.0f}" for k in ("weights", "adapter", "rollout", "fp4_copy", "gathered",
                                                    "activations") if k not in ("gathered", "fp4_copy") or est[k])
    head = (f"needs ~{est['total']:.0f} GiB per GPU with {_layout(train)} ({parts} GiB; "
            f"qerl/memory.py), more than an {GPU_GIB:.0f} GiB card")
    need = gpus_needed(shape, scheme, train)
    if need is not None:
        nodes, per_node = need
        raise ValueError(f"{head}: set " + (f"num_gpus: {per_node}" if nodes == train.num_nodes == 1 else
                                            f"num_nodes: {nodes} and num_gpus: {per_node}"))
    raise ValueError(f"{head}, and no layout up to {MAX_NODES} nodes of {MAX_GPUS_PER_NODE} GPUs fits: lower "
                     "micro_batch_size, max_completion_length or batch_size, or use gradient_checkpointing / "
                     "offload_activations")


def _pool_and_row(shape: Shape, train, est: dict[str, float]) -> tuple[float, float]:
    """GiB of the paged pool (a fraction of what the weights and rollout copy leave free) and of one whole row."""
    d = 4 if train.dtype == "float32" else 2
    row = (train.max_prompt_length + train.max_completion_length) * 2 * shape.layers * shape.kv_heads \
        * shape.head_dim * d / _GIB
    pool = train.rollout.gpu_memory_utilization * (GPU_GIB - est["rollout_total"] + est["rollout"])
    return pool, row


def _check_pool_holds_a_row(shape: Shape, train, est: dict[str, float]) -> None:
    """The scheduler needs room for one whole row in the paged pool."""
    pool, row = _pool_and_row(shape, train, est)
    if pool < row:
        raise ValueError(f"rollout.gpu_memory_utilization {train.rollout.gpu_memory_utilization}: a ~{pool:.1f} GiB "
                         f"KV pool cannot hold one row of max_prompt_length + max_completion_length tokens "
                         f"({row:.1f} GiB); raise it or shorten the rows")


CPU_SIZED = frozenset({"0.1B"})  # model sizes the rules run on the CPU (the demo); no model_size counts as one


def needs_gpu(model_size: str | None) -> bool:
    """Whether the stages of an experiment of this model_size ask for a GPU (the rules' `gpu` resource)."""
    return bool(model_size) and model_size not in CPU_SIZED


PROCESS_MIB = 4096  # a rank's process without a model on the host (~2.6 GiB measured: torch, CUDA, NCCL, compile)


def model_mib(model_size: str | None, dtype: str) -> float | None:
    """The whole model in train.dtype (MiB), or None without a known shape ("auto" trains in bf16 on a GPU)."""
    shape = SHAPES.get(model_size or "")
    if shape is None:
        return None
    return (shape.linear_params + shape.embedding_params) * (4 if dtype == "float32" else 2) / 2**20


def train_job_mem_mb(train, model_size: str | None, rank_mb: int) -> int:
    """SLURM --mem (MiB) of a train job: per node and one value for all its nodes, so the fullest node's need.
    rank_mb is a one-rank job's (its process and the model read into host memory); num_nodes changes nothing.
      CPU-sized model_size: the ranks' weights, states and activations are all host memory: num_gpus x rank_mb
      LoRA modes, or one rank: every rank, on every node, reads its own base (load_policy): num_gpus x rank_mb
      mode full on N > 1 ranks (FSDP2): global rank 0 alone reads the checkpoint (qerl.train: the others build
        on the meta device, local ranks 0 of other nodes too) and gathers each checkpoint's weights and AdamW's two
        states onto its host (3 x the model in train.dtype, qerl.fsdp.FullySharded.checkpoint_state); every
        other rank holds its process: max(rank_mb, 3 x model + PROCESS_MIB) + (num_gpus - 1) x PROCESS_MIB
    A model of unknown shape counts as rank_mb / 2 (the rules size a one-rank job as about two copies of it)."""
    if not needs_gpu(model_size) or train.mode != "full" or ranks_of(train) == 1:
        return rank_mb * train.num_gpus
    model = model_mib(model_size, train.dtype) or rank_mb / 2
    rank0 = max(rank_mb, 3 * model + PROCESS_MIB)
    return math.ceil(rank0 + (train.num_gpus - 1) * PROCESS_MIB)


_COLUMNS = ("weights", "adapter", "rollout", "gathered", "fp4_copy", "activations")


def report_header() -> str:
    return (f"{'experiment':32s} {'runs on':7s} {'ranks':>5s} {'GiB/rank':>8s}  "
            + " ".join(f"{c:>11s}" for c in _COLUMNS) + f"  GPUs needed ({GPU_GIB:.0f} GiB cards; NxG: N nodes of G)")


def report_line(name: str, model_size: str | None, scheme: str, train) -> str | None:
    """One experiment's estimate for `python -m qerl.config memory`, or None without a known shape. A CPU-sized
    experiment (the demo) shows the same terms, as host memory."""
    shape = SHAPES.get(model_size or "")
    if shape is None:
        return None
    est = rank_memory_gib(shape, scheme, train, ranks_of(train))
    terms = " ".join(f"{est[c]:11.1f}" for c in _COLUMNS)
    if not needs_gpu(model_size):
        return f"{name:32s} {'CPU':7s} {ranks_of(train):5d} {est['total']:8.1f}  {terms}  none (host memory)"
    need = gpus_needed(shape, scheme, train)
    shown = f">{MAX_NODES}x{MAX_GPUS_PER_NODE}" if need is None else str(need[1]) if need[0] == 1 else \
        f"{need[0]}x{need[1]}"  # nodes x GPUs per node
    return f"{name:32s} {'GPU':7s} {ranks_of(train):5d} {est['total']:8.1f}  {terms}  {shown}"
