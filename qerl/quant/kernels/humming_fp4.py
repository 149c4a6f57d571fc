"""NVFP4 matmuls on humming-kernels (vllm-project/humming): JIT-compiled W4A16 GEMMs that read our packed tensors.

    from qerl.quant.kernels import humming_fp4
    if humming_fp4.available(x.device):
        humming_fp4.fp4_matmul_humming(x2, weight_packed, weight_scale, weight_global_scale, segments, out)

Humming takes a compressed-tensors `nvfp4-pack-quantized` weight as it is on disk (E2M1 codes, E4M3 group-16 scales,
the FP32 global scale as a divisor) and repacks it once into its own tile layout; that repacked copy is what its
kernels stream. We keep one per packed weight tensor (cached on the tensor, rebuilt in place when the tensor is
changed in place, so a captured CUDA graph keeps reading valid addresses) beside our own layout, which the training
kernels (grad_input, many-row forwards) still read: the copy costs the packed weight's bytes once more.

Numerics: codes and group scales are taken bit for bit; the global scale is applied as its FP32 reciprocal (one
scale per tensor; per output channel in the activation dtype when stacked weights carry different global scales,
which llmcompressor's fused q/k/v and gate/up scales avoid). Accumulation is FP32, the output in x's dtype.
"""
from __future__ import annotations

import functools
import json
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from qerl.quant.kernels.device import capability, device_index

__all__ = ["PREPARE", "available", "clear", "compile_in_background", "copies_nbytes", "copy_ready",
           "dequantize_humming", "drop", "fits", "fp4_matmul_humming", "has_copy", "humming_weight", "refresh_stale",
           "tuning_intervals", "wait_pending"]

_ATTR = "_qerl_humming"  # the repacked copy, kept on the packed weight tensor itself
# humming's JIT work in this process (qerl.compile_cache): "seconds" the caller waited for it (compiling in its own
# thread, or blocked on a background compile), "background" the wall clock of compiles run beside the caller
PREPARE = {"seconds": 0.0, "kernels": 0, "layers": 0, "background": 0.0}
_PREPARED: set = set()  # (layer config, table) strings prepared in this process: later builds hit humming's memo
_JOBS_DONE: set = set()  # HummingWeight.job_key of every prepare that succeeded here
_PENDING: list[Future] = []  # background compiles not yet waited for (compile_in_background)
_LOCK = threading.Lock()


@functools.cache
def _humming():
    """The humming package, or None where it does not import (not installed, no CUDA driver)."""
    try:
        import humming.layer  # noqa: F401 - registers its schemas and ops
        from humming import dtypes, forward, schema, transform
        from humming.kernel.humming import HummingKernel
        from humming.tune import get_heuristics_config
    except Exception:  # ImportError, or its native launcher failing without a driver
        return None
    return dict(dtypes=dtypes, forward=forward, schema=schema, transform=transform, kernel=HummingKernel,
                heuristics=get_heuristics_config)


def config_at(intervals: list, m: int):
    """The config humming's per-M table ([m_lo, m_hi, config]) gives M rows: its interval's, the last beyond it."""
    return next((c for lo, hi, c in intervals if lo < m <= hi), intervals[-1][2])


def tuning_intervals(intervals: list, points: tuple[int, ...] | None) -> list:
    """humming's per-M kernel table ([m_lo, m_hi, config]: m_lo < M <= m_hi; its heuristics change the config
    every 8-64 rows up to 8192, 92 kernels per layer shape, ~18 s of nvcc per shape on a cold cache) reduced to
    the configs of the row counts in `points`: M runs the config of the smallest point >= M (the largest point's
    beyond it). The decode graphs run exactly their bucket sizes, so listing them loses nothing there. None: the
    whole table."""
    if not points:
        return [list(i) for i in intervals]
    table, lo = [], 0
    for m in sorted(set(points)):
        cfg = config_at(intervals, m)
        if table and table[-1][2] == cfg:
            table[-1][1] = m
        else:
            table.append([lo, m, cfg])
        lo = m
    table[-1][1] = max(table[-1][1], 1 << 30)
    return table


def available(device: torch.device | None = None) -> bool:
    """humming imports and `device` (default: the current one) is a CUDA device of sm_80+ (its bf16 W4A16 GEMMs)."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or _humming() is None or not torch.cuda.is_available():
        return False
    return capability(device_index(device))[0] >= 8


class HummingWeight:
    """One packed NVFP4 weight (up to three stacked along N) in humming's layout, and its layer config."""

    def __init__(self, weight_packed, weight_scale, weight_global_scale, segments, dtype: torch.dtype,
                 rows: tuple[int, ...] | None = None, defer: bool = False):
        h = _humming()
        n, k = weight_packed.shape[0], weight_packed.shape[1] * 2
        self.key = self._key(weight_packed, weight_scale, weight_global_scale, segments, dtype)
        self.dtype = dtype
        ct = h["schema"].CompressedTensorsWeightSchema(format="nvfp4-pack-quantized", type="float", num_bits=4,
                                                       strategy="tensor_group", group_size=16)
        gs = weight_global_scale.reshape(-1).float()
        stacks = list(segments) if gs.numel() > 1 else [n]
        with torch.no_grad():
            wschema, tensors = ct.convert_humming(
                {"weight_packed": weight_packed, "weight_scale": weight_scale, "weight_global_scale": gs},
                shape_n_stacks=stacks, shape_k_stacks=[k], param_dtype=dtype, device=weight_packed.device,
                convert_symmetric_integer=False)
            self.schema = wschema
            self.converted = tensors  # humming's schema, before its tile layout: what dequantize_humming reads
            ischema = h["schema"].HummingInputSchema(a_dtype=h["dtypes"].DataType.from_torch_dtype(dtype))
            self.config = h["transform"].prepare_layer_config(
                shape_n=n, shape_k=k, weight_schema=wschema, input_schema=ischema, torch_dtype=dtype,
                device=weight_packed.device, tensors=dict(tensors))
            self.tensors = h["transform"].transform_humming_tensors(self.config, dict(tensors))
        self.rows = rows
        self.device = weight_packed.device
        self.ready: Future | None = None  # while compile_in_background builds this copy's kernels
        self.tuning = None if defer else self.prepare()
        self.operands = tuple(weakref.ref(t) for t in (weight_packed, weight_scale, weight_global_scale))
        self.segments = tuple(segments)
        self.locks = torch.zeros(2048, dtype=torch.int32, device=weight_packed.device)  # stream-K state, per weight

    def prepare(self, background: bool = False) -> str | None:
        """Compile (or load from HUMMING_CACHE_DIR) this layer's kernels now, timed, rather than inside the first
        forward that needs them (a graph warm-up step); returns the tuning table its calls pass (None where humming's
        internals moved: its own lazy path still works)."""
        h, start = _humming(), time.perf_counter()
        try:
            intervals = h["heuristics"](self.config, device=self.device)
            table = json.dumps(tuning_intervals(intervals, self.rows))
            layer = self.config.to_str()
            ids = h["kernel"].prepare_kernels(layer, None, table, self.device)
        except Exception:  # noqa: BLE001
            return None
        with _LOCK:
            _JOBS_DONE.add(self.job_key())
            if (layer, table) not in _PREPARED:
                _PREPARED.add((layer, table))
                PREPARE["background" if background else "seconds"] += time.perf_counter() - start
                PREPARE["kernels"] += len({int(i) for i in ids[2::4]})
                PREPARE["layers"] += 1
        return table

    def job_key(self) -> tuple:
        """What its kernels depend on: copies with equal keys share one compile."""
        return self.config.to_str(), self.rows, str(self.device)

    def compiled_before(self) -> bool:
        """Whether this process already prepared kernels for its job_key (preparing again is a memo lookup)."""
        return self.job_key() in _JOBS_DONE

    @staticmethod
    def _key(weight_packed, weight_scale, weight_global_scale, segments, dtype):
        """Identity and in-place version of the operands (tensors made under torch.inference_mode keep no version
        counter: their address only)."""
        return (*((t.data_ptr(), -1 if t.is_inference() else t._version)
                  for t in (weight_packed, weight_scale, weight_global_scale)), tuple(segments), dtype)

    def refresh_from(self, other: "HummingWeight") -> None:
        """Take `other`'s values into this copy's tensors (same shapes), so captured graphs see them."""
        with torch.no_grad():
            for name, t in self.tensors.items():
                t.copy_(other.tensors[name])
        self.key = other.key

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def run(self, x2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.ready is not None:  # its kernels compile in the background and a forward needs them now
            wait_pending()
            self.ready = None
        t = self.tensors
        return _humming()["forward"].humming_forward(
            self.config, inputs=x2, weight=t["weight"], weight_scale=t.get("weight_scale"),
            weight_scale_2=t.get("weight_scale_2"), outputs=out, locks=self.locks, tuning_config=self.tuning)


# packed tensors that carry a copy (for clear/bytes), by id: a WeakSet compares tensors with ==, elementwise
_live: dict[int, weakref.ref] = {}


def _track(weight_packed: torch.Tensor) -> None:
    key = id(weight_packed)

    def forget(ref, key=key):
        if _live.get(key) is ref:
            del _live[key]

    _live[key] = weakref.ref(weight_packed, forget)


def _tracked() -> list[torch.Tensor]:
    return [t for t in (ref() for ref in list(_live.values())) if t is not None]


def humming_weight(weight_packed, weight_scale, weight_global_scale, segments=None,
                   dtype: torch.dtype = torch.bfloat16, rows: tuple[int, ...] | None = None,
                   defer: bool = False) -> HummingWeight:
    """The repacked copy of this packed weight for activations in `dtype`: built on first use, rebuilt (into the
    same tensors) when any operand was changed in place or replaced. `rows`: the row counts whose kernels it
    compiles (tuning_intervals; None: humming's whole table), fixed by the copy's first build."""
    segments = tuple(segments or (weight_packed.shape[0],))
    held = weight_packed.__dict__.get(_ATTR)
    key = HummingWeight._key(weight_packed, weight_scale, weight_global_scale, segments, dtype)
    if held is not None and held.key == key:
        return held
    fresh = HummingWeight(weight_packed, weight_scale, weight_global_scale, segments, dtype,
                          held.rows if held is not None else rows, defer=defer and held is None)
    if held is not None and held.key[-2:] == key[-2:] and \
            all(held.tensors[n].shape == t.shape for n, t in fresh.tensors.items()):
        held.refresh_from(fresh)
        return held
    weight_packed.__dict__[_ATTR] = fresh
    _track(weight_packed)
    return fresh


def refresh_stale() -> int:
    """Rebuild (in place) every copy whose operands were changed in place since it was built; returns how many.
    Engines call it before replaying captured graphs, which read the copies without asking humming_weight."""
    stale = 0
    for t in _tracked():
        held = t.__dict__.get(_ATTR)
        ops = [ref() for ref in held.operands] if held is not None else []
        if ops and None not in ops and HummingWeight._key(*ops, held.segments, held.dtype) != held.key:
            humming_weight(*ops, held.segments, held.dtype)
            stale += 1
    return stale


@functools.cache
def _background() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="qerl-humming")


def compile_in_background(copies: list) -> Future | None:
    """Compile the kernels of copies built with defer=True on a background thread, one worker per distinct
    job_key (humming runs nvcc per layer config), while the caller goes on: a rollout's prefill on the other
    kernels (qerl.quant.dispatch skips a copy that is not ready outside a decode step), torch.compile of its decode
    step. Each copy's `ready` is the returned future; HummingWeight.run and wait_pending wait for it."""
    jobs: dict = {}
    for c in copies:
        jobs.setdefault(c.job_key(), []).append(c)
    if not jobs:
        return None

    def one(group) -> None:
        with torch.cuda.device(group[0].device):  # a new thread starts on device 0
            tuning = group[0].prepare(background=True)
        for c in group:
            c.tuning = tuning

    def work() -> None:
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            list(pool.map(one, jobs.values()))

    future = _background().submit(work)
    for c in copies:
        c.ready = future
    _PENDING.append(future)
    return future


def wait_pending() -> None:
    """Block until every background compile has finished, the seconds blocked counted in PREPARE["seconds"]. A
    CUDA-graph capture must come after: humming loads each kernel as it compiles it, and a module load during a
    capture breaks the capture."""
    if not _PENDING:
        return
    start = time.perf_counter()
    try:
        while _PENDING:
            _PENDING.pop(0).result()
    finally:
        PREPARE["seconds"] += time.perf_counter() - start


def copy_ready(weight_packed: torch.Tensor) -> bool:
    """Whether this packed weight holds a copy whose kernels are compiled (none compiling in the background)."""
    held = weight_packed.__dict__.get(_ATTR)
    return held is not None and (held.ready is None or held.ready.done())


def has_copy(weight_packed: torch.Tensor) -> bool:
    """Whether this packed weight holds a repacked copy now (QERL_FP4_HUMMING=auto only uses existing ones)."""
    return _ATTR in weight_packed.__dict__


def fits(weight_packed: torch.Tensor) -> bool:
    """humming's tiles: N a multiple of 64, K of 128 (every Qwen2.5 projection)."""
    return weight_packed.shape[0] % 64 == 0 and weight_packed.shape[1] * 2 % 128 == 0


def drop(weight_packed: torch.Tensor) -> None:
    """Drop this packed weight's copy, if it holds one."""
    weight_packed.__dict__.pop(_ATTR, None)
    ref = _live.get(id(weight_packed))
    if ref is not None and ref() is weight_packed:
        del _live[id(weight_packed)]


def copies_nbytes() -> int:
    """Bytes held by the repacked copies alive now."""
    return sum(t.__dict__[_ATTR].nbytes() for t in _tracked() if _ATTR in t.__dict__)


def clear() -> None:
    """Drop every repacked copy (e.g. before a memory-hungry phase); the next humming call rebuilds its own."""
    for t in _tracked():
        drop(t)


def dequantize_humming(weight_packed, weight_scale, weight_global_scale, segments=None) -> torch.Tensor:
    """The dense float32 weight as humming reads it from our tensors (its own dequantizer over the converted
    tensors, before the tile layout): the check that the conversion takes our format exactly."""
    hw = humming_weight(weight_packed, weight_scale, weight_global_scale, segments)
    return hw.schema.dequant_tensors(hw.converted).float()


def fp4_matmul_humming(x2: torch.Tensor, weight_packed, weight_scale, weight_global_scale, segments,
                       out: torch.Tensor) -> torch.Tensor:
    """out (M, N) = x2 (M, K) @ deq(W).T on humming's kernel (its own tile heuristics per M)."""
    hw = humming_weight(weight_packed, weight_scale, weight_global_scale, segments, x2.dtype)
    return hw.run(x2.contiguous(), out)
