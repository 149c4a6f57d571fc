"""The Triton paged decode kernel against a float64 softmax over each row's keys read through its block table: on CPU
through Triton's interpreter (a subprocess, as TRITON_INTERPRET is read when kernels are defined), on the GPU in bf16
at Qwen2.5-7B's head layout."""
from __future__ import annotations

import functools

import pytest
import torch

from bench.random_models import paged_attention_case as random_case
from qerl.rollout.paged_attention import PagedMeta, _decode_reference
from tests.rollout.interpreted import run_interpreted


class Pool:
    def __init__(self, block_size):
        self.block_size = block_size


def float64_attention(q, k, v, table, lens, scale):
    """Per row and head: softmax(q . K / sqrt(d)) V over positions 0..len-1, in float64."""
    rows, heads, _ = q.shape
    bs, kv = k.shape[1], k.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(rows):
        pos = torch.arange(int(lens[r]))
        slots = table[r].long().cpu()[pos // bs] * bs + pos % bs
        keys = k.cpu().double().reshape(-1, kv, k.shape[-1])[slots]
        values = v.cpu().double().reshape(-1, kv, v.shape[-1])[slots]
        for h in range(heads):
            w = torch.softmax(keys[:, h // (heads // kv)] @ q[r, h].cpu().double() * scale, 0)
            out[r, h] = w @ values[:, h // (heads // kv)]
    return out


INTERPRETED = """
    from tests.rollout.test_triton_paged import float64_attention, random_case
    from qerl.rollout.triton_paged import paged_decode
    errors = []
    for block_size, split in ((16, 1), (16, 3), (32, 2), (64, 1), (16, 37)):  # 37: two chunks of splits, one short
        q, k, v, table, lens = random_case(3, 4, 2, 16, block_size, [70, 1, 129], torch.float32, "cpu")
        out = paged_decode(q, k, v, table, lens, 0.25, split=split)
        errors.append(float((out.double() - float64_attention(q, k, v, table, lens, 0.25)).abs().max()))
    print(json.dumps(errors))
"""


def test_interpreted_kernel_matches_float64_attention():
    """Several blocks per tile (16, 32), one tile per block (64), splits with empty ones, a length-1 row, more
    splits than the combine takes in one load."""
    errors = run_interpreted(INTERPRETED, timeout=120)
    assert len(errors) == 5 and max(errors) < 1e-5, errors


def _with_new_kv(k, v, table, lens, seed):
    """The step's new (key, value) per row (B, Hkv, D), and copies of the caches with them written at each row's
    position lens - 1 through its block table: what the fused write must leave and attend over."""
    rows, kv, d = table.shape[0], k.shape[2], k.shape[3]
    gen = torch.Generator().manual_seed(seed)
    kn = torch.randn(rows, kv, d, generator=gen).to(k.dtype).to(k.device)
    vn = torch.randn(rows, kv, d, generator=gen).to(v.dtype).to(v.device)
    k2, v2 = k.clone(), v.clone()
    bs = k.shape[1]
    for r in range(rows):
        last = int(lens[r]) - 1
        blk = int(table[r, last // bs])
        k2[blk, last % bs], v2[blk, last % bs] = kn[r], vn[r]
    return kn, vn, k2, v2


INTERPRETED_WRITE = """
    from tests.rollout.test_triton_paged import _with_new_kv, float64_attention, random_case
    from qerl.rollout.triton_paged import paged_decode
    errors = []
    for block_size, split in ((16, 1), (16, 3), (32, 2), (16, 37)):
        q, k, v, table, lens = random_case(3, 4, 2, 16, block_size, [70, 1, 129], torch.float32, "cpu")
        kn, vn, k_want, v_want = _with_new_kv(k, v, table, lens, seed=split)
        out = paged_decode(q, k, v, table, lens, 0.25, split=split, new_kv=(kn.transpose(0, 1).contiguous()
                                                                            .transpose(0, 1), vn))
        errors.append(float((out.double() - float64_attention(q, k_want, v_want, table, lens, 0.25)).abs().max()))
        errors.append(float((k - k_want).abs().max() + (v - v_want).abs().max()))  # exactly the new slots written
    print(json.dumps(errors))
"""


def test_interpreted_kernel_writes_the_steps_kv_and_attends_over_it():
    """new_kv: the launch stores each row's key and value at position lens - 1 (and nowhere else: the caches equal
    the written copies exactly) and its output is attention over the written caches, for every split layout, a
    length-1 row, and a strided key tensor."""
    errors = run_interpreted(INTERPRETED_WRITE, timeout=120)
    assert len(errors) == 8 and max(errors[0::2]) < 1e-5 and max(errors[1::2]) == 0, errors


INTERPRETED_MERGE = """
    import os
    from tests.rollout.test_triton_paged import float64_attention, random_case
    from qerl.quant.kernels import workspace
    from qerl.rollout import triton_split
    from qerl.rollout.triton_paged import paged_decode
    out = []
    for split in (2, 3, 8, 12):  # 8: where the combine launch takes chunks of splits; 12: merged only under "1"
        q, k, v, table, lens = random_case(4, 4, 2, 16, 16, [70, 1, 129, 200], torch.float32, "cpu")
        os.environ["QERL_ATTN_MERGE"] = "0"
        combined = paged_decode(q, k, v, table, lens, 0.25, split=split)
        os.environ["QERL_ATTN_MERGE"] = "1"
        merged = [paged_decode(q, k, v, table, lens, 0.25, split=split) for _ in range(2)]  # re-armed counters
        exact = float64_attention(q, k, v, table, lens, 0.25)
        counts = workspace.held(triton_split.ARRIVALS, q.device)
        out.append([split] + [float((m.double() - exact).abs().max()) for m in merged]
                   + [float((merged[0] - combined).abs().max()), int(counts.abs().sum()),
                      triton_split.merge_in_kernel(split, {}),
                      triton_split.merge_in_kernel(split, {"QERL_ATTN_MERGE": "1"})])
    print(json.dumps(out))
"""


def test_interpreted_kernel_merges_its_splits_as_the_combine_does():
    """MERGE: the last split of each (row, KV head) merges the partials in the decode launch - below
    COMBINE_CHUNKED_FROM splits the combine launch's result exactly (same order), always float64's to rounding,
    twice in a row (every counter left at 0); by default only up to MERGE_MAX_SPLITS splits (beyond them, and with
    QERL_ATTN_MERGE=0, the combine launch), at any count with QERL_ATTN_MERGE=1."""
    from qerl.rollout.triton_split import COMBINE_CHUNKED_FROM, MERGE_MAX_SPLITS

    results = run_interpreted(INTERPRETED_MERGE, timeout=180)
    assert len(results) == 4
    for split, err1, err2, vs_combine, counters, merges_by_default, merges_on in results:
        assert err1 < 1e-5 and err2 < 1e-5 and counters == 0 and merges_on
        assert merges_by_default == (split <= MERGE_MAX_SPLITS)
        assert vs_combine == 0 if split < COMBINE_CHUNKED_FROM else vs_combine < 1e-6


def test_the_merge_switch_is_checked_with_the_other_kernel_switches():
    """QERL_ATTN_MERGE is read at every attention launch; a bad value ends a stage in one line before it starts."""
    from qerl.errors import QerlError
    from qerl.quant.dispatch import check_kernel_environment
    from qerl.rollout.triton_split import merge_in_kernel

    assert merge_in_kernel(2, {}) and not merge_in_kernel(2, {"QERL_ATTN_MERGE": "0"}) and not merge_in_kernel(1, {})
    assert not merge_in_kernel(64, {}) and merge_in_kernel(64, {"QERL_ATTN_MERGE": "1"})
    assert not merge_in_kernel(1, {"QERL_ATTN_MERGE": "1"})
    with pytest.raises(QerlError, match="QERL_ATTN_MERGE"):
        check_kernel_environment({"QERL_ATTN_MERGE": "sometimes"})


@pytest.mark.gpu
@pytest.mark.parametrize("split", [2, 5, 8, 16])
def test_gpu_merged_splits_equal_the_combine_and_replay_from_a_graph(split, monkeypatch):
    """bf16, 7B heads: the in-kernel merge gives the combine launch's output (bit for bit below
    COMBINE_CHUNKED_FROM splits, where both add the splits in order; within a bf16 rounding from there, where the
    combine adds chunks of splits), eagerly and replayed from a captured graph after q changed in place (the
    arrival counters re-arm on every launch)."""
    from qerl.rollout.triton_paged import paged_decode
    from qerl.rollout.triton_split import COMBINE_CHUNKED_FROM

    q, k, v, table, lens = random_case(6, 28, 4, 128, 16, [1, 17, 300, 1000, 4608, 65], torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    monkeypatch.setenv("QERL_ATTN_MERGE", "1")  # merged at every split count

    def combined():
        monkeypatch.setenv("QERL_ATTN_MERGE", "0")
        want = paged_decode(q, k, v, table, lens, scale, split=split)
        monkeypatch.setenv("QERL_ATTN_MERGE", "1")
        return want

    def check(got, want):
        if split < COMBINE_CHUNKED_FROM:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()

    check(paged_decode(q, k, v, table, lens, scale, split=split), combined())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode(q, k, v, table, lens, scale, split=split)  # warm-up on the capture's side of the fence
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_decode(q, k, v, table, lens, scale, split=split)
    for seed in (1, 2, 3):
        q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q))
        graph.replay()
        torch.cuda.synchronize()
        check(captured, combined())
        exact = float64_attention(q, k, v, table, lens, scale)
        assert (captured.double().cpu() - exact).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("split", [None, 1, 5])
def test_gpu_kernel_writes_the_steps_kv_bf16(split):
    from qerl.rollout.triton_paged import paged_decode

    lengths = [1, 17, 300, 1000, 4608, 65]
    q, k, v, table, lens = random_case(6, 28, 4, 128, 16, lengths, torch.bfloat16, "cuda")
    kn, vn, k_want, v_want = _with_new_kv(k, v, table, lens, seed=7)
    scale = 128 ** -0.5
    out = paged_decode(q, k, v, table, lens, scale, split=split, new_kv=(kn, vn))
    torch.testing.assert_close(k, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v, v_want, rtol=0, atol=0)
    plain = paged_decode(q, k_want, v_want, table, lens, scale, split=split)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)  # same tiles, same order: bit for bit
    exact = float64_attention(q, k_want, v_want, table, lens, scale)
    assert (out.double().cpu() - exact).abs().max().item() < 1e-2
    with pytest.raises(ValueError, match="new_kv"):
        paged_decode(q, k, v, table, lens, scale, new_kv=(kn.float(), vn))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("split", [None, 1])
def test_gpu_kernel_matches_reference_bf16(block_size, split):
    from qerl.rollout.triton_paged import paged_decode

    lengths = [1, 17, 300, 1000, 4608, 65]
    q, k, v, table, lens = random_case(6, 28, 4, 128, block_size, lengths, torch.bfloat16, "cuda")
    scale = 128 ** -0.5
    out = paged_decode(q, k, v, table, lens, scale, split=split)
    exact = float64_attention(q, k, v, table, lens, scale)
    meta = PagedMeta(pool=Pool(block_size), slot_mapping=None, decode_tokens=None, decode_table=table,
                     decode_lens=lens, prefill=[], decode_max_len=max(lengths))
    ref = _decode_reference(q, k, v, meta, scale)
    kernel_err = (out.double().cpu() - exact).abs().max().item()
    ref_err = (ref.double().cpu() - exact).abs().max().item()
    assert kernel_err <= max(2 * ref_err, 1e-2), (kernel_err, ref_err)


@pytest.mark.gpu
def test_gpu_kernel_float32_is_exact_and_pads_read_the_null_block():
    """fp32 caches use IEEE dots (no TF32); a padded row (null block, length 1) gives that slot's value."""
    from qerl.rollout.triton_paged import paged_decode

    q, k, v, table, lens = random_case(4, 14, 2, 64, 16, [5, 40, 1, 333], torch.float32, "cuda")
    table[2] = 0
    out = paged_decode(q, k, v, table, lens, 0.125)
    assert (out.double().cpu() - float64_attention(q, k, v, table, lens, 0.125)).abs().max() < 1e-5
    assert torch.allclose(out[2], v[0, 0].repeat_interleave(7, 0), atol=1e-6)


def test_default_split_fills_the_gpu_within_its_caps(monkeypatch):
    """Splits make 3 programs per SM (132 SMs here), never more than the table's tiles, nor than 8 on a table up to
    4,096 keys wide, nor than one per 512 keys of a wider one; it reads shapes only (a captured step keeps it)."""
    from qerl.rollout import triton_paged

    monkeypatch.setattr(triton_paged, "target_programs", lambda device: 264)
    split = functools.partial(triton_paged.default_split, device=torch.device("cpu"))
    assert [split(rows, 4, 4368) for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256)] == [8, 8, 8, 8, 7, 4, 2, 1, 1]
    assert split(1, 4, 16384) == 32 and split(1, 8, 16384) == 32 and split(2, 8, 65536) == 25
    assert split(1, 4, 100) == 2  # two 64-key tiles
    assert split(1, 4, 16) == 1
    for rows in (1, 3, 7, 40, 300):
        for width in (64, 1000, 4368, 20000):
            n = split(rows, 4, width)
            assert 1 <= n <= max(1, -(-width // triton_paged.BLOCK_L))
            assert n <= max(triton_paged.SPLIT_CAP, width // triton_paged.SPLIT_KEYS)
            assert n == 1 or rows * 4 * (n - 1) < 396  # one split fewer would not fill the GPU
