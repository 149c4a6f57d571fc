"""Triton W4A16 kernels for NVFP4 weights: the fused kernels that `qerl.quant.dispatch` runs for few and mid rows
(up to 128 rows on sm_90+, where x tiles come by TMA and W is the wgmma A operand: kernels.tiling.many_rows_config).

    fp4_matmul_fused(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b, lora_scale, n1, n2, out)
    fp4_matmul_t_fused(g2, weight_packed, weight_scale, weight_global_scale, out)         # g2 @ deq(W)
    small_matmul(x2, w)                                                                    # x2 @ w.T (a LoRA A)

Callers go through qerl.quant.dispatch (run_fp4_matmul, fp4_matmul, ...), which checks the operands, picks the
kernel and allocates the output; these launchers take 2-D operands as dispatch hands them over.

The weight never exists dequantized in device memory: each program loads a tile of packed bytes and FP8 group
scales, turns them into bf16 in registers (e2m1 * scale / 128, exact in bf16), feeds the tensor cores and multiplies
the fp32 accumulator by 128 / global_scale once at the end. Decode shapes (few rows) read 0.5625 bytes per weight
instead of bf16's 2, so they are bandwidth bound and split the reduction across programs (split-K) to fill the GPU;
the partial tiles are summed by the last program to finish (a per-tile counter), so one launch does everything.

Layout (compressed-tensors NVFP4): weight_packed uint8 (N, K/2), column 2j in the low nibble of byte j; code =
sign bit (8) | index into {0, .5, 1, 1.5, 2, 3, 4, 6}; weight_scale float8_e4m3fn (N, K/16); weight_global_scale
float32 (1,); W = e2m1 * scale / global_scale.

The unpacking moves bits in inline PTX (8 weights from one 32-bit word in 17 instructions with the scale multiply,
no lookup table, written straight as the bf16 pairs the tensor-core operand holds); `USE_ASM=False` selects a
plain-Triton decode of the same numbers (slower; kept as the readable reference and for Triton's CPU interpreter).
Triton converts the FP8 scales only from sm_89 on, so the dispatcher (qerl.quant.dispatch) sends older GPUs to the
torch reference path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qerl.errors import QerlError
from qerl.quant.kernels import _e2m1
from qerl.quant.kernels.device import device_index, use_pdl
from qerl.quant.kernels.tiling import KernelConfig, backward_config, forward_config
from qerl.quant.kernels.tiling import k_block as _k_block
from qerl.quant.kernels.tiling import no_empty_splits as _no_empty_splits
from qerl.quant.kernels.tiling import small_split as _small_split
from qerl.quant.kernels.workspace import scratch

# The E2M1 -> bf16 decode (inline PTX, explained in kernels/_e2m1.py): one call turns 4 packed bytes into the 4
# registers of bf16 pairs that the tensor-core operand holds, times the group scale, as e2m1 * scale / DEQ_GAIN.
_E2M1_BF16_ASM = tl.constexpr(_e2m1.E2M1_BF16)
DEQ_GAIN = tl.constexpr(_e2m1.DEQ_GAIN)
_SCALE_UP = tl.constexpr(_e2m1.SCALE_UP)


@triton.jit
def _dequant_tile(p, s, BR: tl.constexpr, BC: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed bytes p (BR, BC/2) uint8 + bf16 group scales s (BR, BC/16) -> e2m1 * scale / DEQ_GAIN (BR, BC) bf16
    (exact)."""
    if USE_ASM:
        s = (s.to(tl.float32) * _SCALE_UP).to(tl.bfloat16)  # exact
        bits = s.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        s2 = tl.reshape(tl.broadcast_to(tl.expand_dims(bits | (bits << 16), 2), (BR, BC // 16, 8)), (BR, BC // 2))
        pair = tl.inline_asm_elementwise(
            _E2M1_BF16_ASM, "=r,=r,=r,=r,r,r,r,r,r", [p, s2], dtype=tl.int32, is_pure=True, pack=4)
        lo = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.reshape(tl.join(lo, hi), (BR, BC))
    else:
        lo = (p & 0xF).to(tl.int32)
        hi = (p >> 4).to(tl.int32)
        c = tl.reshape(tl.join(lo, hi), (BR, BC))
        mag = c & 7
        # magnitudes >= 1 are normal: exponent/mantissa bits shifted into fp32 with the bias moved by 126
        normal = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)
        v = tl.where(mag < 2, mag.to(tl.float32) * 0.5, normal)
        v = tl.where((c & 8) != 0, -v, v)
        v = tl.reshape(v, (BR, BC // 16, 16)) * tl.expand_dims(s.to(tl.float32) * (1.0 / DEQ_GAIN), 2)
        return tl.reshape(v, (BR, BC)).to(tl.bfloat16)


@triton.jit
def _load_weight_tile(wp_ptr, ws_ptr, rows, kt, row_mask, K, swn, ssn, BK: tl.constexpr, EVEN: tl.constexpr):
    """Packed bytes (R, BK/2) and bf16 scales (R, BK/16) of weight rows `rows`, K-tile `kt`.

    Row strides swn (= K/2) and ssn (= K/16) come in as arguments so Triton sees their divisibility by 16 and
    issues 16-byte loads."""
    offs_b = kt * (BK // 2) + tl.arange(0, BK // 2)
    offs_g = kt * (BK // 16) + tl.arange(0, BK // 16)
    p_ptrs = wp_ptr + rows[:, None].to(tl.int64) * swn + offs_b[None, :]
    s_ptrs = ws_ptr + rows[:, None].to(tl.int64) * ssn + offs_g[None, :]
    if EVEN and BK == 64:
        # the tile's 4 scale bytes per row as one int32: a (rows, 4) uint8 load leaves under 4 bytes per thread at
        # 64 rows / 128 threads, which Triton cannot turn into cp.async, so every K step waited for it
        # (7B gate/up, M = 64, H100: long-scoreboard stalls, one memory latency per step)
        s_word_ptrs = ws_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None].to(tl.int64) * (ssn // 4) + kt
        p = tl.load(p_ptrs)
        word = tl.load(s_word_ptrs)  # (R, 1)
        shifts = tl.arange(0, 4)[None, :] * 8
        s = ((word >> shifts) & 0xFF).to(tl.uint8)  # (R, 4): byte j = group j (little endian)
    elif EVEN:
        p = tl.load(p_ptrs)
        s = tl.load(s_ptrs)
    else:
        p = tl.load(p_ptrs, mask=row_mask[:, None] & (offs_b[None, :] < K // 2), other=0)
        s = tl.load(s_ptrs, mask=row_mask[:, None] & (offs_g[None, :] < K // 16), other=0)
    s = s.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    return p, s


@triton.jit
def _load_rows(a_ptr, rows, cols, R, C, sr, sc, EVEN_R: tl.constexpr, EVEN_C: tl.constexpr):
    """An activation tile; rows past R are masked (zero-filled, no memory traffic), e.g. 15 of 16 when M = 1."""
    ptrs = a_ptr + rows[:, None].to(tl.int64) * sr + cols[None, :] * sc
    if EVEN_R and EVEN_C:
        return tl.load(ptrs)
    elif EVEN_R:
        return tl.load(ptrs, mask=cols[None, :] < C, other=0)
    elif EVEN_C:
        return tl.load(ptrs, mask=rows[:, None] < R, other=0)
    else:
        return tl.load(ptrs, mask=(rows[:, None] < R) & (cols[None, :] < C), other=0)


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """With programmatic dependent launch (the launch's launch_pdl): wait until the previous kernel has finished
    (its output and the shared split-K workspace are then safe), then let the next kernel start launching."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program order (GROUP_M row tiles share each weight tile while it is in L2)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid, pid_m, pid_n


@triton.jit
def _split_range(n_tiles, SPLIT: tl.constexpr):
    """The reduction tiles [t0, t1) of this program's split (program_id 1) out of n_tiles."""
    per_split = tl.cdiv(n_tiles, SPLIT)
    t0 = tl.program_id(1) * per_split
    return t0, tl.minimum(t0 + per_split, n_tiles)


@triton.jit
def _mn_program(M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                SPLIT: tl.constexpr):
    """This program's output tile of an (M, N) result reduced over K: tile id, pid_m, pid_n, row and column offsets,
    and its K-tiles [kt0, kt1)."""
    tile, pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    kt0, kt1 = _split_range(tl.cdiv(K, BK), SPLIT)
    return tile, pid_m, pid_n, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), kt0, kt1


@triton.jit
def _lora_tile(xa_ptr, lb_ptr, offs_m, offs_n, M, N, R, sxa, slb, lora_scale, RP: tl.constexpr):
    """lora_scale * xa[offs_m] @ lora_b[offs_n].T in fp32: the LoRA update of one output tile (rank R <= RP)."""
    offs_r = tl.arange(0, RP)
    xa = tl.load(xa_ptr + offs_m[:, None].to(tl.int64) * sxa + offs_r[None, :],
                 mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0)
    lb = tl.load(lb_ptr + offs_n[:, None].to(tl.int64) * slb + offs_r[None, :],
                 mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0)
    if xa.dtype == tl.float32:  # fp32 adapters: full precision, as torch computes them (tf32 off)
        return tl.dot(xa, tl.trans(lb), input_precision="ieee") * lora_scale
    return tl.dot(xa, tl.trans(lb)) * lora_scale


@triton.jit
def _epilogue(acc, b_ptr, xa_ptr, lb_ptr, offs_m, offs_n, M, N, R, sxa, slb, lora_scale,
              HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr):
    """The finished fp32 tile + bias + LoRA update (each optional)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0).to(tl.float32)[None, :]
    if HAS_LORA:
        acc += _lora_tile(xa_ptr, lb_ptr, offs_m, offs_n, M, N, R, sxa, slb, lora_scale, RP)
    return acc


@triton.jit
def last_arrival(cnt_ptr, index, count: tl.constexpr):
    """Whether this program is the last of `count` to arrive at counter `index`; what every program stored before
    arriving is visible to that last one (a barrier, so all its threads have stored, then an acq_rel add). The last
    one calls `rearm` when done, so the counter is 0 for the next launch (no memset, CUDA-graph safe)."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr + index, 1, sem="acq_rel", scope="gpu") == count - 1


@triton.jit
def rearm(cnt_ptr, index):
    tl.atomic_xchg(cnt_ptr + index, 0, sem="relaxed", scope="gpu")


@triton.jit
def _finish_tile(acc, out_ptr, b_ptr, part_ptr, cnt_ptr, tile, offs_m, offs_n, M, N, som, son,
                 xa_ptr, lb_ptr, R, sxa, slb, lora_scale,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 HAS_LORA: tl.constexpr, RP: tl.constexpr):
    """Store a (BM, BN) fp32 tile (+ bias, + LoRA); with SPLIT > 1 the last of the SPLIT programs of `tile` adds
    up the partials and applies the epilogue."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * som + offs_n[None, :] * son
    if SPLIT == 1:
        acc = _epilogue(acc, b_ptr, xa_ptr, lb_ptr, offs_m, offs_n, M, N, R, sxa, slb, lora_scale,
                        HAS_BIAS, HAS_LORA, RP)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tile_off = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        base = part_ptr + tile.to(tl.int64) * (SPLIT * BM * BN)
        tl.store(base + tl.program_id(1) * (BM * BN) + tile_off, acc, cache_modifier=".cg")
        if last_arrival(cnt_ptr, tile, SPLIT):
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(base + s * (BM * BN) + tile_off, cache_modifier=".cg")
            total = _epilogue(total, b_ptr, xa_ptr, lb_ptr, offs_m, offs_n, M, N, R, sxa, slb, lora_scale,
                              HAS_BIAS, HAS_LORA, RP)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            rearm(cnt_ptr, tile)


@triton.jit
def _fp4_mm_kernel(x_ptr, wp_ptr, ws_ptr, gs_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
                   M, N, K, sxm, sxk, som, son, swn, ssn,
                   xa_ptr, lb_ptr, R, sxa, slb, lora_scale, N1, N2,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   SPLIT: tl.constexpr, GROUP_M: tl.constexpr, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr,
                   EVEN_M: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr, SWAP_AB: tl.constexpr,
                   X_DESC: tl.constexpr = False, PDL: tl.constexpr = False, WAIT_LATE: tl.constexpr = False):
    """out (M, N) = x (M, K) @ deq(W).T (+ bias) (+ lora_scale * xa @ lora_b.T); program (tile, split) reduces
    K-tiles [split*T, (split+1)*T).

    W may stack up to three weights along N (rows [0, N1), [N1, N2), [N2, N): e.g. q, k and v), each with its own
    global scale gs[seg] and its own LoRA A columns xa[:, seg*R:(seg+1)*R]; BN divides N1 and N2. SWAP_AB computes
    out.T = W @ x.T (W as the MMA's A operand, the few x rows as its N): fewer SASS instructions per weight for
    few-row x in some tiles (counted on the cubin, sm_90), an option of the config sweep, not a default. PDL:
    launched with programmatic dependent launch (sm_90+), waits for the previous kernel before any memory access;
    with WAIT_LATE only before its first write: the launcher sets it when the previous kernel is the x @ A.T of the
    same x (small_matmul, which itself waited for x's producer before letting this launch start), so the main loop
    reads x and W while that kernel still runs, and xa, the output and the shared split-K workspace are touched
    only after it has finished. X_DESC: x_ptr is a host TMA descriptor of x with block (BM, BK) (many-row tiles)."""
    if not WAIT_LATE:
        grid_dependency(PDL)
    tile, pid_m, pid_n, offs_m, offs_n, kt0, kt1 = _mn_program(M, N, K, BM, BN, BK, GROUP_M, SPLIT)
    rn = offs_n % N  # wrapped weight rows load real data; only the store is masked
    offs_k = tl.arange(0, BK)
    if SWAP_AB:
        acc_t = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    tl.assume(kt0 < kt1)  # no zero-trip path (its zero accumulator made ptxas serialize the async wgmma)
    for kt in range(kt0, kt1):
        if X_DESC:  # x_ptr is a TMA descriptor: one bulk copy per x tile instead of per-thread addresses
            a = x_ptr.load([pid_m * BM, kt * BK])
        else:
            a = _load_rows(x_ptr, offs_m, kt * BK + offs_k, M, K, sxm, sxk, EVEN_M, EVEN_K)
        p, s = _load_weight_tile(wp_ptr, ws_ptr, rn, kt, rn < N, K, swn, ssn, BK, EVEN_K)
        w = _dequant_tile(p, s, BN, BK, USE_ASM)
        if a.dtype != tl.bfloat16:
            w = w.to(a.dtype)  # exact: e2m1 * fp8 scale fits fp16 and fp32
        if SWAP_AB:
            acc_t = tl.dot(w, tl.trans(a), acc_t)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    if WAIT_LATE:
        grid_dependency(PDL)
    seg = (pid_n * BN >= N1).to(tl.int32) + (pid_n * BN >= N2).to(tl.int32)
    acc = acc * (DEQ_GAIN / tl.load(gs_ptr + seg))
    _finish_tile(acc, out_ptr, b_ptr, part_ptr, cnt_ptr, tile, offs_m, offs_n, M, N, som, son,
                 xa_ptr + seg * R, lb_ptr, R, sxa, slb, lora_scale, HAS_BIAS, SPLIT, BM, BN, HAS_LORA, RP)


@triton.jit
def _fp4_mm_t_kernel(g_ptr, wp_ptr, ws_ptr, gs_ptr, out_ptr, part_ptr, cnt_ptr,
                     M, N, K, sgm, sgn, som, sok, swn, ssn,
                     BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
                     SPLIT: tl.constexpr, GROUP_M: tl.constexpr, USE_ASM: tl.constexpr, EVEN_N: tl.constexpr,
                     EVEN_M: tl.constexpr):
    """out (M, K) = g (M, N) @ deq(W); the tile is (BM, BK) of the output, reducing over N in steps of BN."""
    tile, pid_m, pid_k = _tile_ids(M, K, BM, BK, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    nt0, nt1 = _split_range(tl.cdiv(N, BN), SPLIT)
    offs_nb = tl.arange(0, BN)
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    for nt in range(nt0, nt1):
        ns = nt * BN + offs_nb
        a = _load_rows(g_ptr, offs_m, ns, M, N, sgm, sgn, EVEN_M, EVEN_N)
        if EVEN_N:
            p, s = _load_weight_tile(wp_ptr, ws_ptr, ns, pid_k, ns < N, K, swn, ssn, BK, True)
        else:
            p, s = _load_weight_tile(wp_ptr, ws_ptr, ns % N, pid_k, ns < N, K, swn, ssn, BK, False)
        w = _dequant_tile(p, s, BN, BK, USE_ASM)
        if a.dtype != tl.bfloat16:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc)
    acc = acc * (DEQ_GAIN / tl.load(gs_ptr))
    _finish_tile(acc, out_ptr, out_ptr, part_ptr, cnt_ptr, tile, offs_m, offs_k, M, K, som, sok,
                 out_ptr, out_ptr, 0, 0, 0, 0.0, False, SPLIT, BM, BK, False, 16)


@triton.jit
def _small_mm_kernel(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr = False):
    """out (M, N) = x (M, K) @ w (N, K).T for few rows and a narrow dense w (a LoRA A): one launch, split-K
    partials summed by the last program (cuBLAS takes a GEMM plus a separate split-K reduction kernel)."""
    grid_dependency(PDL)
    tile, _, pid_n, offs_m, offs_n, kt0, kt1 = _mn_program(M, N, K, BM, BN, BK, 1, SPLIT)
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kt in range(kt0, kt1):
        ks = kt * BK + offs_k
        a = _load_rows(x_ptr, offs_m, ks, M, K, sxm, sxk, EVEN_M, EVEN_K)
        w = _load_rows(w_ptr, offs_n, ks, N, K, swn, swk, EVEN_N, EVEN_K)
        acc = tl.dot(a, tl.trans(w), acc)
    _finish_tile(acc, out_ptr, out_ptr, part_ptr, cnt_ptr, tile, offs_m, offs_n, M, N, som, son,
                 out_ptr, out_ptr, 0, 0, 0, 0.0, False, SPLIT, BM, BN, False, 16)


def _workspace(device: torch.device, part_elems: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials (fp32) and per-tile arrival counters (left at zero by every launch: no memset), per (device,
    stream), kept for graphs captured over them (kernels.workspace)."""
    return (scratch("triton_fp4.part", device, part_elems, torch.float32, minimum=1 << 16),
            scratch("triton_fp4.arrivals", device, tiles, torch.int32, zeroed=True, minimum=4096))


def small_matmul(x2: torch.Tensor, w: torch.Tensor, split: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x2 (M, K) @ w (N, K).T in x2's dtype with `_small_mm_kernel` (a LoRA A at decode: ~2 kernels of cuBLAS become
    one), for the operands that qerl.quant.dispatch.choose_kernel("small", ...) sends here (few rows, N <= 256,
    bf16/fp16 on CUDA), into `out` (M, N) when given. `split`: K splits (default `_small_split`)."""
    m, k = x2.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device) if out is None else out
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = max(16, min(64, triton.next_power_of_2(n)))
    bk = _k_block(k, 256 if bm <= 32 else 128)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_tiles = triton.cdiv(k, bk)
    split = _no_empty_splits(split or _small_split(bm, bn, bk, k_tiles, tiles, x2.device), k_tiles)
    part, cnt = _workspace(x2.device, tiles * split * bm * bn if split > 1 else 0, tiles)
    _small_mm_kernel[(tiles, split)](
        x2, w, out, part, cnt, m, n, k, x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), out.stride(0),
        out.stride(1), BM=bm, BN=bn, BK=bk, SPLIT=split, EVEN_K=k % bk == 0, EVEN_M=m % bm == 0,
        EVEN_N=n % bn == 0, num_warps=4, num_stages=3, **pdl_options(x2.device))
    return out


# The FP4 kernel after small_matmul's x @ A.T waits for it only before its epilogue (WAIT_LATE in _fp4_mm_kernel).
# Also safe where dispatch takes x @ A.T from torch.matmul: a launch without PDL lets the next start only once done.
LORA_OVERLAP = True


def pdl_options(device: torch.device, wait_late: bool = False) -> dict:
    """Launch options of the decode kernels: programmatic dependent launch where kernels.device.use_pdl says
    (QERL_PDL; by default on sm_90+ during CUDA-graph capture); wait_late: the FP4 kernel's WAIT_LATE. None off
    CUDA (Triton's CPU interpreter)."""
    if device.type != "cuda" or not use_pdl(device_index(device)):
        return {}
    return {"PDL": True, "launch_pdl": True, **({"WAIT_LATE": True} if wait_late else {})}


def _check_config(config: KernelConfig | None) -> None:
    if config is not None and config.bk < 64:
        raise QerlError(f"config.bk: {config.bk} < 64 is not supported (wrong results seen with Triton 3.6)")


def _x_descriptor(x2: torch.Tensor, cfg: KernelConfig):
    """A TMA descriptor of x2 (block bm x bk), or None where TMA cannot address it (strides, alignment)."""
    size = x2.element_size()
    if x2.stride(1) != 1 or (x2.stride(0) * size) % 16 or x2.data_ptr() % 16:
        return None
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [cfg.bm, cfg.bk])


def fp4_matmul_fused(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b, lora_scale: float,
                     n1: int, n2: int, out: torch.Tensor, config: KernelConfig | None = None,
                     use_asm: bool = True) -> torch.Tensor:
    """out (M, N) = x2 (M, K) @ deq(W).T (+ bias) (+ lora_scale * xa[:, seg] @ lora_b.T) in x2's dtype, one launch;
    bf16 tensor cores (fp16 for fp16, tf32 for fp32).

    The LoRA update (xa = x @ A.T, lora_b (N, r) contiguous, both in x's dtype) is added in the kernel's epilogue,
    so a LoRA layer costs one small GEMM (x @ A.T) and no separate B GEMM or add. Up to three weights that read the
    same x (q/k/v, gate/up) are stacked along N: rows [0, n1), [n1, n2), [n2, N), one global scale each, xa holds
    one r-column block per segment. config: tiles and splits (default `forward_config`)."""
    _check_config(config)
    m, k = x2.shape
    n = weight_packed.shape[0]
    r = 0 if lora_b is None else lora_b.shape[1]
    cfg = config or forward_config(m, n, k, x2.device, x2.dtype)
    cfg = cfg._replace(split=_no_empty_splits(cfg.split, triton.cdiv(k, cfg.bk)))  # the kernel assumes no empty split
    while cfg.bn > 16 and (n1 % cfg.bn or n2 % cfg.bn):  # every program's columns inside one segment
        cfg = cfg._replace(bn=cfg.bn // 2)
    if n1 % cfg.bn or n2 % cfg.bn:
        raise QerlError(f"segments: boundaries {n1}, {n2} must be multiples of 16")
    tiles = triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn)
    part, cnt = _workspace(x2.device, tiles * cfg.split * cfg.bm * cfg.bn if cfg.split > 1 else 0, tiles)
    wp = weight_packed.contiguous()
    ws = weight_scale.contiguous().view(torch.uint8)
    gs = weight_global_scale.reshape(-1).to(torch.float32)
    b = bias.contiguous() if bias is not None else out
    x_arg = _x_descriptor(x2, cfg) if cfg.tma else None
    _fp4_mm_kernel[(tiles, cfg.split)](
        x2 if x_arg is None else x_arg, wp, ws, gs, b, out, part, cnt, m, n, k, x2.stride(0), x2.stride(1),
        out.stride(0), out.stride(1), wp.stride(0), ws.stride(0),
        out if xa is None else xa, out if lora_b is None else lora_b, r, 0 if xa is None else xa.stride(0), r,
        float(lora_scale), n1, n2,
        HAS_BIAS=bias is not None, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, SPLIT=cfg.split, GROUP_M=cfg.group_m,
        USE_ASM=use_asm, EVEN_K=k % cfg.bk == 0, EVEN_M=m % cfg.bm == 0, HAS_LORA=xa is not None,
        RP=max(16, triton.next_power_of_2(max(r, 1))), SWAP_AB=cfg.swap_ab, X_DESC=x_arg is not None,
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl_options(x2.device, wait_late=LORA_OVERLAP and xa is not None),
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out


def fp4_matmul_t_fused(g2, weight_packed, weight_scale, weight_global_scale, out: torch.Tensor,
                       config: KernelConfig | None = None, use_asm: bool = True) -> torch.Tensor:
    """out (M, K) = g2 (M, N) @ deq(W) in g2's dtype: the input gradient, reading W transposed, one launch."""
    _check_config(config)
    m, n = g2.shape
    k = weight_packed.shape[1] * 2
    cfg = config or backward_config(m, n, k, g2.device)
    if k % cfg.bk:
        raise QerlError(f"weight_packed: in_features {k} must be a multiple of the tile {cfg.bk}")
    tiles = triton.cdiv(m, cfg.bm) * (k // cfg.bk)
    part, cnt = _workspace(g2.device, tiles * cfg.split * cfg.bm * cfg.bk if cfg.split > 1 else 0, tiles)
    wp = weight_packed.contiguous()
    ws = weight_scale.contiguous().view(torch.uint8)
    _fp4_mm_t_kernel[(tiles, cfg.split)](
        g2, wp, ws, weight_global_scale.reshape(1).to(torch.float32), out, part, cnt, m, n, k,
        g2.stride(0), g2.stride(1), out.stride(0), out.stride(1), wp.stride(0), ws.stride(0),
        BM=cfg.bm, BK=cfg.bk, BN=cfg.bn, SPLIT=cfg.split, GROUP_M=cfg.group_m, USE_ASM=use_asm,
        EVEN_N=n % cfg.bn == 0, EVEN_M=m % cfg.bm == 0, num_warps=cfg.warps, num_stages=cfg.stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out
