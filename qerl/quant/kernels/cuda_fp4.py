"""Hand-written CUDA forward for few-row NVFP4 matmuls, the default for <= 8 rows on Hopper (`QERL_FP4_CUDA`).

    y = fp4_matmul_cuda(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b, lora_scale, n1, n2,
                        lora_a=...)

Same contract as the Triton kernel's few-row path (qerl.quant.dispatch.choose_kernel picks it, by QERL_FP4_CUDA):
x2 (M <= 16, K) bf16 @ deq(W).T (+ bias) (+ lora_scale * (x @ A.T)[:, seg] @ lora_b.T), up to three stacked weights
along N with their own global scales. The CUDA C is fp4_gemv.cu beside this file (`source`).

Design (few-row Triton launches are bound by on-chip work per weight, not bytes: BENCHMARKS.md, "(a) Kernels"): one
16-row block of W per CTA, or per thread-block cluster of S CTAs on Hopper, with the block's K chunks (128 weights)
split over its S x W warps; each warp runs `mma.sync` m16n8k16 with W as the A operand decoded in registers
(kernels/_e2m1.py's bit trick) straight from 16-byte global loads, the K order permuted so one thread's 32 contiguous
weights of a row feed 8 MMAs, x read from L1 in the same order as the B operand (two 8-row tiles for M 9..16).
Partial tiles are summed in shared memory and, across a cluster, through distributed shared memory: no workspace, no
atomics, deterministic. Warp 0 of the block applies 128 / global_scale, bias and the LoRA B product (one more mma
per 16 of rank) and stores bf16. With `lora_a`, x @ A.T is computed in the same launch: the first blocks of the grid
are A's 16-row blocks in K slices writing fp32 partials; in each weight block the other warps wait for them with an
acquire load and sum them in a fixed order into shared memory while warp 0 sums the block's partial tiles, and the
last weight block resets the flags (CUDA-graph safe). (cluster, warps) come from `model_time`, fitted to an H100
sweep. Under `QERL_PDL` (default: while a CUDA graph is captured, sm_90+) launches use programmatic dependent
launch: a CTA requests its first weight chunk, then waits (griddepcontrol.wait) for the previous kernel before
reading x or writing anything. Built once per device and process by NVRTC or nvcc (kernels.cuda_build), launched
through the driver API on torch's current stream. Outside the envelope (`fits`: K % 128, N or segment bounds % 16,
16-byte aligned rows; and bf16 x of at most MAX_ROWS rows) the dispatcher runs the Triton kernel.

Measured (`python -m bench.wired`): BENCHMARKS.md, "Stacked decode layer" and "Few-row CUDA kernel".
"""
from __future__ import annotations

import ctypes
import functools
import math
import re
import warnings
from pathlib import Path

import torch

from qerl.quant.kernels import _e2m1
from qerl.quant.kernels.cuda_build import CudaModule, compile_cubin
from qerl.quant.kernels.device import device_index, use_pdl
from qerl.quant.kernels.workspace import scratch

CHUNK = 128  # weights per row per chunk
MAX_ROWS = 16  # the kernels' limit (two 8-row MMA tiles)
MAX_WARPS = 16  # the kernels' __launch_bounds__ (32 x MAX_WARPS threads)
MAX_FUSED_RANK = 128  # x @ A.T in the same launch up to this LoRA rank (its M x R bf16 tile in shared memory)
SOURCE_FILE = Path(__file__).with_name("fp4_gemv.cu")


def _marker(name: str) -> re.Pattern:
    return re.compile(rf"^// {name}\n", re.MULTILINE)


@functools.cache
def source() -> str:
    """fp4_gemv.cu with its marker lines filled in: decode8() from the one E2M1 PTX text (_e2m1.cuda_decode8) and
    the MAX_WARPS / MAX_FUSED_RANK #defines from the constants above."""
    text = SOURCE_FILE.read_text()
    for name, fill in (("QERL_DECODE8", _e2m1.cuda_decode8()),
                       ("QERL_LIMITS", f"#define MAX_WARPS {MAX_WARPS}\n#define MAX_FUSED_RANK {MAX_FUSED_RANK}\n")):
        text, count = _marker(name).subn(lambda _m, fill=fill: fill, text)
        if count != 1:
            raise RuntimeError(f"{SOURCE_FILE}: expected one line '// {name}', found {count}")
    return text


CLUSTER_SIZES = (1, 2, 4, 8)
WARP_CHOICES = tuple(range(1, MAX_WARPS + 1))


@functools.cache
def _module(device_index: int) -> CudaModule:
    major, minor = torch.cuda.get_device_capability(device_index)
    clusters = major >= 9  # thread-block clusters and distributed shared memory: Hopper on
    names = [kernel_name(nt, s) for nt in (1, 2) for s in (CLUSTER_SIZES if clusters else (1,))]
    source_text = ("#define QERL_CLUSTERS 1\n" if clusters else "") + source()
    return CudaModule(compile_cubin(source_text, f"sm_{major}{minor}"), names, device_index)


def kernel_name(n_tiles: int, cluster: int) -> str:
    return f"fp4_mm_n{n_tiles}_s{cluster}"


def fits(x2: torch.Tensor, weight_packed: torch.Tensor, n: int, k: int, n1: int, n2: int) -> bool:
    """The operands' shapes and alignment inside the kernel's envelope: K % 128, N and segment bounds % 16,
    16-byte aligned rows of x2 and of the packed weight (rows, dtype and device are the dispatcher's rule)."""
    return (k % CHUNK == 0 and n % 16 == 0 and n1 % 16 == 0 and n2 % 16 == 0 and x2.stride(1) == 1
            and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 and weight_packed.data_ptr() % 16 == 0)


@functools.cache
def built(device_index: int) -> bool:
    """Whether the module builds on this device; in QERL_FP4_CUDA "auto" mode a failure (no nvcc, no NVRTC) is one
    warning and the Triton kernel."""
    try:
        _module(device_index)
        return True
    except RuntimeError as err:
        warnings.warn(f"qerl.quant.kernels.cuda_fp4: {err}; few-row FP4 matmuls stay on Triton (QERL_FP4_CUDA=0 "
                      "silences this)", stacklevel=3)
        return False


def model_time(n: int, k: int, cluster: int, warps: int, sms: int, ctas_per_sm: int,
               step_over_latency: float = 0.08, wave_cost: float = 3.0, cluster_cost: float = 1.0) -> float:
    """Modelled time, in units of one warp's chunk step when latency bound, of one (cluster, warps) launch: the
    busiest SM runs ceil(blocks x cluster / sms) CTAs of `warps` warps, each warp ceil(chunks / (cluster x
    warps)) steps; a step costs max(1 / warps in flight on the SM, step_over_latency) (latency bound below ~12
    warps per SM, bandwidth bound above), plus `wave_cost` per wave of resident CTAs (pipeline fill, reduction,
    epilogue) and `cluster_cost` more with a cluster barrier. Constants fitted to an H100 sweep of every (cluster,
    warps) on the 7B shapes at M = 1 and 8 (`python -m bench.wired --warps ...`; fit: BENCHMARKS.md, "Few-row CUDA
    kernel")."""
    chunks, blocks = k // CHUNK, n // 16
    steps = math.ceil(chunks / (cluster * warps))
    per_sm = math.ceil(blocks * cluster / sms)
    waves = math.ceil(per_sm / ctas_per_sm)
    in_flight = min(ctas_per_sm, per_sm) * warps
    return (per_sm * warps * steps * max(1.0 / in_flight, step_over_latency)
            + waves * (wave_cost + cluster_cost * (cluster > 1)))


MIN_WARPS = 4  # CTAs of 1-2 warps were never the fastest (BENCHMARKS.md, "Few-row CUDA kernel")


def candidate_configs(k: int, clusters: bool) -> list[tuple[int, int]]:
    """(cluster, warps) with at least two chunks of 128 per warp and MIN_WARPS warps per CTA (fewer only when K
    is too short for that)."""
    chunks = k // CHUNK
    ok = [(s, w) for s in (CLUSTER_SIZES if clusters else (1,)) for w in WARP_CHOICES
          if s * w == 1 or chunks >= 2 * s * w]
    wide = [c for c in ok if c[1] >= MIN_WARPS]
    return wide or [max(ok, key=lambda c: (c[1], -c[0]))]


FIT_BANDWIDTH = 3.35e12  # bytes/s of the H100 SXM that model_time's step_over_latency (0.08) was fitted on


def step_over_latency(bandwidth: float | None) -> float:
    """model_time's bandwidth-bound step cost on a device of `bandwidth` bytes/s: a step moves the same bytes, so it
    scales as 1 / bandwidth (H200, 4.9 TB/s: 0.055; 0.08 there picked 7 warps for o (3,584 x 3,584), 6.3 us at 1
    row, against 10 warps' 4.8 us; the layer's four picks 191.5 -> 187.3 us over 1 / 4 / 8 rows, the best 186.0:
    `bench.wired --warps`). Unknown bandwidth: the fitted 0.08."""
    return 0.08 if not bandwidth else 0.08 * FIT_BANDWIDTH / bandwidth


def memory_bandwidth(device_index: int) -> float | None:
    """Peak DRAM bytes/s from the device's memory clock and bus width (double data rate), None if not reported."""
    props = torch.cuda.get_device_properties(device_index)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def pick_config(n: int, k: int, sms: int, occupancy, clusters: bool, bandwidth: float | None = None) -> tuple[int, int]:
    """The (cluster, warps) of least `model_time` on a device of `bandwidth` bytes/s (None: the fitted H100's);
    occupancy(warps) = resident CTAs per SM."""
    sol = step_over_latency(bandwidth)
    return min(candidate_configs(k, clusters),
               key=lambda c: (model_time(n, k, c[0], c[1], sms, max(1, occupancy(c[1])), sol), c[0], c[1]))


def _n_tiles(m: int) -> int:
    return 1 if m <= 8 else 2


@functools.cache
def _occupancy(device_index: int, name: str, warps: int) -> int:
    return _module(device_index).occupancy(name, 32 * warps)


@functools.cache
def _config(device_index: int, m_tiles: int, n: int, k: int) -> tuple[int, int]:
    major, _ = torch.cuda.get_device_capability(device_index)
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    name = kernel_name(m_tiles, 1)
    return pick_config(n, k, sms, lambda w: _occupancy(device_index, name, w), clusters=major >= 9,
                       bandwidth=memory_bandwidth(device_index))


MAX_A_SPLITS = 32


def _workspace(device: torch.device, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials of x @ A.T, two int32 flags left at zero by every launch) per (device, stream), kept for
    graphs captured over them (kernels.workspace). Warm a shape up before CUDA-graph capture so no allocation is
    captured."""
    return (scratch("cuda_fp4.xa_partials", device, floats, torch.float32),
            scratch("cuda_fp4.flags", device, 2, torch.int32, zeroed=True, minimum=2))


def a_splits(k: int, cluster: int, warps: int) -> int:
    """K slices of each 16-row block of LoRA A, so that its warps take ~2 chunks each and finish long before the
    weight blocks that wait for them."""
    return max(1, min(MAX_A_SPLITS, math.ceil(k // CHUNK / (2 * cluster * warps))))


def fp4_matmul_cuda(x2, weight_packed, weight_scale, weight_global_scale, bias, xa, lora_b, lora_scale: float,
                    n1: int, n2: int, config: tuple[int, int] | None = None, out: torch.Tensor | None = None,
                    lora_a: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) bf16 x -> (M, N) bf16 (into `out` when given, contiguous). LoRA: either xa = x @ A.T (M, segments x
    R) or lora_a (segments x R, K) bf16 of rank R <= MAX_FUSED_RANK, computed in the same launch; lora_b (N, R) as
    from qerl.quant.operands.lora_adapter. config: (cluster size, warps per CTA), default `pick_config`."""
    m, k = x2.shape
    n = weight_packed.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x2.device)
    dev = device_index(x2.device)
    nt = _n_tiles(m)
    cluster, warps = config or _config(dev, nt, n, k)
    wp = weight_packed.contiguous()
    ws = weight_scale.contiguous().view(torch.uint8)
    gs = weight_global_scale.reshape(-1).to(torch.float32).contiguous()
    b = bias.contiguous() if bias is not None else None
    r = 0 if lora_b is None else lora_b.shape[1]
    lb = None if lora_b is None else lora_b.contiguous()
    la, xw, flags, a_units, sa = None, None, None, 0, 1
    if lora_a is not None and xa is None and r > MAX_FUSED_RANK:  # the kernel's shared x @ A.T tile is this wide
        raise ValueError(f"lora_a: rank {r} > MAX_FUSED_RANK {MAX_FUSED_RANK}: pass xa = x @ A.T instead")
    if lora_a is not None and xa is None:
        la = lora_a.contiguous()
        if la.data_ptr() % 16:  # 16-byte loads of its rows
            la = la.clone()
        sa = a_splits(k, cluster, warps)
        xw, flags = _workspace(x2.device, sa * m * la.shape[0])
        a_units = -(-la.shape[0] // 16) * sa

    def ptr(t):
        return ctypes.c_void_p(0 if t is None else t.data_ptr())

    args = [ptr(wp), ptr(ws), ptr(gs), ptr(x2), ctypes.c_int(x2.stride(0)), ptr(out), ctypes.c_int(out.stride(0)),
            ptr(b), ptr(xa), ctypes.c_int(0 if xa is None else xa.stride(0)), ptr(lb),
            ctypes.c_int(0 if lb is None else lb.stride(0)), ctypes.c_float(lora_scale), ctypes.c_int(m),
            ctypes.c_int(n), ctypes.c_int(k), ctypes.c_int(n1), ctypes.c_int(n2), ctypes.c_int(r), ptr(la),
            ctypes.c_int(0 if la is None else la.stride(0)), ctypes.c_int(sa), ptr(xw), ptr(flags)]
    grid, name = ((n // 16 + a_units) * cluster, 1), kernel_name(nt, cluster)
    if dev == torch.cuda.current_device():
        _module(dev).launch(name, grid, 32 * warps, args, pdl=use_pdl(dev))
    else:  # the context, stream and workspace of x's device
        with torch.cuda.device(dev):
            _module(dev).launch(name, grid, 32 * warps, args, pdl=use_pdl(dev))
    return out


assert _e2m1.DEQ_GAIN == 128.0  # the kernel's finish multiplies by 128 / global_scale
