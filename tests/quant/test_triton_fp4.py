"""Triton NVFP4 kernels vs float64 references on every Linear shape of Qwen2.5 7B/14B/32B (GPU only)."""
from __future__ import annotations

import pytest
import torch

from qerl.quant.dispatch import run_fp4_matmul, run_fp4_matmul_t
from qerl.quant.format import dequantize_nvfp4, quantize_nvfp4

pytestmark = pytest.mark.gpu

# (model, names, out_features N, in_features K): every distinct Linear shape of the three models.
QWEN_SHAPES = [
    ("7B", "q/o", 3584, 3584), ("7B", "k/v", 512, 3584), ("7B", "gate/up", 18944, 3584),
    ("7B", "down", 3584, 18944),
    ("14B", "q/o", 5120, 5120), ("14B", "k/v", 1024, 5120), ("14B", "gate/up", 13824, 5120),
    ("14B", "down", 5120, 13824),
    ("32B", "q/o", 5120, 5120), ("32B", "k/v", 1024, 5120), ("32B", "gate/up", 27648, 5120),
    ("32B", "down", 5120, 27648),
]
DISTINCT = sorted({(n, k) for _, _, n, k in QWEN_SHAPES})
ROWS = (1, 16, 64, 256, 2048)


def _random_fp4(n, k, seed):
    """A quantized random weight whose group scales span the FP8 range (rows scaled over 4 decades)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g)
    w *= torch.logspace(-3, 1, n, device="cuda")[torch.randperm(n, device="cuda", generator=g)].unsqueeze(1)
    return quantize_nvfp4(w)


def _rel_err(out, ref):
    assert out.isfinite().all(), "non-finite output (unwritten or overflowed elements)"
    out = out.double()
    frob = ((out - ref).norm() / ref.norm()).item()
    worst = ((out - ref).abs().amax() / ref.abs().amax()).item()
    return frob, worst


@pytest.fixture(scope="module")
def tf():
    pytest.importorskip("triton")
    from qerl.quant.kernels import triton_fp4

    return triton_fp4


@pytest.mark.parametrize("shape", DISTINCT, ids=[f"{n}x{k}" for n, k in DISTINCT])
def test_forward_and_grad_input_match_float64(tf, shape):
    n, k = shape
    packed, scale, gs = _random_fp4(n, k, seed=n * 7 + k)
    w64 = dequantize_nvfp4(packed, scale, gs, torch.float64)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # fresh inputs for every M
        frob, worst = _rel_err(run_fp4_matmul(x, packed, scale, gs), x.double() @ w64.T)
        assert frob < 5e-3 and worst < 2e-2, f"forward {n}x{k} M={m}: rel err {frob:.2e}, max {worst:.2e}"
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        frob, worst = _rel_err(run_fp4_matmul_t(g, packed, scale, gs), g.double() @ w64)
        assert frob < 5e-3 and worst < 2e-2, f"grad_input {n}x{k} M={m}: rel err {frob:.2e}, max {worst:.2e}"


@pytest.mark.parametrize("use_asm,kernel", [(True, "triton"), (False, "triton"), (True, "dense"), (False, "dense")])
def test_identity_input_reproduces_every_dequantized_weight(tf, use_asm, kernel):
    """x = I turns the matmuls into dequantizers: every byte value and a wide range of scales, to 1 bf16 ulp."""
    n, k = 256, 512
    packed, scale, gs = _random_fp4(n, k, seed=1)
    packed[:, :256] = torch.arange(256, dtype=torch.uint8, device="cuda")  # all nibble pairs in every row
    ref = dequantize_nvfp4(packed, scale, gs, torch.float32)
    tol = ref.abs() * 2.0**-8 + 1e-30
    wt = run_fp4_matmul(torch.eye(k, device="cuda", dtype=torch.bfloat16), packed, scale, gs, use_asm=use_asm,
                        kernel=kernel).float()
    assert ((wt.T - ref).abs() <= tol).all()
    w = run_fp4_matmul_t(torch.eye(n, device="cuda", dtype=torch.bfloat16), packed, scale, gs, use_asm=use_asm,
                         kernel=kernel).float()
    assert ((w - ref).abs() <= tol).all()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-3), (torch.float16, 5e-3), (torch.float32, 2e-3)])
@pytest.mark.parametrize("rows", [3, 300])  # fused and dense paths
def test_other_dtypes_bias_and_leading_dims(tf, dtype, tol, rows):
    n, k = 384, 1024 + 48  # K not a multiple of the K tile: the masked path
    packed, scale, gs = _random_fp4(n, k, seed=2)
    w64 = dequantize_nvfp4(packed, scale, gs, torch.float64)
    x = torch.randn(rows, 5, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = run_fp4_matmul(x, packed, scale, gs, bias)
    assert out.shape == (rows, 5, n) and out.dtype == dtype
    frob, _ = _rel_err(out, x.double() @ w64.T + bias.double())
    assert frob < tol, f"forward rel err {frob:.2e}"
    g = torch.randn(rows, 7, n, device="cuda", dtype=dtype)
    frob, _ = _rel_err(run_fp4_matmul_t(g, packed, scale, gs), g.double() @ w64)
    assert frob < tol, f"grad_input rel err {frob:.2e}"


@pytest.mark.parametrize("rank", [8, 32, 48])  # 48: not a power of two (masked rank columns)
@pytest.mark.parametrize("rows", [1, 16, 64, 300])  # split-K, one-split and dense (addmm) paths
def test_lora_epilogue_matches_float64(tf, rank, rows):
    n, k = 3584, 3584
    packed, scale, gs = _random_fp4(n, k, seed=rank + rows)
    w64 = dequantize_nvfp4(packed, scale, gs, torch.float64)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rank, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = 30 * torch.randn(n, rank, device="cuda", dtype=torch.bfloat16)  # an update of the base output's size
    out = run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.75)
    xa = (x.double() @ a.double().T).to(torch.bfloat16).double()  # the kernel's x @ A.T is rounded to bf16
    lora = 0.75 * xa @ b.double().T
    ref = x.double() @ w64.T + bias.double() + lora
    frob, worst = _rel_err(out, ref)
    assert frob < 5e-3 and worst < 2e-2, f"rows {rows} rank {rank}: rel err {frob:.2e}, max {worst:.2e}"
    assert (lora.norm() / ref.norm()).item() > 0.2  # so an update dropped or misplaced fails the check above


@pytest.mark.parametrize("chunk_rows", [None, 1000, 2048])  # one chunk / 4 chunks, the last short / 2 chunks
def test_dense_path_in_chunks_matches_float64(tf, monkeypatch, chunk_rows):
    """The many-row path with W rebuilt in several chunks (bias and LoRA across chunk boundaries), both ways."""
    from qerl.quant.kernels import triton_dequant

    n, k, rows, rank = 3584, 3584, 300, 16
    if chunk_rows:
        monkeypatch.setattr(triton_dequant, "CHUNK_ELEMENTS", chunk_rows * k)
    assert len(triton_dequant._chunks(n, k, 256)) == {None: 1, 1000: 4, 2048: 2}[chunk_rows]
    packed, scale, gs = _random_fp4(n, k, seed=rows + (chunk_rows or 0))
    w64 = dequantize_nvfp4(packed, scale, gs, torch.float64)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(rank, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = 30 * torch.randn(n, rank, device="cuda", dtype=torch.bfloat16)
    out = run_fp4_matmul(x, packed, scale, gs, bias, a, b, 0.5)
    xa = (x.double() @ a.double().T).to(torch.bfloat16).double()
    frob, worst = _rel_err(out, x.double() @ w64.T + bias.double() + 0.5 * xa @ b.double().T)
    assert frob < 5e-3 and worst < 2e-2, f"forward, chunk rows {chunk_rows}: rel err {frob:.2e}, max {worst:.2e}"
    g = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    frob, worst = _rel_err(run_fp4_matmul_t(g, packed, scale, gs), g.double() @ w64)
    assert frob < 5e-3 and worst < 2e-2, f"grad_input, chunk rows {chunk_rows}: rel err {frob:.2e}, max {worst:.2e}"


@pytest.mark.parametrize("rows", [1, 8, 16, 33, 64])
def test_small_matmul_matches_float64(tf, rows):
    """The single-launch split-K GEMM behind x @ A.T: every rank/width and reduction length, masked edges."""
    for n, k in [(8, 3584), (32, 3584), (48, 1000), (96, 18944), (256, 5120)]:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        out = tf.small_matmul(x, w)
        assert out.shape == (rows, n) and out.dtype == torch.bfloat16
        frob, worst = _rel_err(out, x.double() @ w.double().T)
        assert frob < 5e-3 and worst < 2e-2, f"{rows}x{k} @ {n}x{k}: rel err {frob:.2e}, max {worst:.2e}"
        again = tf.small_matmul(x, w)
        assert torch.equal(out, again)  # fixed summation order, counters re-armed


def _stacked_case(sizes, rows, rank=16, k=3584, seed=0):
    """Stacked weights (own global scales), x, LoRA A blocks and B rows, bias; and their float64 result."""
    parts = [_random_fp4(n, k, seed=seed + n + i) for i, n in enumerate(sizes)]
    assert len({p[2].item() for p in parts}) == len(parts)  # distinct global scales
    packed, scale = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    gs = torch.cat([p[2].reshape(1) for p in parts])
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(len(sizes) * rank, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    b = 30 * torch.randn(sum(sizes), rank, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(sum(sizes), device="cuda", dtype=torch.bfloat16)
    xa = (x.double() @ a.double().T).to(torch.bfloat16).double()
    refs, start = [], 0
    for i, (p, n) in enumerate(zip(parts, sizes)):
        w64 = dequantize_nvfp4(*p, torch.float64)
        refs.append(x.double() @ w64.T + 0.5 * xa[:, i * rank:(i + 1) * rank] @ b[start:start + n].double().T
                    + bias[start:start + n].double())
        start += n
    return (x, packed, scale, gs, bias, a, b), torch.cat(refs, dim=1)


@pytest.mark.parametrize("rows", [1, 16, 64, 300])
@pytest.mark.parametrize("sizes", [(3584, 512, 512), (18944, 18944)])  # q|k|v and gate|up of the 7B
def test_stacked_segments_match_separate_float64(tf, rows, sizes):
    """Several weights in one launch: each segment with its own global scale, LoRA A block and B rows."""
    args, ref = _stacked_case(sizes, rows)
    frob, worst = _rel_err(run_fp4_matmul(*args, 0.5, segments=list(sizes)), ref)
    assert frob < 5e-3 and worst < 2e-2, f"{sizes} rows {rows}: rel err {frob:.2e}, max {worst:.2e}"


@pytest.mark.parametrize("rows", [1, 8, 16, 64, 300])
@pytest.mark.parametrize("sizes", [(3584, 512, 512), (18944, 18944)])
def test_stacked_segments_without_lora_match_float64(tf, rows, sizes):
    """Plain projections stacked (an evaluated checkpoint, qerl.quant.grouped): segments with their own global
    scales and no adapter, on the kernel the dispatcher picks at each row count (CUDA, Triton, chunked dequant)."""
    from qerl.quant.dispatch import fp4_lora_matmul

    (x, packed, scale, gs, bias, a, b), _ = _stacked_case(sizes, rows, seed=5)
    refs, start = [], 0
    for i, n in enumerate(sizes):
        w64 = dequantize_nvfp4(packed[start:start + n], scale[start:start + n], gs[i], torch.float64)
        refs.append(x.double() @ w64.T + bias[start:start + n].double())
        start += n
    out = fp4_lora_matmul(x, packed, scale, gs, bias, None, None, 1.0, list(sizes))
    frob, worst = _rel_err(out, torch.cat(refs, dim=1))
    assert frob < 5e-3 and worst < 2e-2, f"{sizes} rows {rows}: rel err {frob:.2e}, max {worst:.2e}"


@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("bk,split", [(256, 1), (128, 4)])
def test_swapped_operands_match_float64(tf, rows, bk, split):
    """KernelConfig(swap_ab=True) (out.T = W @ x.T, a sweep option) on stacked q|k|v with LoRA and bias."""
    sizes = (3584, 512, 512)
    args, ref = _stacked_case(sizes, rows, seed=7)
    cfg = tf.KernelConfig(16, 32, bk, split, 2, 4, swap_ab=True)
    out = run_fp4_matmul(*args, 0.5, segments=list(sizes), config=cfg)
    frob, worst = _rel_err(out, ref)
    assert frob < 5e-3 and worst < 2e-2, f"rows {rows}: rel err {frob:.2e}, max {worst:.2e}"
    default = run_fp4_matmul(*args, 0.5, segments=list(sizes))
    # two bf16 results summed in different orders: they may differ by an ulp of the largest outputs (|y| ~ 50 with
    # the LoRA term), so the bound is relative to the output's scale, as against float64 above
    frob, worst = _rel_err(out, default.double())
    assert frob < 5e-3 and worst < 2e-2, f"rows {rows}: swapped vs default rel err {frob:.2e}, max {worst:.2e}"


@pytest.mark.parametrize("rows", [40, 65, 128, 300])
def test_many_row_tiles_match_float64(tf, rows):
    """The sm_90+ tiles from 33 rows (W decoded as the wgmma A operand, x by TMA): stacked q|k|v with LoRA and bias,
    rows that leave a partial tile, split-K, an x that TMA cannot address (the pointer loads), a partial K tile."""
    from qerl.quant.kernels.tiling import many_rows_config

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA tiles need sm_90+")
    sizes = (3584, 512, 512)
    args, ref = _stacked_case(sizes, rows, seed=11)
    cfg = many_rows_config(rows, sum(sizes), 3584, torch.device("cuda"))
    assert cfg.swap_ab and cfg.tma and cfg == tf.forward_config(rows, sum(sizes), 3584, torch.device("cuda"))
    x, rest = args[0], args[1:]
    shifted = torch.empty(rows, 3584 + 8, device="cuda", dtype=torch.bfloat16)[:, 1:3585]  # 2-byte aligned rows
    shifted.copy_(x)
    for case, c, xx in (("default", cfg, x), ("split 3", cfg._replace(split=3), x), ("no TMA", cfg, shifted)):
        out = run_fp4_matmul(xx, *rest, 0.5, segments=list(sizes), config=c)
        frob, worst = _rel_err(out, ref)
        assert frob < 5e-3 and worst < 2e-2, f"{case}, rows {rows}: rel err {frob:.2e}, max {worst:.2e}"
    n, k = 384, 1024 + 48  # K tail: masked weight bytes, TMA's zero fill for x
    packed, scale, gs = _random_fp4(n, k, seed=rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = run_fp4_matmul(x, packed, scale, gs, config=many_rows_config(rows, n, k, torch.device("cuda")))
    frob, worst = _rel_err(out, x.double() @ dequantize_nvfp4(packed, scale, gs, torch.float64).T)
    assert frob < 5e-3 and worst < 2e-2, f"K tail, rows {rows}: rel err {frob:.2e}, max {worst:.2e}"


def test_lora_dispatch_on_cuda_equals_the_kernel(tf):
    from qerl.quant.dispatch import fp4_lora_matmul

    packed, scale, gs = _random_fp4(256, 512, seed=6)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 16, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp4_lora_matmul(x, packed, scale, gs, None, a, b, 2.0),
                       run_fp4_matmul(x, packed, scale, gs, None, a, b, 2.0))


def test_split_k_is_deterministic_and_rearms_its_counters(tf):
    """Split-K partials are summed in a fixed order by the last program; repeated calls give identical bits."""
    n, k = 512, 3584
    packed, scale, gs = _random_fp4(n, k, seed=3)
    cfg = tf.forward_config(1, n, k, torch.device("cuda"))
    assert cfg.split > 1
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    outs = [run_fp4_matmul(x, packed, scale, gs) for _ in range(5)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    g = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    grads = [run_fp4_matmul_t(g, packed, scale, gs) for _ in range(5)]
    assert all(torch.equal(grads[0], o) for o in grads[1:])


def test_dispatch_uses_triton_on_cuda(tf):
    from qerl.quant.dispatch import fp4_matmul, fp4_matmul_t

    packed, scale, gs = _random_fp4(256, 512, seed=4)
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp4_matmul(x, packed, scale, gs), run_fp4_matmul(x, packed, scale, gs))
    g = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(fp4_matmul_t(g, packed, scale, gs), run_fp4_matmul_t(g, packed, scale, gs))


def test_bad_inputs_raise_one_line_errors(tf):
    from qerl.errors import QerlError

    packed, scale, gs = _random_fp4(64, 128, seed=5)
    with pytest.raises(QerlError, match="x: last dim"):
        run_fp4_matmul(torch.randn(2, 64, device="cuda"), packed, scale, gs)
    with pytest.raises(QerlError, match="weight_scale"):
        run_fp4_matmul(torch.randn(2, 128, device="cuda"), packed, scale.float(), gs, kernel="triton")
