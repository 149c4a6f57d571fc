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
from qerl.grpo import PACKED_ATTENTION, chunked_head_logprobs, split_causal_lm, token_logprobs

log = logging.getLogger("qerl.train")
NAME = PACKED_ATTENTION
_ORIGINAL: ContextVar[str | None] = ContextVar("qerl_packed_original", default=None)
_CALLS: ContextVar[list | None] = ContextVar("qerl_packed_calls", default=None)
_HALF = (torch.bfloat16, torch.float16)


def unsupported_reason(model) -> str | None:
    """Why this model's forward cannot be packed, or None: sliding-window layers would need the window per row, and
    unpacked calls inside packed_attention run SDPA (or eager) with their masks."""
    config = model.config
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"its attention implementation {config._attn_implementation!r} (packing wants sdpa or eager)"
    if getattr(config, "attention_dropout", 0.0):  # flash varlen here runs without dropout
        return f"its attention_dropout {config.attention_dropout}"
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


def _flash_rows(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, longest_q: int,
                longest_k: int, scale: float | None) -> Tensor:
    """(T, Hq, D) causal attention of packed rows with flash's varlen kernel; a row with more keys than queries (a
    prompt before its completion) aligns its causal mask to the last key, as flash does."""
    from torch.nn.attention.varlen import varlen_attn

    gqa, flag = _varlen_options()
    options = {"is_causal": True} if flag else {"window_size": (-1, 0)}  # (-1, 0): causal in torch >= 2.11's API
    if gqa:
        options["enable_gqa"] = True
    elif key.shape[1] != query.shape[1]:  # this torch's wrapper wants equal heads: repeat each KV head
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    return varlen_attn(query, key, value, cu_q, cu_k, longest_q, longest_k, scale=scale, **options)


def _sdpa_rows(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float | None) -> Tensor:
    """The same with SDPA row by row (CPU, fp32 and fp64): (T, H, D) in and out."""
    outs, bq, bk = [], cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(bq, bq[1:], bk, bk[1:]):
        if b == a:
            continue
        q, k, v = query[a:b].transpose(0, 1), key[c:d].transpose(0, 1), value[c:d].transpose(0, 1)
        extra = (d - c) - (b - a)  # keys before the first query (its prompt): all visible to every query
        mask = None if extra == 0 else torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).tril(extra)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                   enable_gqa=k.shape[0] != q.shape[0]).transpose(0, 1))
    return torch.cat(outs) if outs else query.new_zeros(query.shape)


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
    query, key, value = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    keys_at = kwargs.get("qerl_key_index")  # shared prompts: each row's keys gathered (its prompt's, then its own)
    if keys_at is not None:
        key, value = key.index_select(0, keys_at), value.index_select(0, keys_at)
    cu_k, longest_q = kwargs.get("cu_seq_lens_k", cu), kwargs["max_length_q"]
    if query.is_cuda and query.dtype in _HALF and query.shape[-1] <= 256 and _varlen_options() is not None:
        out = _flash_rows(query, key, value, cu, cu_k, longest_q, kwargs.get("max_length_k", longest_q), scaling)
    else:
        out = _sdpa_rows(query, key, value, cu, cu_k, scaling)
    return out.unsqueeze(0), None


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
    if scored == 0:  # nothing to score: the padded path keeps the graph the loss expects
        return token_logprobs(model, input_ids, attention_mask, keep, temperature=temperature, chunk_size=chunk_size)
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    where = _true_positions(real.reshape(-1), tokens)  # the real tokens' flat positions, in order
    index = real.reshape(-1).long().cumsum(0).view_as(real) - 1  # each real token's place in the packed row
    scored_at = _true_positions(completion.reshape(-1), scored)
    states = index[:, -keep:].reshape(-1)[scored_at] - 1  # a completion token is scored by the state before it
    targets = input_ids[:, -keep:].reshape(-1)[scored_at]
    positions = (real.long().cumsum(1) - 1).reshape(-1)[where]
    hidden = _packed_forward(model, body, input_ids=input_ids.reshape(-1)[where][None], position_ids=positions[None],
                             cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    lp, ent = chunked_head_logprobs(head, hidden.index_select(0, states), targets, temperature, chunk_size)
    return _placed(lp, scored_at, completion.shape), _placed(ent, scored_at, completion.shape)


def grouped_packed_token_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                                  completion_attn: Tensor, group_size: int, *, temperature: float = 1.0,
                                  chunk_size: int = 512) -> tuple[Tensor, Tensor]:
    """`qerl.prefix.grouped_token_logprobs` over packed rows: each prompt computed once per group. One packed
    forward holds the prompts and then the completions; in every layer a completion row's keys are its prompt's K/V
    followed by its own (one gather), a prompt row's its own. Unlike the KV-cache path it runs under gradient
    checkpointing (backward inside packed_attention). prompt_*: (P, Lp) left-padded; completion_*: (P * G, Lc)
    right-padded, row i * G + j sample j of prompt i. Returns (logprobs, entropy) of shape (P * G, Lc), 0 at pad
    positions."""
    rows, width = completion_ids.shape
    if rows != prompt_ids.shape[0] * group_size or completion_attn.shape != completion_ids.shape \
            or prompt_mask.shape != prompt_ids.shape or temperature <= 0:
        raise QerlError(f"grouped rows: {prompt_ids.shape[0]} prompts x G={group_size} against {rows} completion "
                        f"rows (masks the shapes of their ids, temperature > 0, got {temperature})")
    body, head = split_causal_lm(model)
    p_real, c_real = prompt_mask.bool(), completion_attn.bool()
    p_len, c_len = p_real.sum(dim=1), c_real.sum(dim=1)
    row_p_len = p_len.repeat_interleave(group_size)
    kv_len = row_p_len + c_len
    q_len = torch.cat([p_len, c_len])  # query rows: the P prompts, then the completions
    stats = torch.stack([p_len.sum(), c_len.sum(), q_len.max(), kv_len.max(), (p_len == 0).sum()])
    p_tokens, c_tokens, longest_q, longest_k, promptless = stats.tolist()  # the only host read
    if promptless:
        raise QerlError(f"{promptless} prompt(s) without a token: their first completion token has no state")
    if c_tokens == 0:  # nothing to score: the padded path keeps the graph the loss expects
        return token_logprobs(model, torch.cat([prompt_ids.repeat_interleave(group_size, 0), completion_ids], 1),
                              torch.cat([prompt_mask.repeat_interleave(group_size, 0), completion_attn], 1), width,
                              temperature=temperature, chunk_size=chunk_size)
    cu_p, cu_c = F.pad(p_len.cumsum(0), (1, 0)), F.pad(c_len.cumsum(0), (1, 0))
    cu_q, cu_k = F.pad(q_len.cumsum(0), (1, 0)), F.pad(torch.cat([p_len, kv_len]).cumsum(0), (1, 0))
    p_where = _true_positions(p_real.reshape(-1), p_tokens)
    c_where = _true_positions(c_real.reshape(-1), c_tokens)
    # each query row's keys as indices into the packed tokens: a prompt row its own tokens; a completion row its
    # prompt's (among the first p_tokens), then its own (past them)
    at = torch.arange(p_tokens + group_size * p_tokens + c_tokens, device=cu_k.device)
    q_row = torch.searchsorted(cu_k[1:], at, right=True)
    offset = at - cu_k[q_row]
    row = (q_row - len(p_len)).clamp(min=0)  # the completion row (0 for prompt rows, unused there)
    from_prompt = cu_p[row // group_size] + offset
    own = p_tokens + cu_c[row] + offset - row_p_len[row]
    keys = torch.where(q_row < len(p_len), at, torch.where(offset < row_p_len[row], from_prompt, own))
    positions = torch.cat([(p_real.long().cumsum(1) - 1).reshape(-1)[p_where],
                           (c_real.long().cumsum(1) - 1 + row_p_len[:, None]).reshape(-1)[c_where]])
    ids = torch.cat([prompt_ids.reshape(-1)[p_where], completion_ids.reshape(-1)[c_where]])
    hidden = _packed_forward(model, body, input_ids=ids[None], position_ids=positions[None], cu_seq_lens_q=cu_q.int(),
                             cu_seq_lens_k=cu_k.int(), max_length_q=longest_q, max_length_k=longest_k,
                             qerl_key_index=keys)
    # the state before each completion token: its prompt's last one for the first, else the previous token's
    packed_at = torch.arange(c_tokens, device=c_where.device)
    row_of = c_where // width
    before = torch.where(packed_at == cu_c[row_of], cu_p[row_of // group_size + 1] - 1, p_tokens + packed_at - 1)
    lp, ent = chunked_head_logprobs(head, hidden.index_select(0, before), completion_ids.reshape(-1)[c_where],
                                    temperature, chunk_size)
    return _placed(lp, c_where, (rows, width)), _placed(ent, c_where, (rows, width))


def _packed_forward(model, body, **inputs) -> Tensor:
    """body's last hidden state (tokens, hidden) over packed rows, run inside packed_attention. After it: the rows
    reached the attention interface (else they would have attended across rows), and under gradient checkpointing
    the output checks, when backward reaches it, that backward runs inside packed_attention."""
    calls = []
    token = _CALLS.set(calls)
    try:
        with packed_attention(model):
            hidden = body(use_cache=False, **inputs).last_hidden_state
    finally:
        _CALLS.reset(token)
    if not calls:
        raise QerlError(f"{type(body).__name__} did not route attention through transformers' attention interface "
                        "with the packed rows' bounds; set train.padding_free: false")
    if _checkpointed(model) and hidden.requires_grad:
        hidden.register_hook(functools.partial(_check_backward_scope, model.config))
    return hidden[0]


def _placed(values: Tensor, at: Tensor, shape: tuple[int, int]) -> Tensor:
    """Scored tokens' values at their flat positions `at` of a (rows, width) grid, 0 elsewhere (differentiable)."""
    return values.new_zeros(shape[0] * shape[1]).index_copy(0, at, values).view(shape)


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


def positions_computed(attention_mask: Tensor, completion_len: int, packed: bool, group: int = 1) -> int:
    """Token positions a forward of these rows (TRL's layout) computes: every position of the padded rows, or only
    the real tokens of packed ones; with group > 1 (rows i * G + j sharing a prompt) each prompt once per group."""
    prompt, completion = attention_mask[:, :-completion_len], attention_mask[:, -completion_len:]
    if packed:
        return int(prompt[::group].sum() + completion.sum())
    return prompt[::group].numel() + completion.numel()


def shares_prompts(cfg) -> bool:
    """Whether train.padding_free asks for each prompt once per group in packed rows: shared_prompts always (the
    config checks that micro-batches hold whole groups); auto where they do and gradient checkpointing is on (without
    it the trainer shares prompts over a KV cache, qerl.prefix)."""
    if cfg.padding_free == "shared_prompts":
        return True
    whole = cfg.micro_batch_size % cfg.num_generations == 0
    return cfg.padding_free == "auto" and whole and bool(cfg.gradient_checkpointing)


def packing_possible(model, wanted: bool) -> bool:
    """train.padding_free for this model (wanted: the config asks for packed rows): False, logged, where its
    attention cannot be packed."""
    reason = unsupported_reason(model) if wanted else None
    if reason:
        log.info("train.padding_free: padded update forwards for %s (%s)", type(model).__name__, reason)
    return wanted and reason is None
