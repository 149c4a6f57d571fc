"""The paged KV cache: a pool of fixed-size blocks per layer and the allocator that hands them out.

    pool = KVPool(model, block_size=16, num_blocks=512)       # or, on CUDA: gpu_memory_utilization=0.85
    alloc = BlockAllocator(pool.num_blocks)
    ids = alloc.alloc(3)                                       # None when fewer than 3 blocks are free
    alloc.share(ids[:2]); alloc.free(ids)                      # ref counts: shared prompt blocks outlive a row

Layout per layer: K and V `[num_blocks, block_size, kv_heads, head_dim]` (NHD, as vLLM's FlashAttention backend and
torch's `varlen_attn` read it), so token position p of a sequence with block table `t` lives at slot
`t[p // block_size] * block_size + p % block_size` of the flattened pool. Block 0 is never handed out: padded rows
of a fixed-shape step point at it and may write garbage there.
"""
from __future__ import annotations

import os

import torch

from qerl.errors import QerlError
from qerl.rollout.model_state import compute_dtype

NULL_BLOCK = 0  # reserved: the slot padded rows write to and read from


class BlockAllocator:
    """Free list and ref counts of blocks 1..num_blocks-1 (block 0 is the null block). Pure Python, no tensors."""

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise QerlError(
                f"BlockAllocator.num_blocks: expected an int >= 2 (block 0 is reserved), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack: pop() hands out low ids first
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def all_free(self) -> bool:
        return self.num_free == self.num_usable and not any(self._ref)

    def alloc(self, count: int) -> list[int] | None:
        """`count` fresh blocks with ref count 1, or None (and nothing taken) when fewer are free."""
        if count < 0:
            raise ValueError(f"BlockAllocator.alloc: count must be >= 0, got {count}")
        if count > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(count)]
        for b in ids:
            self._ref[b] = 1
        return ids

    def share(self, blocks) -> None:
        """One more holder for each of these allocated blocks."""
        for b in blocks:
            self._check_held(b, "share")
        for b in blocks:
            self._ref[b] += 1

    def free(self, blocks) -> None:
        """One holder less for each block; a block whose count reaches 0 goes back to the free list."""
        for b in blocks:
            self._check_held(b, "free")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def _check_held(self, b: int, what: str) -> None:
        if not (isinstance(b, int) and 0 < b < self.num_blocks):
            raise ValueError(f"BlockAllocator.{what}: block {b!r} is not in 1..{self.num_blocks - 1}")
        if self._ref[b] == 0:
            raise ValueError(f"BlockAllocator.{what}: block {b} is not allocated (double free?)")


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only transformers model."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
    """KV bytes one token position takes over all layers (K and V): Qwen2.5-7B in bf16 = 56 KiB."""
    layers, kv_heads, head_dim = kv_shape(model)
    itemsize = torch.empty((), dtype=dtype or compute_dtype(model)).element_size()
    return 2 * layers * kv_heads * head_dim * itemsize


class KVPool:
    """Per layer K and V block tensors on the model's device and in its compute dtype.

    num_blocks: explicit size; or None on CUDA: `free memory * gpu_memory_utilization - reserve_bytes` (reserve =
    what a forward of the largest step needs besides the cache) divided by the bytes of one block.
    """

    def __init__(self, model, block_size: int = 16, num_blocks: int | None = None,
                 gpu_memory_utilization: float = 0.85, reserve_bytes: int = 0):
        if not isinstance(block_size, int) or block_size < 1:
            raise QerlError(f"KVPool.block_size: expected an int >= 1, got {block_size!r}")
        if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
            raise QerlError(f"gpu_memory_utilization: expected a number in (0, 1], got {gpu_memory_utilization!r}")
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.dtype = compute_dtype(model)
        self.layers, self.kv_heads, self.head_dim = kv_shape(model)
        self.bytes_per_token = bytes_per_token(model, self.dtype)
        if num_blocks is None:
            num_blocks = self._blocks_from_memory(gpu_memory_utilization, reserve_bytes)
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise QerlError(f"KVPool.num_blocks: expected an int >= 2 (block 0 is reserved), got {num_blocks!r}")
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, self.kv_heads, self.head_dim)
        self.key = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.value = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]

    def _blocks_from_memory(self, utilization: float, reserve_bytes: int) -> int:
        if self.device.type != "cuda":
            raise QerlError("KVPool.num_blocks: required off CUDA (sizing from free memory needs a GPU)")
        free = free_device_memory(self.device)
        budget = int(free * utilization) - int(reserve_bytes)
        blocks = budget // (self.block_size * self.bytes_per_token)
        if blocks < 2:
            raise QerlError(
                f"KVPool: {free / 2**30:.1f} GiB free x gpu_memory_utilization {utilization} leaves no room for a KV "
                f"cache after the {reserve_bytes / 2**30:.1f} GiB forward reserve; raise gpu_memory_utilization or "
                f"lower max_num_batched_tokens")
        return int(blocks)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.key, *self.value))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key[index], self.value[index]

    def copy_blocks(self, pairs) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a forked prompt's partial last block)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for cache in (*self.key, *self.value):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def release(self) -> None:
        """Drop the tensors so the trainer gets the memory back; the pool is unusable afterwards."""
        self.key, self.value = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def expandable_segments(device: torch.device) -> bool:
    """Switch the caching allocator to expandable segments (as torchtitan and verl run), so that empty_cache gives
    back every free page: with whole segments, AdamW's states and LoRA gradients created during an update sit in
    segments its activations filled, and pin them (measured: 46 of 53 GiB reserved stayed cached after an H100
    7B update, so the next rollout's pool shrank 3x and the dense copies were refused). Segments made before
    stay as they are; a PYTORCH_CUDA_ALLOC_CONF naming expandable_segments is the user's choice and kept.
    Returns whether the setting was made."""
    if device.type != "cuda" or "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return False
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    try:
        setter("expandable_segments:True")
    except (TypeError, RuntimeError):  # no setter in this torch, or an allocator that refuses the option
        return False
    return True


def free_device_memory(device: torch.device) -> int:
    """Bytes free on the GPU once PyTorch's allocator has given back what it caches: right after an update the
    cache still holds its activations' memory, which cudaMemGetInfo alone counts as used."""
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
