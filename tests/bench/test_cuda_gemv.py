"""qerl.bench.cuda_gemv: the CUDA prototype builds, reports, and matches the float64 reference on a GPU."""
from __future__ import annotations

import functools

import pytest
import torch

from qerl.bench import cuda_gemv
from qerl.quant import cuda_fp4

HAS_NVCC = "nvcc" in cuda_fp4.compilers()


def test_missing_compilers_are_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="nvcc not found"):
        cuda_gemv.compile_cubin("sm_90", nvcc=str(tmp_path / "no-nvcc"), compiler="nvcc")
    monkeypatch.setattr(cuda_fp4, "_find_nvrtc", lambda: None)
    with pytest.raises(RuntimeError, match="NVRTC not found"):
        cuda_gemv.compile_cubin("sm_90", nvcc=str(tmp_path / "no-nvcc"))  # auto: no nvcc -> NVRTC


@pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit's nvcc")
def test_source_builds_for_hopper():
    cubin = cuda_gemv.compile_cubin("sm_90")
    assert cubin[:4] == b"\x7fELF" and b"fp4_gemv_m8" in cubin


def test_markdown_ratio():
    row = {"layer": "down", "N": 3584, "K": 18944, "M": 8, "floor_us": 12.8, "triton_us": 24.6, "best_us": 20.5,
           "best_full_us": 25.3}
    lines = cuda_gemv.markdown({"rows": [row, {**row, "layer": "gate|up"}]}).splitlines()
    assert lines[2] == "| down | 3584 x 18944 | 8 | 12.8 | 24.6 | 20.5 | 25.3 | 1.20x |"
    assert lines[3].startswith("| gate\\|up | 3584 x 18944 |") and lines[3].count(" | ") == 7


def test_wired_markdown_rows_and_layer_totals():
    def row(layer, n, k, scale):
        return {"model": "7B", "layer": layer, "N": n, "K": k, "M": 8, "floor_us": 1.0 * scale,
                "bf16_us": 10.0 * scale, "triton_us": 5.0 * scale, "chosen_us": 4.0 * scale, "chosen": [1, 8],
                "best_us": 3.0 * scale, "best": [2, 4], "lora_triton_us": 6.0 * scale, "lora_cuda_us": 4.5 * scale}

    lines = cuda_gemv.wired_markdown({"rows": [row("q|k|v", 4608, 3584, 1), row("down", 3584, 18944, 3)]})
    lines = lines.splitlines()
    assert lines[2] == ("| 7B | q\\|k\\|v | 4608 x 3584 | 8 | 1.0 | 10.0 | 5.0 | 4.0 (1, 8) | 3.0 (2, 4) | 1.25x | "
                        "2.50x | 6.0 | 4.5 |")
    assert lines[4] == "| 7B | **layer** | | 8 | 4.0 | 40.0 | 20.0 | 16.0 | 12.0 | 1.25x | 2.50x | 24.0 | 18.0 |"


@functools.lru_cache(maxsize=None)
def _kernel(compiler: str) -> cuda_gemv.CudaGemv:
    major, minor = torch.cuda.get_device_capability()
    return cuda_gemv.CudaGemv(cuda_gemv.compile_cubin(f"sm_{major}{minor}", compiler=compiler))


COMPILERS = cuda_fp4.compilers()


@pytest.mark.gpu
@pytest.mark.skipif(not COMPILERS, reason="needs nvcc or NVRTC")
@pytest.mark.parametrize("compiler", COMPILERS or ["none"])
@pytest.mark.parametrize("variant", sorted(cuda_gemv.KERNELS))
@pytest.mark.parametrize("m,splits", [(1, 1), (5, 3), (8, 4)])
def test_matches_float64_reference(m, splits, variant, compiler):
    from qerl.bench.kernels import fp4_reference
    from qerl.quant.format import quantize_nvfp4

    kern = _kernel(compiler)
    torch.manual_seed(m)
    wp, ws, gs = quantize_nvfp4(torch.randn(96, 1024, device="cuda"))
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(m, 96, device="cuda", dtype=torch.float32)
    wk = cuda_gemv.tile_packed(wp) if variant == "tiled" else wp
    kern(wk, ws.view(torch.uint8), x, out, splits, 4, variant)
    got = out.double() * (128.0 / gs.double())
    ref = fp4_reference(x, wp, ws, gs)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5  # fp32 sums of exact bf16 products


def test_tiled_layout_is_a_permutation_of_the_rows_chunks():
    w = torch.randint(0, 256, (32, 256), dtype=torch.uint8)
    t = cuda_gemv.tile_packed(w).view(-1)
    # block 1 (rows 16..31), chunk 2 (bytes 128..191 of each row), row 5 of the block: one contiguous 64-byte run
    start = ((1 * 4 + 2) * 16 + 5) * 64
    assert torch.equal(t[start:start + 64], w[16 + 5, 128:192])


def test_prototype_limits_are_checked():
    kern = object.__new__(cuda_gemv.CudaGemv)
    with pytest.raises(ValueError, match="prototype limits"):
        kern(torch.zeros(16, 64, dtype=torch.uint8), torch.zeros(16, 8, dtype=torch.uint8),
             torch.zeros(9, 128, dtype=torch.bfloat16), torch.zeros(9, 16), 1)
