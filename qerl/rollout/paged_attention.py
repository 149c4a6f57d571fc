"""Attention over the paged KV pool, plugged into the model's own attention modules through transformers'
AttentionInterface (registered as "qerl_paged"), so LoRA, FP4 layers and in-place AQN noise are the trained ones.

The model is called packed, one row after another in a single sequence:

    model(input_ids=[1, T], position_ids=[1, T], attention_mask=None, use_cache=False, qerl_paged=meta)

and each attention layer (1) writes the step's new K/V at `meta.slot_mapping` of its pool layer, then (2) attends
every row's queries over that row's blocks. "qerl_paged" is not registered as a mask implementation, so
`create_causal_mask` returns None without building anything (transformers' path for vLLM/TGI-style backends): the
causal structure comes from the block tables and lengths here, for any model that builds its mask that way.

Backends: rows with one query token (decode) go through `_decode` - today the torch reference (gather the rows'
blocks, one batched masked matmul per layer, K/V read once per KV head); the seam for a Triton paged decode kernel on
CUDA (the block-table version of qerl::gqa_decode). Rows with several query tokens (prefill, chunked prefill,
recompute) go through `_prefill_reference`: causal SDPA with the cached-length offset, one call per row; the seam for
torch's varlen_attn(block_table=...) on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

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

    slot_mapping[T]: pool slot each new token's K/V goes to. block_table[B, max_blocks] (0 = null block) and
    context_lens[B] (keys after this step's write) describe every row, for kernels. The reference paths use the
    precomputed gathers: decode_tokens[Bd] (packed index of each decode row's token), decode_slots[Bd, Lmax]
    (slots of its keys, padded with slot 0) and decode_mask[Bd, 1, 1, Lmax]; prefill rows one by one.
    """

    pool: object
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    decode_tokens: torch.Tensor
    decode_slots: torch.Tensor
    decode_mask: torch.Tensor
    prefill: list

    @classmethod
    def build(cls, pool, rows, device) -> PagedMeta:
        """rows: [(block ids, start, end)] in packed order; row i computes positions start..end-1."""
        bs = pool.block_size
        slot_mapping = [b[p // bs] * bs + p % bs for b, s, e in rows for p in range(s, e)]
        width = max(len(b) for b, _, _ in rows)
        table = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in rows], dtype=torch.long, device=device)
        ends = [e for _, _, e in rows]
        lens = torch.tensor(ends, dtype=torch.long, device=device)
        begins = [0]
        for _, s, e in rows:
            begins.append(begins[-1] + e - s)
        decode = [i for i, (_, s, e) in enumerate(rows) if e - s == 1]
        d_idx = torch.tensor(decode, dtype=torch.long, device=device)
        d_len = max((ends[i] for i in decode), default=1)
        d_keep = torch.arange(d_len, device=device)[None, :] < lens[d_idx][:, None]
        d_slots = _slot_grid(table[d_idx], bs, d_len).masked_fill(~d_keep, 0)  # padding reads the null block
        prefill = [_prefill_row(begins[i], s, e, _slot_grid(table[i:i + 1], bs, e)[0], device)
                   for i, (_, s, e) in enumerate(rows) if e - s > 1]
        return cls(pool=pool, slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
                   block_table=table, context_lens=lens,
                   decode_tokens=torch.tensor([begins[i] for i in decode], dtype=torch.long, device=device),
                   decode_slots=d_slots, decode_mask=d_keep[:, None, None, :], prefill=prefill)


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


def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    sliding_window=None, qerl_paged: PagedMeta | None = None, **kwargs):
    """query (1, H, T, D), key/value (1, Hkv, T, D) of the packed step -> ((1, T, H, D), None)."""
    meta = qerl_paged
    if meta is None:
        raise RuntimeError("qerl_paged attention: the forward needs the qerl_paged=PagedMeta kwarg (PagedEngine)")
    if dropout or sliding_window is not None or kwargs.get("s_aux") is not None or kwargs.get("softcap"):
        raise NotImplementedError("qerl_paged attention: no dropout, sliding window, sinks or softcap")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    k_cache, v_cache = meta.pool.layer(module.layer_idx)
    _write(k_cache, v_cache, key, value, meta.slot_mapping)
    q = query[0].transpose(0, 1)  # (T, H, D)
    out = torch.empty_like(q)
    if meta.decode_tokens.numel():
        out[meta.decode_tokens] = _decode(q[meta.decode_tokens], k_cache, v_cache, meta, scale)
    for row in meta.prefill:
        out[row.begin:row.end] = _prefill_reference(q[row.begin:row.end], k_cache, v_cache, row, scale)
    return out[None], None


def _write(k_cache, v_cache, key, value, slots) -> None:
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, slots, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.view(flat_shape).index_copy_(0, slots, value[0].transpose(0, 1).to(v_cache.dtype))


def _decode(q, k_cache, v_cache, meta: PagedMeta, scale: float) -> torch.Tensor:
    """One query token per row: (Bd, H, D). The seam for a Triton paged decode kernel (block table + lengths)."""
    return _decode_reference(q, k_cache, v_cache, meta, scale)


def _decode_reference(q, k_cache, v_cache, meta: PagedMeta, scale: float) -> torch.Tensor:
    """The query heads of each KV head are the rows of one matmul, so gathered K/V are not repeated per head."""
    b, h, d = q.shape
    kv = k_cache.shape[2]
    flat = (-1, kv, d)
    keys = k_cache.view(flat)[meta.decode_slots].permute(0, 2, 1, 3)  # (Bd, Hkv, L, D)
    values = v_cache.view(flat)[meta.decode_slots].permute(0, 2, 1, 3)
    grouped = q.reshape(b, kv, h // kv, d)  # query head kv*g + j uses KV head kv (transformers' repeat_kv order)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped.to(keys.dtype), keys, values, attn_mask=meta.decode_mask, scale=scale)
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


AttentionInterface.register(NAME, paged_attention)
