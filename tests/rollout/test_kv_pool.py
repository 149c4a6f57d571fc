"""Block allocator invariants and the KV pool's tensors (no tokenizer, no forward)."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.rollout.kv_pool import NULL_BLOCK, BlockAllocator, KVPool, bytes_per_token


def test_alloc_hands_out_distinct_blocks_never_the_null_block():
    alloc = BlockAllocator(6)
    ids = alloc.alloc(5)
    assert sorted(ids) == [1, 2, 3, 4, 5] and NULL_BLOCK not in ids
    assert alloc.num_free == 0 and all(alloc.ref_count(b) == 1 for b in ids)


def test_alloc_is_all_or_nothing():
    alloc = BlockAllocator(5)
    first = alloc.alloc(3)
    assert alloc.alloc(2) is None and alloc.num_free == 1  # nothing taken by the refused request
    assert alloc.alloc(1) is not None and alloc.alloc(0) == []
    alloc.free(first)
    assert alloc.num_free == 3


def test_shared_blocks_return_only_when_the_last_holder_frees():
    alloc = BlockAllocator(4)
    ids = alloc.alloc(2)
    alloc.share(ids)
    alloc.share(ids[:1])
    assert [alloc.ref_count(b) for b in ids] == [3, 2]
    alloc.free(ids)
    assert alloc.num_free == 1 and [alloc.ref_count(b) for b in ids] == [2, 1]
    alloc.free(ids)
    assert alloc.num_free == 2 and alloc.ref_count(ids[0]) == 1
    alloc.free(ids[:1])
    assert alloc.all_free()


def test_double_free_and_foreign_blocks_are_refused():
    alloc = BlockAllocator(4)
    (b,) = alloc.alloc(1)
    alloc.free([b])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([b])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.share([b])  # sharing a free block would hand the same memory out twice
    for bad in (NULL_BLOCK, 4, -1):
        with pytest.raises(ValueError, match="not in 1..3"):
            alloc.free([bad])
    assert alloc.all_free()


def test_freed_blocks_are_reused():
    alloc = BlockAllocator(3)
    ids = alloc.alloc(2)
    assert alloc.alloc(1) is None
    alloc.free(ids[1:])
    assert alloc.alloc(1) == ids[1:]


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import Qwen2ForCausalLM

    from qerl.resources import tiny_qwen2_config

    return Qwen2ForCausalLM(tiny_qwen2_config(256, num_attention_heads=4, num_key_value_heads=2)).eval()


def test_pool_layout_dtype_and_bytes_per_token(tiny_model):
    pool = KVPool(tiny_model, block_size=4, num_blocks=7)
    assert len(pool.key) == len(pool.value) == 2  # one K and one V per layer
    assert pool.key[0].shape == (7, 4, 2, 32) and pool.key[0].dtype == torch.float32
    assert pool.bytes_per_token == bytes_per_token(tiny_model) == 2 * 2 * 2 * 32 * 4
    assert pool.nbytes == 7 * 4 * pool.bytes_per_token
    half = KVPool(tiny_model.to(torch.bfloat16), block_size=4, num_blocks=3)
    tiny_model.float()
    assert half.key[1].dtype == torch.bfloat16 and half.bytes_per_token == pool.bytes_per_token // 2


def test_copy_blocks_copies_every_layer_and_release_frees(tiny_model):
    pool = KVPool(tiny_model, block_size=2, num_blocks=4)
    for t in (*pool.key, *pool.value):
        t[1].normal_()
    pool.copy_blocks([(1, 3)])
    assert all(torch.equal(t[3], t[1]) for t in (*pool.key, *pool.value))
    assert all(t[2].abs().sum() == 0 for t in pool.key)
    pool.release()
    assert pool.key == [] and pool.value == []


def test_pool_size_needs_num_blocks_off_cuda(tiny_model):
    with pytest.raises(QerlError, match="num_blocks: required off CUDA"):
        KVPool(tiny_model, block_size=4)
    with pytest.raises(QerlError, match="gpu_memory_utilization"):
        KVPool(tiny_model, block_size=4, num_blocks=4, gpu_memory_utilization=1.5)
    with pytest.raises(QerlError, match="block 0 is reserved"):
        BlockAllocator(1)


def test_expandable_segments_only_on_cuda_and_not_over_the_users_choice(monkeypatch):
    from qerl.rollout import kv_pool

    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert kv_pool.expandable_segments(torch.device("cpu")) is False and calls == []
    assert kv_pool.expandable_segments(torch.device("cuda", 0)) is True
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert kv_pool.expandable_segments(torch.device("cuda", 0)) is False and len(calls) == 1


@pytest.mark.gpu
def test_empty_cache_gives_back_a_segment_a_long_lived_tensor_shares():
    """An update's activations freed around a small tensor made meanwhile (AdamW's state): the rollout after it
    must see that memory as free."""
    from qerl.rollout.kv_pool import expandable_segments, free_device_memory

    device = torch.device("cuda")
    expandable_segments(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    activations = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    del activations
    state = torch.empty(1 << 20, dtype=torch.uint8, device=device)  # carved from the freed 2 GiB
    free_device_memory(device)
    assert torch.cuda.memory_reserved(device) - before < (256 << 20)
    del state
