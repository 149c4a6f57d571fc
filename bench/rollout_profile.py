"""Where a whole rollout's GPU time goes: one rollout under torch.profiler (CUDA activity only), its kernels by kind
and the GPU's idle time between them (the host's share: a step the host had not launched yet, a device-to-host read,
a preemption), beside the same rollout's wall time. Used by `bench.grpo_step --profile-rollout`.

Kernel times inside CUDA-graph replays are the GPU's own; the profiler slows the host a little, so the idle share is
an upper bound of the unprofiled run's (the unprofiled rollout of the same step is printed beside it).
"""
from __future__ import annotations

import re
import time

import torch

from bench.decode_step import kind_of

GAP_US = 20.0  # idle stretches shorter than this are launch latency inside a step, not the host's waiting
TOP = 16  # kernels listed by name: what a kind is made of, to choose the next fusion
NAME_CHARS = 90


def _kind(name: str) -> str:
    return "lora" if re.search(r"small_mm|lora_expand", name.lower()) else kind_of(name)


def profile_rollout(run) -> dict:
    """Call run() (one rollout, synchronised at its end) under the profiler; the kernels' totals by kind, the GPU's
    busy and idle seconds over the rollout and its longest idle stretches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    return summarize(spans, wall)


def summarize(spans: list[tuple[float, float, str]], wall_s: float) -> dict:
    """spans: (start us, end us, kernel name), sorted by start. Busy = the union of the spans; idle stretches
    >= GAP_US between them are counted and summed."""
    by_kind: dict[str, list[float]] = {}
    by_name: dict[str, list] = {}
    busy = idle = 0.0
    gaps: list[float] = []
    end = None
    for start, stop, name in spans:
        entry = by_kind.setdefault(_kind(name), [0, 0.0])
        entry[0] += 1
        entry[1] += stop - start
        named = by_name.setdefault(name[:NAME_CHARS], [0, 0.0, _kind(name)])
        named[0] += 1
        named[1] += stop - start
        if end is None or start >= end:
            if end is not None and start - end >= GAP_US:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    idle = sum(gaps)
    first = spans[0][0] if spans else 0.0
    gaps.sort(reverse=True)
    return {"wall_s": wall_s, "gpu_span_s": ((end or 0.0) - first) / 1e6, "busy_s": busy / 1e6,
            "idle_gaps_s": idle / 1e6, "idle_gaps": len(gaps), "longest_gaps_ms": [round(g / 1e3, 2) for g in gaps[:8]],
            "by_kind": {k: {"count": c, "s": us / 1e6} for k, (c, us) in
                        sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "top_kernels": [{"name": n, "kind": k, "count": c, "s": us / 1e6} for n, (c, us, k) in
                            sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]]}


def format_profile(mode: str, p: dict, unprofiled_s: float | None = None) -> str:
    lines = [f"{mode} rollout under the profiler: wall {p['wall_s']:.2f} s"
             + (f" (unprofiled {unprofiled_s:.2f} s)" if unprofiled_s else "")
             + f", GPU busy {p['busy_s']:.2f} s, idle {p['idle_gaps_s']:.2f} s in {p['idle_gaps']} gaps >= "
             f"{GAP_US:.0f} us (longest ms: {', '.join(str(g) for g in p['longest_gaps_ms'])})"]
    for kind, v in p["by_kind"].items():
        lines.append(f"  {kind:14s} {v['s']:8.3f} s  {v['count']:>9,d} kernels")
    if p.get("top_kernels"):
        lines.append(f"  the {len(p['top_kernels'])} kernels taking the most time (s, launches, us each, kind, name):")
        lines += [f"    {t['s']:7.3f} {t['count']:>9,d} {1e6 * t['s'] / t['count']:7.1f}  {t['kind']:12s} {t['name']}"
                  for t in p["top_kernels"]]
    return "\n".join(lines)
