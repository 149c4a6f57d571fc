"""qerl.bench.gpu_lock: exclusive holders run alone, shared ones together, and a waiting writer goes first."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from qerl.bench.gpu_lock import GpuLock


def _hold(path, mode: str, name: str, delay: float, hold: float, log):
    time.sleep(delay)
    lock = GpuLock(path)
    with getattr(lock, mode)():
        log.put((name, "start", time.monotonic()))
        time.sleep(hold)
        log.put((name, "end", time.monotonic()))


def _run(path, plan) -> list[tuple[str, str]]:
    """plan: (mode, name, start delay s, hold s) per process; returns the (name, event) sequence in time order."""
    ctx = mp.get_context("fork")  # the lock module needs no CUDA: fork is safe here
    log = ctx.Queue()
    procs = [ctx.Process(target=_hold, args=(path, *p, log)) for p in plan]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    events = sorted((log.get(timeout=5) for _ in range(2 * len(plan))), key=lambda e: e[2])
    return [(name, what) for name, what, _ in events]


def test_shared_holders_overlap(tmp_path):
    seq = _run(tmp_path / "gpu.lock", [("shared", "a", 0.0, 0.8), ("shared", "b", 0.2, 0.8)])
    assert seq == [("a", "start"), ("b", "start"), ("a", "end"), ("b", "end")]


def test_an_exclusive_holder_runs_alone_and_a_waiting_writer_goes_before_later_readers(tmp_path):
    # r1 holds; w asks at 0.2 s and must wait for r1; r2 asks at 0.4 s, while w waits: r2 must come after w,
    # though the lock is only held shared when it asks (a plain readers-writer lock would let it in at once)
    seq = _run(tmp_path / "gpu.lock", [("shared", "r1", 0.0, 1.0), ("exclusive", "w", 0.2, 0.4),
                                       ("shared", "r2", 0.4, 0.1)])
    assert seq == [("r1", "start"), ("r1", "end"), ("w", "start"), ("w", "end"), ("r2", "start"), ("r2", "end")]


def test_two_writers_never_overlap(tmp_path):
    seq = _run(tmp_path / "gpu.lock", [("exclusive", "a", 0.0, 0.5), ("exclusive", "b", 0.1, 0.2)])
    assert seq == [("a", "start"), ("a", "end"), ("b", "start"), ("b", "end")]


def test_no_path_is_no_lock_and_nesting_is_refused(tmp_path):
    free = GpuLock(None)
    with free.exclusive(), free.exclusive():  # nothing to hold
        pass
    lock = GpuLock(tmp_path / "gpu.lock")
    with lock.shared():
        assert lock.held == "shared"
        with pytest.raises(RuntimeError, match="shared is held"):
            with lock.exclusive():
                pass
    assert lock.held is None and lock.waited_s >= 0
    with lock.exclusive():  # released: can be taken again
        pass
