"""The hand-written CUDA few-row kernel (qerl.quant.kernels.cuda_fp4, QERL_FP4_CUDA) vs float64 and Triton."""
from __future__ import annotations

import pytest
import torch

from qerl.quant import dispatch
from qerl.quant.dispatch import run_fp4_matmul
from qerl.quant.kernels import cuda_build, cuda_fp4, device

COMPILERS = cuda_build.compilers()
HAS_COMPILER = bool(COMPILERS)


@pytest.mark.parametrize("name,read", [("QERL_FP4_CUDA", dispatch.fp4_cuda_mode), ("QERL_PDL", device.pdl_mode)])
def test_env_modes(monkeypatch, name, read):
    monkeypatch.delenv(name, raising=False)
    assert read() == "auto"
    monkeypatch.setenv(name, " 0 ")
    assert read() == "0"
    monkeypatch.setenv(name, "1")
    assert read() == "1"
    monkeypatch.setenv(name, "yes")
    with pytest.raises(ValueError, match=name):
        read()


def test_cpu_is_outside_the_envelope(monkeypatch):
    monkeypatch.setenv("QERL_FP4_CUDA", "1")
    assert dispatch.choose_kernel("forward", "cpu", (0, 0), 4) == "reference"
    assert dispatch.AUTO_ROWS <= cuda_fp4.MAX_ROWS == 16


def test_auto_mode_warns_once_and_falls_back_when_nothing_builds(monkeypatch):
    def broken(_device):
        raise RuntimeError("NVRTC not found")

    monkeypatch.setattr(cuda_fp4, "_module", broken)
    cuda_fp4.built.cache_clear()
    try:
        with pytest.warns(UserWarning, match="stay on Triton"):
            assert cuda_fp4.built(0) is False
        assert cuda_fp4.built(0) is False  # cached: no second warning, no second build
    finally:
        cuda_fp4.built.cache_clear()


def test_compilers_lists_what_compile_cubin_would_try(monkeypatch):
    monkeypatch.setattr(cuda_build, "_find_nvcc", lambda nvcc=None: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(cuda_build, "_find_nvrtc", lambda: ("libnvrtc.so", "include"))
    assert cuda_build.compilers() == ["nvcc", "nvrtc"]
    monkeypatch.setattr(cuda_build, "_find_nvcc", lambda nvcc=None: None)
    assert cuda_build.compilers() == ["nvrtc"]
    monkeypatch.setattr(cuda_build, "_find_nvrtc", lambda: None)
    assert cuda_build.compilers() == []


def test_missing_compilers_are_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="nvcc not found"):
        cuda_build.compile_cubin(cuda_fp4.source(), "sm_90", compiler="nvcc", nvcc=str(tmp_path / "nvcc"))
    monkeypatch.setattr(cuda_build, "_find_nvrtc", lambda: None)
    with pytest.raises(RuntimeError, match="NVRTC not found"):
        cuda_build.compile_cubin(cuda_fp4.source(), "sm_90", nvcc=str(tmp_path / "nvcc"))




@pytest.mark.skipif(not COMPILERS, reason="needs nvcc or NVRTC")
@pytest.mark.parametrize("compiler", COMPILERS or ["none"])
def test_source_builds_for_hopper_and_ada(compiler):
    cubin = cuda_build.compile_cubin("#define QERL_CLUSTERS 1\n" + cuda_fp4.source(), "sm_90", compiler=compiler)
    assert cubin[:4] == b"\x7fELF"
    for nt in (1, 2):
        for s in cuda_fp4.CLUSTER_SIZES:
            assert cuda_fp4.kernel_name(nt, s).encode() in cubin
    ada = cuda_build.compile_cubin(cuda_fp4.source(), "sm_89", compiler=compiler)  # no clusters: one-CTA kernels only
    assert cuda_fp4.kernel_name(2, 1).encode() in ada and cuda_fp4.kernel_name(1, 2).encode() not in ada


def test_source_is_the_cu_file_with_each_marker_filled_once():
    """fp4_gemv.cu ships with the package and its two marker lines become the generated decode8 and #defines."""
    text = cuda_fp4.SOURCE_FILE.read_text()
    source = cuda_fp4.source()
    assert "// QERL_DECODE8\n" in text and "// QERL_LIMITS\n" in text
    assert "\n// QERL_DECODE8\n" not in source and "\n// QERL_LIMITS\n" not in source
    assert source.count("void decode8(") == 1
    assert source.count("#define MAX_WARPS 16\n#define MAX_FUSED_RANK 128\n") == 1
    assert '"qerl.quant.kernels" = ["*.cu"]' in (cuda_fp4.SOURCE_FILE.parents[3] / "pyproject.toml").read_text()


def test_cuda_decode_is_the_emulator_checked_ptx():
    from qerl.quant.kernels import _e2m1 as ptx

    body = cuda_fp4.source().split("void decode8(", 1)[1].split("}\n", 1)[0] + "}\n"
    asm = [line.strip()[1:-3] for line in body.splitlines() if line.strip().startswith('"')]
    want = [line.replace("$6", "$5").replace("$7", "$5").replace("$8", "$5").replace("$", "%")
            for line in ptx.E2M1_BF16.strip().splitlines()]
    assert asm == want and len(want) == 21  # braces, .reg, 19 instructions


def _occupancy(warps: int) -> int:  # ~80 registers per thread, 64 warps and 32 CTAs per SM at most
    return min(65536 // (80 * 32 * warps), 64 // warps, 32)


@pytest.mark.parametrize("n,k", [(3584, 3584), (4608, 3584), (37888, 3584), (3584, 18944), (512, 3584), (16, 128),
                                 (32, 256), (5120, 27648), (152064, 3584)])
@pytest.mark.parametrize("clusters", [True, False])
def test_picked_config_is_the_model_minimum_and_gives_every_warp_work(n, k, clusters):
    cands = cuda_fp4.candidate_configs(k, clusters)
    cluster, warps = cuda_fp4.pick_config(n, k, 132, _occupancy, clusters)
    assert (cluster, warps) in cands
    assert cluster * warps == 1 or k // 128 >= 2 * cluster * warps  # >= 2 chunks of 128 per warp
    assert clusters or cluster == 1
    best = min(cuda_fp4.model_time(n, k, s, w, 132, _occupancy(w)) for s, w in cands)
    assert cuda_fp4.model_time(n, k, cluster, warps, 132, _occupancy(warps)) == best


def test_model_scales_its_bandwidth_bound_step_with_the_device():
    """A faster memory makes a bandwidth-bound step cheaper: 0.08 on the H100 it was fitted on, less in proportion
    on a faster device; and the H200's own measurements pick 10 warps for o (3,584 x 3,584), not the H100's 7."""
    assert cuda_fp4.step_over_latency(None) == 0.08
    assert cuda_fp4.step_over_latency(cuda_fp4.FIT_BANDWIDTH) == pytest.approx(0.08)
    assert cuda_fp4.step_over_latency(2 * cuda_fp4.FIT_BANDWIDTH) == pytest.approx(0.04)
    h200 = 2 * 3.201e9 * 6144 / 8  # memory clock 3,201 MHz, 6,144-bit bus
    assert cuda_fp4.pick_config(3584, 3584, 132, _occupancy, True) == (1, 7)
    assert cuda_fp4.pick_config(3584, 3584, 132, _occupancy, True, bandwidth=h200) == (1, 10)
    assert cuda_fp4.pick_config(37888, 3584, 132, _occupancy, True, bandwidth=h200) == (1, 4)  # measured best too


def test_model_prefers_splitting_k_when_rows_are_few():
    # down (N 3584, K 18944): 224 row blocks on 132 SMs: one warp per block would leave most SMs a single warp
    few = cuda_fp4.model_time(3584, 18944, 1, 1, 132, _occupancy(1))
    split = cuda_fp4.model_time(3584, 18944, *cuda_fp4.pick_config(3584, 18944, 132, _occupancy, True), 132,
                                _occupancy(cuda_fp4.pick_config(3584, 18944, 132, _occupancy, True)[1]))
    assert split < few / 4
    # many rows (lm_head-sized): no cluster needed to fill the GPU
    assert cuda_fp4.pick_config(152064, 3584, 132, _occupancy, True)[0] == 1


gpu = pytest.mark.gpu


@pytest.fixture
def on(monkeypatch):
    if not HAS_COMPILER:
        pytest.skip("needs nvcc or NVRTC")
    monkeypatch.setenv("QERL_FP4_CUDA", "1")
    from qerl.quant.kernels import triton_fp4

    return triton_fp4


def _case(sizes, rows, k=1024, rank=16, seed=0):
    from test_triton_fp4 import _stacked_case

    return _stacked_case(sizes, rows, rank=rank, k=k, seed=seed)


def _err(out, ref):
    out = out.double()
    assert out.isfinite().all()
    return ((out - ref).norm() / ref.norm()).item(), ((out - ref).abs().amax() / ref.abs().amax()).item()


def _captured(fn):
    """fn() run once on a side stream (workspaces and kernels before capture), then captured there: (graph, the
    captured call's output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    return graph, out


@gpu
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 16])
@pytest.mark.parametrize("sizes,k", [((96,), 1024), ((64, 16, 16), 1024), ((3584, 512, 512), 3584),
                                     ((3584,), 18944)])
def test_matches_float64_with_bias_lora_and_segments(on, rows, sizes, k):
    (x, packed, scale, gs, bias, a, b), ref = _case(sizes, rows, k=k)
    calls = []
    real = cuda_fp4.fp4_matmul_cuda
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_fp4, "fp4_matmul_cuda", lambda *aa, **kw: calls.append(1) or real(*aa, **kw))
        out = run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.5, segments=list(sizes))
    assert calls, "the CUDA kernel did not run"
    frob, worst = _err(out, ref)
    assert frob < 5e-3 and worst < 2e-2, f"{sizes} rows {rows}: rel err {frob:.2e}, max {worst:.2e}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QERL_FP4_CUDA", "0")
        triton_out = run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.5, segments=list(sizes))
    # x @ A.T is summed in another order than Triton's and rounded to bf16 before the (30 x randn) B: compare as a
    # whole, element bounds are against float64 above
    assert ((out.double() - triton_out.double()).norm() / triton_out.double().norm()).item() < 5e-3


@gpu
@pytest.mark.parametrize("rows", [6, 12])
@pytest.mark.parametrize("config", [(1, 1), (1, 3), (1, 16), (2, 4), (4, 2), (8, 1), (8, 2)])
def test_every_config_is_exact_and_deterministic(on, config, rows):
    from qerl.quant.format import dequantize_nvfp4
    from test_triton_fp4 import _random_fp4

    if config[0] > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    packed, scale, gs = _random_fp4(160, 4096, seed=config[0] * 17 + config[1])
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ dequantize_nvfp4(packed, scale, gs, torch.float64).T
    out = cuda_fp4.fp4_matmul_cuda(x, packed, scale, gs.reshape(1), None, None, None, 1.0, 160, 160, config=config)
    frob, worst = _err(out, ref)
    assert frob < 5e-3 and worst < 2e-2, f"{config} rows {rows}: rel err {frob:.2e}, max {worst:.2e}"
    again = cuda_fp4.fp4_matmul_cuda(x, packed, scale, gs.reshape(1), None, None, None, 1.0, 160, 160,
                                     config=config)
    torch.testing.assert_close(out, again, rtol=0, atol=0)  # no atomics: the same sums in the same order


@gpu
@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("config", [(1, 4), (2, 3), (1, 1)])
def test_lora_a_in_the_same_launch_equals_a_given_xa(on, rows, config):
    from qerl.quant.kernels.triton_fp4 import small_matmul

    if config[0] > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    sizes = (512, 64, 64)
    (x, packed, scale, gs, bias, a, b), ref = _case(sizes, rows, k=1024, rank=16)
    first = cuda_fp4.fp4_matmul_cuda(x, packed, scale, gs, bias, None, b, 0.5, 512, 576, config=config, lora_a=a)
    assert _err(first, ref)[0] < 5e-3
    for x_i in (x.flip(0), -x, x):  # each launch must wait for its own x @ A.T (the flags were reset)
        fused = cuda_fp4.fp4_matmul_cuda(x_i, packed, scale, gs, bias, None, b, 0.5, 512, 576, config=config,
                                         lora_a=a)
        given = cuda_fp4.fp4_matmul_cuda(x_i, packed, scale, gs, bias, small_matmul(x_i, a), b, 0.5, 512, 576,
                                         config=config)
        # xa rounded to bf16 after different sum orders: as a whole (a stale xa would be off by ~100%)
        assert ((fused.double() - given.double()).norm() / given.double().norm()).item() < 5e-3
    torch.testing.assert_close(fused, first, rtol=0, atol=0)  # same input, same launch: same bits


def test_a_splits_give_each_warp_about_two_chunks():
    for k, cluster, warps in [(3584, 1, 4), (18944, 1, 10), (3584, 2, 3), (128, 1, 1), (27648, 1, 4)]:
        sa = cuda_fp4.a_splits(k, cluster, warps)
        assert 1 <= sa <= cuda_fp4.MAX_A_SPLITS
        per_warp = k // 128 / (sa * cluster * warps)
        assert per_warp <= 2 or sa == cuda_fp4.MAX_A_SPLITS
        assert sa == 1 or per_warp > 1


@gpu
@pytest.mark.parametrize("unfused", [False, True])
@pytest.mark.parametrize("rank", [5, 8, 16, 24, 64, 128])
def test_lora_ranks_that_are_not_multiples_of_16(on, rank, unfused, monkeypatch):
    if unfused:  # ranks above MAX_FUSED_RANK take x @ A.T from small_matmul
        monkeypatch.setattr(cuda_fp4, "MAX_FUSED_RANK", rank - 1)
    (x, packed, scale, gs, bias, a, b), ref = _case((256, 64, 64), 5, k=1024, rank=rank)
    out = run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.5, segments=[256, 64, 64])
    frob, worst = _err(out, ref)
    assert frob < 5e-3 and worst < 2e-2, f"rank {rank}: rel err {frob:.2e}, max {worst:.2e}"


def test_launch_structs_match_cuda_h():
    import ctypes

    # cuda.h: CUlaunchAttribute = {id, pad to 8, 64-byte value union}; CUlaunchConfig = 7 unsigned, stream,
    # attrs, numAttrs (64-bit pointers)
    assert ctypes.sizeof(cuda_build._LaunchAttribute) == 72 and cuda_build._LaunchAttribute.value.offset == 8
    assert cuda_build._LaunchConfig.stream.offset == 32 and cuda_build._LaunchConfig.attrs.offset == 40
    assert ctypes.sizeof(cuda_build._LaunchConfig) == 56


@gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("rows", [8, 40])  # the CUDA kernel (x @ A.T inside); Triton's small_matmul + FP4 kernel
def test_dependent_launches_read_the_previous_output(on, pdl, rows, monkeypatch):
    """A chain y_i+1 = f(y_i) of LoRA matmuls (each reads the output and reuses the workspace of the one before)
    with programmatic dependent launch gives the bits of the chain without it."""
    (x, packed, scale, gs, bias, a, b), _ = _case((1024,), rows, k=1024, rank=16)

    def chain():
        y = x
        for _ in range(3):
            for _ in range(2):  # back to back: the second launch's predecessor is the first
                y = run_fp4_matmul(y, packed, scale, gs, bias, a, b, 0.5)
            y = y / y.float().square().mean().sqrt().to(y.dtype)  # a torch kernel in between; bounded scale
        return y

    monkeypatch.setenv("QERL_PDL", "0")
    plain = chain()
    monkeypatch.setenv("QERL_PDL", pdl)
    assert device.use_pdl(x.device.index or 0) == (pdl == "1" and torch.cuda.get_device_capability()[0] >= 9)
    torch.testing.assert_close(chain(), plain, rtol=0, atol=0)


def test_only_the_lora_launch_waits_late_and_only_with_pdl(monkeypatch):
    """WAIT_LATE (the FP4 kernel reads x and W before waiting for the kernel before it) is asked for only where
    the launcher knows that kernel is small_matmul's x @ A.T, and only under programmatic dependent launch."""
    pytest.importorskip("triton")
    from qerl.quant.kernels import triton_fp4

    dev = torch.device("cuda", 0)
    for pdl in (True, False):
        monkeypatch.setattr(triton_fp4, "use_pdl", lambda index, pdl=pdl: pdl)
        on_lora = triton_fp4.pdl_options(dev, wait_late=True)
        plain = triton_fp4.pdl_options(dev)
        assert on_lora == ({"PDL": True, "launch_pdl": True, "WAIT_LATE": True} if pdl else {})
        assert plain == ({"PDL": True, "launch_pdl": True} if pdl else {})


@gpu
@pytest.mark.parametrize("rows", [24, 40, 64])  # past the CUDA kernel's rows: small_matmul + the Triton kernel
def test_waiting_late_in_a_graph_gives_the_same_bits(on, rows, monkeypatch):
    """In a captured CUDA graph (PDL by default on Hopper), a chain of stacked LoRA layers whose x each comes from
    the FP4 launch right before it (a kernel that writes its output after letting the next launch start): the
    FP4 kernels that wait late give the bits of those that wait first, and of launches without PDL."""
    (x, packed, scale, gs, bias, a, b), _ = _case((2048, 1024, 1024), rows, k=4096, rank=32)  # N = K

    def chain(x_in):
        y = x_in
        for _ in range(4):  # nothing in between: each x comes straight from the FP4 launch before
            y = run_fp4_matmul(y, packed, scale, gs, bias, a, b, 0.5, segments=[2048, 1024, 1024])
        return y

    outs = {}
    for label, pdl, overlap in (("plain", "0", False), ("first", "auto", False), ("late", "auto", True)):
        monkeypatch.setenv("QERL_PDL", pdl)
        monkeypatch.setattr(on, "LORA_OVERLAP", overlap)
        static_x = x.clone()
        graph, out = _captured(lambda: chain(static_x))
        static_x.copy_(x * 2)
        graph.replay()
        torch.cuda.synchronize()
        outs[label] = out.clone()
    assert outs["plain"].isfinite().all() and outs["plain"].abs().amax() > 0
    torch.testing.assert_close(outs["first"], outs["plain"], rtol=0, atol=0)
    torch.testing.assert_close(outs["late"], outs["plain"], rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("config", [(1, 4), (2, 2)])
def test_more_lora_a_units_than_weight_blocks(on, config):
    """N = 16 (one weight block) and rank 64 over K = 4096: more x @ A.T units than weight blocks."""
    if config[0] > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters need sm_90")
    (x, packed, scale, gs, bias, a, b), ref = _case((16,), 3, k=4096, rank=64)
    assert -(-a.shape[0] // 16) * cuda_fp4.a_splits(4096, *config) > 1
    out = cuda_fp4.fp4_matmul_cuda(x, packed, scale, gs, bias, None, b, 0.5, 16, 16, config=config, lora_a=a)
    frob, worst = _err(out, ref)
    assert frob < 5e-3 and worst < 2e-2, f"rel err {frob:.2e}, max {worst:.2e}"


@gpu
def test_cuda_graph_replay_equals_eager(on):
    (x, packed, scale, gs, bias, a, b), ref = _case((3584, 512, 512), 8, k=3584)
    args = (packed, scale, gs, bias, a, b, 0.5)
    eager = run_fp4_matmul(x, *args, segments=[3584, 512, 512])
    static_x = x.clone()
    graph, static_out = _captured(lambda: run_fp4_matmul(static_x, *args, segments=[3584, 512, 512]))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, rtol=1e-2, atol=1e-2)
    assert _err(static_out, ref)[0] < 5e-3


@gpu
def test_auto_mode_takes_up_to_8_rows_on_hopper(monkeypatch):
    if not HAS_COMPILER or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("auto mode: sm_90+ with nvcc or NVRTC")
    monkeypatch.delenv("QERL_FP4_CUDA", raising=False)
    calls = []
    real = cuda_fp4.fp4_matmul_cuda
    monkeypatch.setattr(cuda_fp4, "fp4_matmul_cuda",
                        lambda *aa, **kw: calls.append(aa[0].shape[0]) or real(*aa, **kw))
    for rows in (8, 9):
        (x, packed, scale, gs, bias, a, b), ref = _case((96,), rows)
        assert _err(run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.5), ref)[0] < 5e-3
    assert calls == [8]


@gpu
def test_outside_the_envelope_stays_on_triton(on, monkeypatch):
    (x, packed, scale, gs, bias, a, b), ref = _case((96,), 17)
    monkeypatch.setattr(cuda_fp4, "fp4_matmul_cuda", lambda *aa, **kw: pytest.fail("CUDA kernel used"))
    out = run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.5)  # 17 rows
    assert _err(out, ref)[0] < 5e-3
    run_fp4_matmul(x[:4].half(), packed, scale, gs, bias.half(), a.half(), b.half(), 0.5)  # fp16
