"""Padding-free update forwards: a micro-batch's rows packed end to end into one sequence, attention kept inside each
row by a variable-length kernel (verl's remove-padding, TRL's padding_free).

    lp, ent = packed_token_logprobs(model, input_ids, attention_mask, logits_to_keep, temperature=1.0)
    with packed_attention(model):   # gradient checkpointing recomputes the layers in backward: same attention there
        loss.backward()

The padded forward computes every pad position (left-padded prompts, right-padded completions) and, under a
padding mask, runs PyTorch's memory-efficient attention. Packed rows hold only real tokens, and on CUDA in half
precision attention is flash's varlen kernel (`torch.nn.attention.varlen`); elsewhere causal SDPA row by row.
The head scores only real completion tokens. Same log-probs as `qerl.grpo.token_logprobs` (to rounding).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from qerl.errors import QerlError
from qerl.grpo import chunked_head_logprobs, split_causal_lm

log = logging.getLogger("qerl.train")
NAME = "qerl_packed"
_ORIGINAL: ContextVar[str | None] = ContextVar("qerl_packed_original", default=None)
_CALLS: ContextVar[list | None] = ContextVar("qerl_packed_calls", default=None)
_HALF = (torch.bfloat16, torch.float16)


def unsupported_reason(model) -> str | None:
    """Why this model's forward cannot be packed, or None: sliding-window layers would need the window per row, and
    unpacked calls inside packed_attention run SDPA (or eager) with their masks."""
    config = model.config
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"its attention implementation {config._attn_implementation!r} (packing wants sdpa or eager)"
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return None if all(k == "full_attention" for k in kinds) else f"its layer_types {sorted(set(kinds))}"
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return f"its sliding_window {config.sliding_window}" if window else None


@functools.cache
def _varlen_options() -> tuple[bool, bool] | None:
    """(GQA taken natively, causal as an is_causal flag) of this torch's varlen_attn; None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    names = inspect.signature(varlen_attn).parameters
    return "enable_gqa" in names, "is_causal" in names


def _flash_rows(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, longest: int, scale: float | None) -> Tensor:
    """(T, Hq, D) causal attention of packed rows with flash's varlen kernel."""
    from torch.nn.attention.varlen import varlen_attn

    gqa, flag = _varlen_options()
    options = {"is_causal": True} if flag else {"window_size": (-1, 0)}  # (-1, 0): causal in torch >= 2.11's API
    if gqa:
        options["enable_gqa"] = True
    elif key.shape[1] != query.shape[1]:  # this torch's wrapper wants equal heads: repeat each KV head
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    return varlen_attn(query, key, value, cu, cu, longest, longest, scale=scale, **options)


def _sdpa_rows(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    """(1, Hq, T, D) inputs, (1, T, Hq, D) output: causal SDPA over each row's slice (CPU, fp32 and fp64)."""
    bounds = cu.tolist()
    outs = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                           scale=scale, enable_gqa=key.shape[1] != query.shape[1])
            for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(outs, dim=2).transpose(1, 2)


def packed_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                             dropout: float = 0.0, sliding_window=None, **kwargs):
    """transformers' attention interface: packed rows when the call carries their bounds (cu_seq_lens_q), else the
    model's own implementation (e.g. a padded forward recomputed in the same backward)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        inner = ALL_ATTENTION_FUNCTIONS.get(configured_implementation(), sdpa_attention_forward)
        return inner(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                     sliding_window=sliding_window, **kwargs)
    if sliding_window is not None or dropout:
        raise QerlError("padding-free attention takes neither a sliding window nor dropout; set train.padding_free: "
                        "false")
    calls = _CALLS.get()
    if calls is not None:
        calls.append(module)
    if query.shape[0] != 1:
        raise QerlError(f"packed rows come as one sequence, got a batch of {query.shape[0]}")
    if query.is_cuda and query.dtype in _HALF and query.shape[-1] <= 256 and _varlen_options() is not None:
        out = _flash_rows(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu,
                          kwargs["max_length_q"], scaling)
        return out.unsqueeze(0), None
    return _sdpa_rows(query, key, value, cu, scaling), None


def configured_implementation() -> str:
    """The attention implementation unpacked calls run inside packed_attention (the model's own)."""
    return _ORIGINAL.get() or "sdpa"


def _mask(*args, attention_mask=None, **kwargs):
    """None for packed forwards (each row's bounds travel as cu_seq_lens); an unpacked one's mask as its own
    implementation builds it."""
    if attention_mask is None:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[configured_implementation()](*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, packed_attention_forward)
AttentionMaskInterface.register(NAME, _mask)


@contextlib.contextmanager
def packed_attention(model):
    """Attention through packed_attention_forward, the model's own implementation kept for unpacked calls."""
    config = model.config
    previous = config._attn_implementation
    if previous == NAME:  # nested: the outer scope holds the original
        yield
        return
    token = _ORIGINAL.set(previous)
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
        _ORIGINAL.reset(token)


def _checkpointed(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def packed_token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *,
                          temperature: float = 1.0, chunk_size: int = 512) -> tuple[Tensor, Tensor]:
    """`qerl.grpo.token_logprobs` over the rows packed: (logprobs (B, keep) with grad, entropy (B, keep) detached),
    0 at pad positions. Rows are TRL's (left-padded prompt, right-padded completion); each row's real tokens keep
    the positions they had (cumsum(mask) - 1). With gradient checkpointing, backward must run under
    packed_attention(model) (checked when backward reaches the decoder's output)."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise QerlError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                        "must both be (batch, length)")
    keep = logits_to_keep
    if not 0 < keep < input_ids.shape[1] or temperature <= 0:
        raise QerlError(f"logits_to_keep must be in [1, {input_ids.shape[1] - 1}] and temperature > 0, got {keep} "
                        f"and {temperature}")
    body, head = split_causal_lm(model)
    real = attention_mask.bool()
    completion = real[:, -keep:]
    lengths = real.sum(dim=1)
    stats = torch.stack([lengths.max(), (~real[:, :-keep].any(dim=1)).sum(), lengths.sum(), completion.sum()])
    longest, promptless, tokens, scored = stats.tolist()  # the only host read: every index below is built on device
    if promptless:
        raise QerlError(f"{promptless} row(s) without a prompt token: their first completion token has no state")
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    where = _true_positions(real.reshape(-1), tokens)  # the real tokens' flat positions, in order
    index = real.reshape(-1).long().cumsum(0).view_as(real) - 1  # each real token's place in the packed row
    scored_at = _true_positions(completion.reshape(-1), scored)
    states = index[:, -keep:].reshape(-1)[scored_at] - 1  # a completion token is scored by the state before it
    targets = input_ids[:, -keep:].reshape(-1)[scored_at]
    positions = (real.long().cumsum(1) - 1).reshape(-1)[where]
    calls: list = []
    token = _CALLS.set(calls)
    try:
        with packed_attention(model):
            hidden = body(input_ids=input_ids.reshape(-1)[where][None], position_ids=positions[None],
                          use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest,
                          max_length_k=longest).last_hidden_state
    finally:
        _CALLS.reset(token)
    if not calls:
        raise QerlError(f"{type(body).__name__} did not route attention through transformers' attention interface "
                        "with the packed rows' bounds; set train.padding_free: false")
    if hidden.requires_grad and _checkpointed(model):
        config = model.config
        hidden.register_hook(functools.partial(_check_backward_scope, config))
    lp, ent = chunked_head_logprobs(head, hidden[0].index_select(0, states), targets, temperature, chunk_size)
    grid = completion.numel()
    return (lp.new_zeros(grid).index_copy(0, scored_at, lp).view_as(completion),
            ent.new_zeros(grid).index_copy(0, scored_at, ent).view_as(completion))


def _true_positions(flags: Tensor, count: int) -> Tensor:
    """The positions of the `count` set entries of a 1-D bool tensor, in order, without a host read (nonzero and
    boolean indexing wait for the GPU): each set entry scatters its position to its rank; the others to a spare
    slot past the end."""
    rank = torch.where(flags, flags.long().cumsum(0) - 1, count)
    out = torch.zeros(count + 1, dtype=torch.long, device=flags.device)
    return out.scatter_(0, rank, torch.arange(flags.numel(), device=flags.device))[:count]


def _check_backward_scope(config, grad: Tensor) -> None:
    """Runs before checkpointed layers recompute: outside packed_attention they would attend across rows."""
    if config._attn_implementation != NAME:
        raise QerlError("backward of a packed forward under gradient checkpointing must run inside "
                        "qerl.packing.packed_attention(model)")


def packing_possible(model, wanted: bool) -> bool:
    """train.padding_free for this model (wanted: the config asks and the rows are not prompt-shared): False, logged,
    where its attention cannot be packed."""
    reason = unsupported_reason(model) if wanted else None
    if reason:
        log.info("train.padding_free: padded update forwards for %s (%s)", type(model).__name__, reason)
    return wanted and reason is None
