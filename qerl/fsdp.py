"""Full-parameter training over N ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`).

    torchrun --standalone --nproc-per-node 2 -m qerl.train --experiment qwen7b-bf16-full ...   # mode full, num_gpus 2

train.mode full on more than one rank: every decoder layer is one FSDP unit and the root (embeddings, final norm,
lm_head: tied weights need one unit) another, sharded along dim 0 over a 1-D mesh of all ranks, so parameters,
gradients and AdamW states take 1/N of a rank each. The rest is qerl.distributed's data parallelism: each rank
rolls out and scores its share of the step's prompt groups, the loss is normalised by the whole step's counts.
  gradients    reduce-scattered as sums after every micro-batch's backward and accumulated into the sharded
               gradient (a whole model's gradient never exists on a rank); clip_grad_norm_ on the DTensor shards
               sums the squares over ranks, so clipping sees the 1-rank norm.
  forward      the trainer runs the decoder body and lm_head chunks itself (qerl.grpo), never the model's forward,
               so the root's hook would never gather the embeddings and lm_head: `qerl_run` is registered as an
               FSDP forward method of the root and every log-prob computation goes through it. The root stays
               gathered from its forward to its backward (lm_head runs per chunk, and again in each recomputation).
  rollout      GatheredPolicy: a plain copy of the model (no FSDP hooks, so the engines' CUDA graphs, compilation,
               AQN noise and attention swaps see one GPU's model) whose weights are all-gathered from the shards one
               parameter at a time before each rollout and freed before the update. Peak memory is the lowest of
               the workable choices: gathering in place (FSDP's unshard) holds the same whole model during the
               rollout, a copy kept through the update adds a whole model to the update's peak, and decoding
               through FSDP's per-layer gathers would all-gather the whole model once per generated token.
               train.rollout.weights nvfp4: qerl.fp4_rollout.FP4RolloutCopy instead, the decoder layers' Linears
               quantized to NVFP4 from the shards a layer's group at a time, in place, kept through the update.
  loading      rank 0 alone reads the checkpoint (qerl.train); the other ranks build the model on the meta device.
               After sharding, set_model_state_dict (full state dict, broadcast from rank 0) sends rank 0's
               tensors one at a time and each rank keeps its shards, then rank 0's buffers (rotary frequencies:
               in no state dict) are broadcast whole. Host memory: one whole model on rank 0, its shards on the
               others, instead of a whole model per rank. Forward swaps that probe the weights before sharding
               (qerl.fused_elementwise) follow rank 0's probe on every rank.
  checkpoints  get_model_state_dict / get_optimizer_state_dict (full_state_dict, cpu_offload) gather the state
               on rank 0, which writes it in qerl.checkpoint's one-rank format (tensors by name, optimizer state
               by parameter index): a checkpoint resumes under any rank count, FSDP or not; loading broadcasts
               rank 0's tensors and each rank keeps its shards.
"""
from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch import nn

from qerl.checkpoint import IMPLEMENTATION_KEYS
from qerl.distributed import Ranks, Replicated
from qerl.errors import QerlError
from qerl.plain_copy import full_tensor, meta_copy, share_buffers


def sharded(cfg, ranks: Ranks) -> bool:
    """Does this run shard its model with FSDP2 (mode full on several ranks; cfg: the train section)? Then rank 0
    alone loads the weights."""
    return ranks.enabled and cfg.mode == "full"


def data_parallel(model: nn.Module, cfg, ranks: Ranks):
    """How the ranks share this model's training (cfg: the train section): FSDP2 for mode full on several ranks,
    else replicas."""
    weights = cfg.rollout.weights  # "nvfp4": the config allows it only where the model is sharded
    if not sharded(cfg, ranks):
        return Replicated(model, ranks)
    if getattr(cfg, "optim", "adamw_torch") != "adamw_torch":
        raise QerlError(f"train.optim {cfg.optim} with mode full on {ranks.world_size} GPUs: its states do not "
                        "shard under FSDP2; use optim adamw_torch (or num_gpus 1)")
    return FullySharded(model, ranks, rollout_weights=weights)


def fuse_as_rank0(model: nn.Module, cfg, ranks: Ranks) -> int:
    """qerl.fused_elementwise's swaps; sharded, the modules rank 0's probe picked on every rank (the other ranks'
    weights are on the meta device until FullySharded fills them). A collective when sharded."""
    from qerl import fused_elementwise as fused

    if not sharded(cfg, ranks):
        return fused.fuse_elementwise(model)
    count = fused.fuse_elementwise(model) if ranks.is_main else 0
    names = ranks.from_main(fused.fused_names(model) if ranks.is_main else None)
    return count if ranks.is_main else fused.fuse_elementwise(model, names=names)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer (a module with both self_attn and mlp), in order."""
    layers = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
    if not layers:
        raise QerlError(f"model {type(model).__name__}: no decoder layers (self_attn + mlp) to shard")
    return layers


def _run(self, fn, *args):
    """fn(*args) inside the root's FSDP forward (its parameters gathered, its backward hooks armed)."""
    # outputs that are views are copied: FSDP arms its pre-backward hook on them, which an in-place op on a view
    # would drop (torch warns about every view)
    return tuple(t.clone() if isinstance(t, torch.Tensor) and t._base is not None else t for t in fn(*args))


class GatheredPolicy:
    """A plain, hook-free copy of a model for the rollout engine: each parameter its own storage, allocated by
    gather() from the sharded model's full tensors and freed by release(); buffers are the model's own."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.module = meta_copy(model)
        sources = dict(model.named_parameters())
        self.params: dict[str, nn.Parameter] = {}
        made: dict[int, nn.Parameter] = {}
        for module in self.module.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) not in made:  # tied weights stay one parameter
                    made[id(p)] = nn.Parameter(torch.empty(0), requires_grad=False)
                if p is not None:
                    module._parameters[key] = made[id(p)]
        for name, p in self.module.named_parameters():
            if name not in sources:
                raise QerlError(f"GatheredPolicy: {name} of the plain {type(model).__name__} is not in the model")
            src = sources[name]
            p.data = torch.empty(src.shape, dtype=src.dtype, device=device)
            p.untyped_storage().resize_(0)  # shape, dtype and device only, until gather()
            self.params[name] = p

    def bind_buffers(self, model: nn.Module) -> None:
        """Share the model's buffers (rotary frequencies; FSDP leaves buffers whole), once it sits on its device."""
        share_buffers(self.module, model)

    @torch.no_grad()
    def gather(self, model: nn.Module) -> None:
        """Every parameter's full tensor from the shards (an all-gather each: one parameter in flight at a time)."""
        sources = dict(model.named_parameters())
        for name, p in self.params.items():
            storage = p.untyped_storage()
            storage.resize_(p.numel() * p.element_size())
            src = sources[name]
            p.copy_(full_tensor(src))

    def release(self) -> None:
        for p in self.params.values():
            p.untyped_storage().resize_(0)


class FullySharded:
    """mode full on several ranks: the model sharded by FSDP2 in place (see the module docstring)."""

    sharded = True

    def __init__(self, model: nn.Module, ranks: Ranks, rollout_weights: str = "policy"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        self.ranks = ranks
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        if rollout_weights == "nvfp4":
            from qerl.fp4_rollout import FP4RolloutCopy as copy_class
        else:
            copy_class = GatheredPolicy
        self.copy = copy_class(model, device)  # from the plain class, before fully_shard swaps the model's
        # rank 0's whole tensors, kept past the sharding below (references, no copy); the model is rank 0's
        full = model.state_dict() if ranks.is_main else {}
        mesh = init_device_mesh(device.type, (ranks.world_size,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        # the root is needed again right after its forward (lm_head chunks, then backward): not freed in between
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # sums: the loss is already normalised by global counts
                module.set_force_sum_reduction_for_comms(True)  # gloo has no AVG; NCCL's SUM is zero-copy too
        model.qerl_run = types.MethodType(_run, model)
        register_fsdp_forward_method(model, "qerl_run")
        self.model = model
        self._receive(full, device)
        del full
        self.copy.bind_buffers(model)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]

    def _receive(self, full: dict, device: torch.device) -> None:
        """Rank 0's weights into every rank's shards and its buffers whole (a collective: every rank calls)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if any(t.is_meta for t in (*self.model.parameters(), *self.model.buffers())):
            self.model.to_empty(device=device)  # this rank's shards and the buffers, allocated: filled below
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        self.ranks._collective("weights from rank 0", functools.partial(set_model_state_dict, options=options),
                               self.model, full)
        self.ranks.broadcast_params(list(self.model.buffers()))  # non-persistent ones are in no state dict

    def _optimizer_names(self, optimizer) -> list[str]:
        """Parameter names in the optimizer's order: what its state dict's indices count (groups one after
        the other)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]

    @property
    def rollout_model(self) -> nn.Module:
        return self.copy.module

    def run(self, fn, *args):
        return self.model.qerl_run(fn, *args)

    def optimizer_options(self) -> dict:
        return {"foreach": True}  # DTensor shards: foreach kernels (torchtitan's choice)

    def start(self, params) -> None:
        """Nothing to broadcast: every rank's shards came from rank 0's weights."""

    def reduce_and_clip(self, params, max_norm: float) -> float:
        """Clip by the whole gradient's norm (its shards were reduce-scattered by each backward)."""
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(full_tensor(norm))

    @contextlib.contextmanager
    def gathered(self):
        """The whole model as a plain module while inside (a collective: every rank enters)."""
        self.copy.gather(self.model)
        try:
            yield self.copy.module
        finally:
            self.copy.release()

    def checkpoint_state(self, optimizer) -> tuple[dict, dict] | None:
        """(tensors by name, optimizer state by index) on rank 0, None elsewhere (a collective: every rank calls)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=options)
        optim = get_optimizer_state_dict(self.model, optimizer, options=options)
        if not self.ranks.is_main:
            return None
        index = {n: i for i, n in enumerate(self._optimizer_names(optimizer))}
        return ({n: weights[n] for n in self.names},
                {"state": {index[n]: s for n, s in optim["state"].items()},
                 "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]]})

    def restore(self, tensors: dict, optim: dict, optimizer) -> None:
        """Load a checkpoint of the one-rank format: rank 0's tensors broadcast (the other ranks' are not read),
        each rank keeps its shards (a collective: every rank calls)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        main = self.ranks.is_main
        missing = [n for n in self.names if n not in tensors] if main else []
        if missing:  # rank 0 stops; the others end at the next collective's timeout or with torchrun
            raise QerlError(f"checkpoint lacks {len(missing)} trained tensor(s) of this model, e.g. {missing[0]}")
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(self.model, {n: tensors[n] for n in self.names} if main else {}, options=options)
        order = self._optimizer_names(optimizer)
        groups = [{**g, "params": [order[i] for i in g["params"]],
                   **{k: mine[k] for k in IMPLEMENTATION_KEYS if k in mine}}
                  for g, mine in zip(optim["param_groups"], optimizer.param_groups)]
        by_name = {"state": {order[i]: s for i, s in optim["state"].items()}, "param_groups": groups}
        set_optimizer_state_dict(self.model, optimizer, by_name if main else {}, options=options)
