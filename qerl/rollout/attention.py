"""Grouped-query attention for one-token decode steps over a static KV cache, without repeating K and V.

transformers' sdpa path repeats every KV head for its query heads (`repeat_kv`) whenever an attention mask is
given (torch's fused kernels take no mask with grouped heads), so a static-cache decode step writes and re-reads
the whole cache (heads / kv_heads) times per layer: on an H100, Qwen2.5-7B at 64 rows x 1280 cached tokens spent
most of a 34 ms step there. Here the query heads of each KV head are stacked as rows of one batched matmul, so K
and V are read once:

    scores (B, kv, g*T, L) = q (B, kv, g*T, D) @ K^T;  out = softmax(scores masked) @ V

Registered as the transformers attention implementation "qerl_decode"; `TorchEngine` switches a model to it only
around its static decode steps (`attention_implementation`). The mask is the prepared 4D one (B, 1, T, L): bool
(True = attend) or additive float.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "qerl_decode"


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, L, D) -> ((B, T, H, D), None); H a multiple of Hkv."""
    if dropout or sliding_window is not None or kwargs.get("s_aux") is not None or kwargs.get("softcap"):
        raise NotImplementedError("qerl_decode attention: no dropout, sliding window, sinks or softcap")
    b, h, t, d = query.shape
    kv = key.shape[1]
    g = h // kv
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(b, kv, g * t, d)  # query head kv*g + j belongs to KV head kv (transformers' repeat_kv order)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale
    if attention_mask is not None:
        mask = attention_mask[:, :, None].expand(b, attention_mask.shape[1], g, t, attention_mask.shape[-1])
        mask = mask.reshape(b, attention_mask.shape[1], g * t, attention_mask.shape[-1])
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value).reshape(b, h, t, d)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, decode_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # masks are prepared by the engine; kept for completeness


@contextlib.contextmanager
def attention_implementation(model, name: str = NAME):
    """Run the model with attention implementation `name`, putting back the configured one afterwards."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
