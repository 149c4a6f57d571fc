"""bench.rollout_profile.summarize: busy time as the union of kernel spans, idle gaps, kinds (hand-built spans)."""
from __future__ import annotations

import pytest

from bench.rollout_profile import GAP_US, format_profile, summarize


def test_busy_is_the_union_and_gaps_are_counted_from_the_threshold():
    spans = [(0.0, 10.0, "humming_gemm"), (5.0, 12.0, "_lora_expand_kernel"),  # overlapping: busy 12
             (12.0 + GAP_US / 2, 40.0, "paged_attention_kernel"),  # a short gap: launch latency, not idle
             (40.0 + 3 * GAP_US, 50.0 + 3 * GAP_US, "triton_poi_fused_add"),  # an idle stretch of 3 GAP_US
             (45.0 + 3 * GAP_US, 48.0 + 3 * GAP_US, "_small_mm_kernel")]  # inside the previous span
    got = summarize(spans, wall_s=1.0)
    busy_us = 12.0 + (40.0 - 12.0 - GAP_US / 2) + 10.0
    assert got["busy_s"] == pytest.approx(busy_us / 1e6)
    assert got["idle_gaps"] == 1 and got["idle_gaps_s"] == pytest.approx(3 * GAP_US / 1e6)
    assert got["by_kind"]["lora"]["count"] == 2
    assert got["by_kind"]["fp4_matmul"]["s"] == pytest.approx(10e-6)
    assert got["by_kind"]["attention"]["count"] == 1
    assert got["gpu_span_s"] == pytest.approx((50.0 + 3 * GAP_US) / 1e6)
    assert "idle" in format_profile("fp4+lora", got, 0.9)
    top = got["top_kernels"]  # by time: the attention span (28 - GAP_US / 2 us) first, then humming's 10 us
    assert [t["name"] for t in top[:2]] == ["paged_attention_kernel", "humming_gemm"]
    assert top[1] == {"name": "humming_gemm", "kind": "fp4_matmul", "count": 1, "s": pytest.approx(10e-6)}
    assert sum(t["s"] for t in top) == pytest.approx(sum(v["s"] for v in got["by_kind"].values()))
    assert "humming_gemm" in format_profile("fp4+lora", got, 0.9)


def test_inductor_kernels_and_the_attention_combine_are_named_by_what_they_do():
    from bench.rollout_profile import _kind

    assert _kind("triton_poi_fused_fp4_lora_matmul_mul_silu_split_with_sizes_1") == "norm_rope_act"
    assert _kind("triton_red_fused_add_mean_pow_rsqrt_0") == "norm_rope_act"
    assert _kind("_combine_kernel") == _kind("_combine_heads_kernel") == "attention"
    assert _kind("fp4_mm_n1_s1") == _kind("_fp4_mm_kernel") == "fp4_matmul"
    assert _kind("_lora_expand_kernel") == "lora"


def test_no_kernels_is_an_empty_summary():
    got = summarize([], wall_s=0.5)
    assert got["busy_s"] == 0 and got["idle_gaps"] == 0 and got["by_kind"] == {} and got["top_kernels"] == []
