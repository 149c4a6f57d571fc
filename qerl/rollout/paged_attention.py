"""Attention over the paged KV pool, plugged into the model's own attention modules through transformers'
AttentionInterface (registered as "qerl_paged"), so LoRA, FP4 layers and in-place AQN noise are the trained ones.

The model is called packed, one row after another in a single sequence:

    model(input_ids=[1, T], position_ids=[1, T], attention_mask=None, use_cache=False, qerl_paged=meta)

and each attention layer (1) writes the step's new K/V at `meta.slot_mapping` of its pool layer, then (2) attends
every row's queries over that row's blocks. "qerl_paged" is not registered as a mask implementation, so
`create_causal_mask` returns None without building anything (transformers' path for vLLM/TGI-style backends): the
causal structure comes from the block tables and lengths here, for any model that builds its mask that way.

Backends: rows with one query token (decode) go through `_decode`: on CUDA the Triton paged kernel
(qerl.rollout.triton_paged: block tables and lengths, no gathered copy), elsewhere the torch reference (gather the
rows' blocks, one batched masked matmul per layer, K/V read once per KV head). Rows with several query tokens
(prefill, chunked prefill, recompute) go through `_prefill_reference`: causal SDPA with the cached-length offset,
one call per row; the seam for torch's varlen_attn(block_table=...) on CUDA. A step of decode rows only (the
CUDA-graph step, `PagedMeta.decode_only`) needs no host-side gathers at all: its meta holds four tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

try:  # the CUDA decode kernel; absent (no Triton), every decode row takes the reference
    from qerl.rollout import triton_paged
except ImportError:
    triton_paged = None

NAME = "qerl_paged"


@dataclass
class PrefillRow:
    """A row with several query tokens: packed tokens [begin, end) attend over `slots` with `mask` (None = causal)."""

    begin: int
    end: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PagedMeta:
    """Everything a layer needs for one packed step; built once per step, read by every layer.

    slot_mapping[T]: pool slot each new token's K/V goes to. Decode rows (one query token): decode_tokens[Bd]
    (packed index of each), decode_table[Bd, W] int32 (block ids, 0 = null block) and decode_lens[Bd] int32 (keys
    after this step's write), for the kernel; decode_all: every packed token is a decode row in order (no gather).
    The CPU reference gathers decode_slots[Bd, Lmax] / decode_mask[Bd, 1, 1, Lmax] on first use (decode_max_len:
    Lmax). Prefill rows one by one in `prefill`.
    """

    pool: object
    slot_mapping: torch.Tensor
    decode_tokens: torch.Tensor
    decode_table: torch.Tensor
    decode_lens: torch.Tensor
    prefill: list
    decode_all: bool = False
    decode_max_len: int = 1
    _gather: tuple | None = None

    @classmethod
    def build(cls, pool, rows, device) -> PagedMeta:
        """rows: [(block ids, start, end)] in packed order; row i computes positions start..end-1."""
        bs = pool.block_size
        slot_mapping = [b[p // bs] * bs + p % bs for b, s, e in rows for p in range(s, e)]
        begins = [0]
        for _, s, e in rows:
            begins.append(begins[-1] + e - s)
        decode = [i for i, (_, s, e) in enumerate(rows) if e - s == 1]
        width = max((len(rows[i][0]) for i in decode), default=1)
        table = torch.tensor([rows[i][0] + [0] * (width - len(rows[i][0])) for i in decode],
                             dtype=torch.int32, device=device).reshape(len(decode), width)
        prefill = [_prefill_row(begins[i], s, e, _slot_grid(torch.tensor([b], device=device), bs, e)[0], device)
                   for i, (b, s, e) in enumerate(rows) if e - s > 1]
        return cls(pool=pool, slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
                   decode_tokens=torch.tensor([begins[i] for i in decode], dtype=torch.long, device=device),
                   decode_table=table,
                   decode_lens=torch.tensor([rows[i][2] for i in decode], dtype=torch.int32, device=device),
                   prefill=prefill, decode_all=len(decode) == len(rows) == len(slot_mapping),
                   decode_max_len=max((rows[i][2] for i in decode), default=1))

    @classmethod
    def decode_step(cls, pool, slot_mapping, table, lens) -> PagedMeta:
        """A step of decode rows only, from (static) device tensors: what a captured CUDA graph reads. The
        reference, if it runs, gathers the table's full width (a static shape; keys past a row's length masked)."""
        return cls(pool=pool, slot_mapping=slot_mapping, decode_tokens=torch.arange(0), decode_table=table,
                   decode_lens=lens, prefill=[], decode_all=True, decode_max_len=table.shape[1] * pool.block_size)

    def decode_gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [Bd, Lmax], keep [Bd, 1, 1, Lmax]) of the decode rows' keys, padding on slot 0: the reference's."""
        if self._gather is None:
            bs = self.pool.block_size
            keep = (torch.arange(self.decode_max_len, device=self.decode_lens.device)[None, :]
                    < self.decode_lens[:, None])
            slots = _slot_grid(self.decode_table.long(), bs, self.decode_max_len).masked_fill(~keep, 0)
            self._gather = (slots, keep[:, None, None, :])
        return self._gather


def _slot_grid(table: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """[rows, length]: the pool slot of key positions 0..length-1 of each row."""
    pos = torch.arange(length, device=table.device)
    return table[:, pos // block_size] * block_size + pos % block_size


def _prefill_row(begin: int, start: int, end: int, slots: torch.Tensor, device) -> PrefillRow:
    """Query j (position start + j) sees keys 0..start + j: plain causal when nothing was cached before."""
    mask = None
    if start > 0:
        mask = torch.arange(end, device=device)[None, :] <= torch.arange(start, end, device=device)[:, None]
    return PrefillRow(begin, begin + end - start, slots, mask)


_ACTIVE: list = []  # the step's PagedMeta when the forward runs inside paged_step(meta)


@contextlib.contextmanager
def paged_step(meta: PagedMeta):
    """The step's meta for every attention layer without passing it through the model's kwargs: compiled decoder
    layers (qerl.rollout.layer_compile) then never see a per-step Python object (dynamo would guard on it)."""
    _ACTIVE.append(meta)
    try:
        yield
    finally:
        _ACTIVE.pop()


def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    sliding_window=None, qerl_paged: PagedMeta | None = None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) of the packed step -> ((1, T, H, D), None)."""
    meta = qerl_paged if qerl_paged is not None else (_ACTIVE[-1] if _ACTIVE else None)
    if meta is None:
        raise RuntimeError("qerl_paged attention: the forward needs the qerl_paged=PagedMeta kwarg or paged_step(meta) "
                           "(PagedEngine)")
    if dropout or sliding_window is not None or kwargs.get("s_aux") is not None or kwargs.get("softcap"):
        raise NotImplementedError("qerl_paged attention: no dropout, sliding window, sinks or softcap")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    k_cache, v_cache = meta.pool.layer(module.layer_idx)
    q = query[0].transpose(0, 1)  # (T, H, D)
    key, value = _step_kv(key, k_cache), _step_kv(value, v_cache)
    if meta.decode_all and _kernel_runs(q, k_cache):  # the kernel writes the step's K/V itself: no index_copy pair
        return _write_decode_op(q, k_cache, v_cache, key, value, meta.decode_table, meta.decode_lens,
                                float(scale))[None], None
    _write_op(k_cache, v_cache, key, value, meta.slot_mapping)
    if meta.decode_all:
        return _decode(q, k_cache, v_cache, meta, scale)[None], None
    out = torch.empty_like(q)
    if meta.decode_tokens.numel():
        out[meta.decode_tokens] = _decode(q[meta.decode_tokens], k_cache, v_cache, meta, scale)
    for row in meta.prefill:
        out[row.begin:row.end] = _prefill_reference(q[row.begin:row.end], k_cache, v_cache, row, scale)
    return out[None], None


def _step_kv(states: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The step's keys or values (1, Hkv, T, D) as (T, Hkv, D) in the cache's dtype."""
    return states[0].transpose(0, 1).to(cache.dtype)


# Custom ops, so that torch.compile treats the pool write and the Triton kernel as opaque calls: the pool is
# written in place (never functionalised into a copy of the whole pool) and the kernel launch is not traced.
@torch.library.custom_op("qerl::paged_write", mutates_args=("k_cache", "v_cache"))
def _write_op(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              slots: torch.Tensor) -> None:
    """key/value (T, Hkv, D) into the flattened pool at slots[T]."""
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, slots, key)
    v_cache.view(flat_shape).index_copy_(0, slots, value)


@_write_op.register_fake
def _(k_cache, v_cache, key, value, slots):
    return None


@torch.library.custom_op("qerl::paged_decode", mutates_args=())
def _paged_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    return triton_paged.paged_decode(q, k_cache, v_cache, table, lens, scale)


@_paged_decode_op.register_fake
def _(q, k_cache, v_cache, table, lens, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("qerl::paged_write_decode", mutates_args=("k_cache", "v_cache"))
def _write_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode rows only: key/value (B, Hkv, D) written at each row's position lens - 1 and attended, one launch.
    A row's slot comes from its block table (the engine's slot_mapping of a decode row is the same slot)."""
    return triton_paged.paged_decode(q, k_cache, v_cache, table, lens, scale, new_kv=(key, value))


@_write_decode_op.register_fake
def _(q, k_cache, v_cache, key, value, table, lens, scale):
    return q.new_empty(q.shape)


def _kernel_runs(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return triton_paged is not None and triton_paged.supported(q, k_cache)


def _decode(q, k_cache, v_cache, meta: PagedMeta, scale: float) -> torch.Tensor:
    """One query token per row: (Bd, H, D); the Triton paged kernel where it runs, else the reference."""
    if _kernel_runs(q, k_cache):
        return _paged_decode_op(q, k_cache, v_cache, meta.decode_table, meta.decode_lens, float(scale))
    return _decode_reference(q, k_cache, v_cache, meta, scale)


def _decode_reference(q, k_cache, v_cache, meta: PagedMeta, scale: float) -> torch.Tensor:
    """The query heads of each KV head are the rows of one matmul, so gathered K/V are not repeated per head."""
    b, h, d = q.shape
    kv = k_cache.shape[2]
    flat = (-1, kv, d)
    slots, keep = meta.decode_gather()
    keys = k_cache.view(flat)[slots].permute(0, 2, 1, 3)  # (Bd, Hkv, L, D)
    values = v_cache.view(flat)[slots].permute(0, 2, 1, 3)
    grouped = q.reshape(b, kv, h // kv, d)  # query head kv*g + j uses KV head kv (transformers' repeat_kv order)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped.to(keys.dtype), keys, values, attn_mask=keep, scale=scale)
    return out.reshape(b, h, d).to(q.dtype)


def _prefill_reference(q, k_cache, v_cache, row: PrefillRow, scale: float) -> torch.Tensor:
    """Several query tokens of one row: (Tq, H, D) attending causally over the row's keys (cached + new)."""
    kv, d = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.view(-1, kv, d)[row.slots].transpose(0, 1)[None]  # (1, Hkv, L, D)
    values = v_cache.view(-1, kv, d)[row.slots].transpose(0, 1)[None]
    query = q.transpose(0, 1)[None].to(keys.dtype)  # (1, H, Tq, D)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=row.mask, is_causal=row.mask is None, scale=scale,
        enable_gqa=q.shape[1] != kv)
    return out[0].transpose(0, 1).to(q.dtype)


# eager under torch.compile: its kernels are custom ops, and tracing it would bake each layer's pool index into the
# compiled code of a layer that all layers share (qerl.rollout.layer_compile)
AttentionInterface.register(NAME, torch.compiler.disable(paged_attention))
