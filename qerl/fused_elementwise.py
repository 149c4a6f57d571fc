"""RMSNorm, the gated MLP's SiLU(gate) * up and the log-prob head as torch.compile'd kernels in training.

    n = fuse_elementwise(model)     # every RMSNorm and SiLU-gated MLP that behaves as transformers' Llama/Qwen2,
                                    # and the output embedding's log-probs in qerl.grpo (chunked_head_logprobs)
    fuse_elementwise(model, False)  # the original forwards back

transformers' eager RMSNorm is seven kernels forward (fp32 copy, pow, mean, add + rsqrt, multiply, bf16 copy, times
the scale) and about as many again in backward, each over a (tokens, hidden) tensor, mostly in fp32; with gradient
checkpointing the forward runs twice. Under torch.compile (inductor) the same math is one kernel forward and one
backward; SiLU(gate) * up likewise; the log-probs and entropies of the lm_head chunks (target_logprobs) read the
bf16 logits a few times instead of making and re-reading an fp32 log-softmax. On a 7B GRPO update these
element-wise passes were ~40% of the GPU time (bf16 and FP4 alike: BENCHMARKS.md, "(c) One GRPO step").

The compiled path runs only while autograd records on CUDA tensors (training forward, its recomputation, backward);
no_grad calls (rollouts, whose engine compiles its own whole decode step, evaluation, reference log-probs) and CPU
tensors run the original forward. A module is swapped only if its original forward gives the reference result on
a small probe input (so a norm of another form, e.g. Gemma's (1 + weight), or an MLP of another shape is left
alone). Results match eager up to bf16 rounding (inductor computes the chain in fp32 and rounds once).
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from qerl.forward_swap import restore_forward, swap_forward

_ORIGINAL = "_qerl_unfused_forward"
_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # not FP8 scales, not packed FP4
_HEAD_MARK = "_qerl_fused_logprobs"  # on the output embedding: qerl.grpo's chunked log-probs use target_logprobs
DEVICE_TYPES = ("cuda",)  # where the compiled kernels run (inductor's CPU backend needs a C++ toolchain)
BACKEND = "inductor"  # torch.compile backend (tests on CPU use "aot_eager": the same autograd graphs, no codegen)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm: normalise in fp32, round to the input dtype, times the scale."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_COMPILED: dict[tuple[str, str], object] = {}


def _compiled(name: str):
    """The compiled function: shapes static except the token dimensions (_FUNCTIONS says which; marked dynamic on
    each call), so the model's widths are constants to inductor. H100: target_logprobs (256 x 152064) compiles
    in 8.7 s this way, 66 s with every dimension symbolic (dynamic=True)."""
    key = (name, BACKEND)
    if key not in _COMPILED:
        fn, token_dims = _FUNCTIONS[name]
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend=BACKEND)
        failed = []

        def call(*args):
            if failed:
                return fn(*args)
            for t, dims in zip(args, token_dims):
                for d in range(t.dim() - 1 if dims is None else dims):
                    torch._dynamo.maybe_mark_dynamic(t, d)
            try:
                return compiled(*args)
            # a failed compilation (InductorError and BackendCompilerFailed are TorchDynamoExceptions): the eager
            # ops still work; anything else, e.g. checkpoint's early-stop signal, passes through
            except torch._dynamo.exc.TorchDynamoException as exc:
                warnings.warn(f"qerl.fused_elementwise: torch.compile of {name} failed ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); eager ops from now on", RuntimeWarning, stacklevel=2)
                failed.append(exc)
                return fn(*args)

        _COMPILED[key] = call
    return _COMPILED[key]


def _use_compiled(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.device.type in DEVICE_TYPES and not torch.compiler.is_compiling()


def _norm_forward(module: nn.Module, original, hidden_states: torch.Tensor, *args, **kwargs):
    if args or kwargs or not _use_compiled(hidden_states):
        return original(hidden_states, *args, **kwargs)
    return _compiled("rms_norm")(hidden_states, module.weight, module.variance_epsilon)


def _gated_mlp(module: nn.Module, silu_mul, x: torch.Tensor) -> torch.Tensor:
    return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))


def _mlp_forward(module: nn.Module, original, x: torch.Tensor, *args, **kwargs):
    if args or kwargs or not _use_compiled(x):
        return original(x, *args, **kwargs)
    return _gated_mlp(module, _compiled("silu_mul"), x)


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and isinstance(getattr(
        module, "variance_epsilon", None), float) and not isinstance(module, nn.Linear))


def _is_silu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return (all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


def target_logprobs_reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """log softmax(logits / T)[target] and the (detached) entropy of softmax(logits / T), rows of (N, V) logits:
    qerl.grpo.TargetLogProb's result. Compiled, the forward is a few passes over the bf16 logits, the fp32 log-
    softmax never exists in memory, and backward is one pass writing the logits' gradient."""
    u = logits.float() / temperature
    logp_all = u - torch.logsumexp(u, dim=-1, keepdim=True)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy.detach()


def target_logprobs(head: nn.Module, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The compiled log-probs and entropies when `head` was marked by fuse_elementwise and autograd records on a
    device of DEVICE_TYPES; None otherwise (the caller's own path)."""
    if not (getattr(head, _HEAD_MARK, False) and _use_compiled(logits)):
        return None
    return _compiled("target_logprobs")(logits, targets, temperature)


# name -> (eager function, per tensor argument: how many leading dims are token dims, None = all but the last)
_FUNCTIONS = {"rms_norm": (rms_norm_reference, (None, 0)),
              "silu_mul": (silu_mul_reference, (None, None)),
              "target_logprobs": (target_logprobs_reference, (None, 1))}


@torch.no_grad()
def _behaves(original, replacement, probe: torch.Tensor) -> bool:
    """Does the module's own forward give the reference result on `probe`? (eager, a few tokens)"""
    try:
        want, got = original(probe), replacement(probe)
    except Exception:  # noqa: BLE001 - a module we cannot probe is left as it is
        return False
    if want.shape != got.shape:
        return False
    tol = 1e-5 if probe.dtype in (torch.float32, torch.float64) else 2e-2
    return bool(torch.allclose(want.float(), got.float(), rtol=tol, atol=tol * float(want.abs().max()) + 1e-6))


def _probe(module: nn.Module, width: int) -> torch.Tensor:
    tensors = list(module.parameters()) + list(module.buffers())
    ref = next((t for t in tensors if t.dtype in _COMPUTE_DTYPES), None)
    dtype = ref.dtype if ref is not None else torch.float32
    device = tensors[0].device if tensors else torch.device("cpu")
    gen = torch.Generator(device="cpu").manual_seed(0)
    return torch.randn(3, width, generator=gen).to(device=device, dtype=dtype)


def _mlp_width(module: nn.Module) -> int | None:
    layer = module.gate_proj
    base = getattr(layer, "base_layer", layer)
    return getattr(base, "in_features", None)


def fuse_elementwise(model: nn.Module, enabled: bool = True, names: Collection[str] | None = None) -> int:
    """Swap the forward of every RMSNorm and SiLU-gated MLP of `model` for the compiled one (enabled) or put the
    originals back (False); returns how many modules run the compiled forward now (enabled) or were restored.
    Modules with another instance forward are skipped, and a fused module wrapped since (an MLP tiled by
    qerl.tiled_mlp) stays as it is: fuse before tiling, untile before unfusing. names: swap just these modules
    (of those kinds) unprobed, as fused_names of the same model elsewhere gave (here its weights may be on the
    meta device)."""
    count = 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        count += enabled or bool(getattr(head, _HEAD_MARK, False))
        setattr(head, _HEAD_MARK, enabled)
    for name, module in model.named_modules():
        if hasattr(module, _ORIGINAL):
            if getattr(module.forward, "func", None) not in (_norm_forward, _mlp_forward):
                count += enabled  # wrapped again since (qerl.tiled_mlp's tiles): left as it is, still fused
                continue
            restore_forward(module, _ORIGINAL)
            count += not enabled
        if not enabled:
            continue
        if "forward" in vars(module):  # someone else's instance forward (e.g. qerl.tiled_mlp): left alone
            continue
        if _is_rms_norm(module):
            width, fused = module.weight.shape[0], _norm_forward
            reference = functools.partial(rms_norm_reference, weight=module.weight, eps=module.variance_epsilon)
        elif _is_silu_mlp(module) and _mlp_width(module):
            width, fused = _mlp_width(module), _mlp_forward
            reference = functools.partial(_gated_mlp, module, silu_mul_reference)
        else:
            continue
        original = module.forward
        if not (name in names if names is not None else _behaves(original, reference, _probe(module, width))):
            continue
        swap_forward(module, _ORIGINAL, functools.partial(fused, module, original))
        count += 1
    return count


def fused_names(model: nn.Module) -> list[str]:
    """The modules of `model` whose forward fuse_elementwise swapped, by name."""
    return [name for name, m in model.named_modules() if hasattr(m, _ORIGINAL)]


def fused_modules(model: nn.Module) -> int:
    """How many modules of `model` run the compiled forward now (the output embedding counts when its log-probs
    are compiled)."""
    return sum(hasattr(m, _ORIGINAL) or bool(getattr(m, _HEAD_MARK, False)) for m in model.modules())
