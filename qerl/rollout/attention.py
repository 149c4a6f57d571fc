"""Grouped-query attention for one-token decode steps over a static KV cache, without repeating K and V.

transformers' sdpa path repeats every KV head for its query heads (`repeat_kv`) whenever an attention mask is
given (torch's fused kernels take no mask with grouped heads), so a static-cache decode step writes and re-reads
the whole cache (heads / kv_heads) times per layer: on an H100, Qwen2.5-7B at 64 rows x 1280 cached tokens spent
most of a 34 ms step there. Here the query heads of each KV head are stacked as rows of one batched matmul, so K
and V are read once:

    scores (B, kv, g*T, L) = q (B, kv, g*T, D) @ K^T;  out = softmax(scores masked) @ V

Registered as the transformers attention implementation "qerl_decode"; `TorchEngine` switches a model to it only
around its static decode steps (`attention_implementation`). The mask is the prepared 4D one (B, 1, T, L): bool
(True = attend) or additive float. On CUDA, one-token steps with a bool mask, bf16/fp16 heads of a power-of-two
size and enough rows run `qerl::gqa_decode` (qerl.rollout.triton_attention: one fused kernel per layer that reads
K and V once and skips the not yet filled part of the static cache); everything else runs the matmuls below.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from qerl.quant.kernels.tiling import target_programs

NAME = "qerl_decode"


@torch.library.custom_op("qerl::gqa_decode", mutates_args=())
def _gqa_decode_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
                   scale: float) -> torch.Tensor:
    from qerl.rollout.triton_attention import gqa_decode_attention

    return gqa_decode_attention(query, key, value, keep, scale)


@_gqa_decode_op.register_fake
def _(query, key, value, keep, scale):
    b, h, _, d = query.shape
    return query.new_empty(b, 1, h, d)


@functools.lru_cache(maxsize=None)
def _triton_ok(device_index: int) -> bool:
    return (importlib.util.find_spec("triton") is not None
            and torch.cuda.get_device_capability(device_index) >= (8, 0))


@torch.compiler.assume_constant_result
def _kernel_programs(device_index: int) -> int:
    """target_programs of the device, 0 where the Triton kernel cannot run: a constant to torch.compile, which
    (2.11) cannot trace find_spec and broke the decode graph in every attention layer that reached the check."""
    return target_programs(torch.device("cuda", device_index)) if _triton_ok(device_index) else 0


def _fused_decode(query, key, value, attention_mask) -> bool:
    """Whether this call takes the Triton kernel. QERL_DECODE_ATTENTION: "torch" never, "triton" wherever it
    applies, "auto" (default) from one (row, KV head) program per SM on: measured in TorchEngine (7B FP4, H100,
    1024 new tokens), the kernel made batch 64 2.7% faster (6,715 -> 6,897 tokens/s) and batch 8 6% slower
    (1,568 -> 1,478) than the torch.compile'd matmul path."""
    choice = os.environ.get("QERL_DECODE_ATTENTION", "auto")
    if choice == "torch" or not query.is_cuda:
        return False
    b, h, t, d = query.shape
    programs = _kernel_programs(query.device.index)
    if programs == 0 or (choice != "triton" and b * key.shape[1] < programs // 2):  # one program per SM
        return False
    return (t == 1 and attention_mask is not None and attention_mask.dtype == torch.bool
            and attention_mask.shape[1:3] == (1, 1) and attention_mask.shape[0] == b
            and attention_mask.shape[-1] == key.shape[2] and attention_mask.stride(-1) == 1
            and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == value.dtype == query.dtype
            and 16 <= d <= 256 and d & (d - 1) == 0 and h % key.shape[1] == 0
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     sliding_window=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, L, D) -> ((B, T, H, D), None); H a multiple of Hkv."""
    if dropout or sliding_window is not None or kwargs.get("s_aux") is not None or kwargs.get("softcap"):
        raise NotImplementedError("qerl_decode attention: no dropout, sliding window, sinks or softcap")
    b, h, t, d = query.shape
    kv = key.shape[1]
    g = h // kv
    scale = d ** -0.5 if scaling is None else scaling
    if _fused_decode(query, key, value, attention_mask):
        return _gqa_decode_op(query, key, value, attention_mask[:, 0, 0, :], float(scale)), None
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


def sdpa_without_cudnn():
    """SDPA with flash, mem-efficient or math kernels but never cuDNN: cuDNN builds an execution graph on the host
    for every new sequence length (~7 ms each on an H100), and training micro-batches, prompts and preempted rows
    bring new lengths all the time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
