"""bench.gpu_lock: exclusive holders run alone, shared ones together, and a waiting writer goes first.

Each process of a scenario waits for events of the others before it asks for the lock, so the order of the
requests is fixed whatever the machine's load; what is tested is the order in which the lock lets them in."""
from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from bench.gpu_lock import GpuLock

CTX = mp.get_context("fork")  # the lock module needs no CUDA: fork is safe here
SETTLE = 0.3  # s for a process that announced its request to be blocked inside flock


def _proc(path, mode, name, log, events, after=None, announce=None, started=None, hold_until=None, hold=0.1):
    """Wait for `after`, announce the request, take the lock, log start, hold (until `hold_until` is set, or
    `hold` s), log end."""
    if after is not None:
        events[after].wait(10)
        time.sleep(SETTLE)
    if announce is not None:
        events[announce].set()
    with getattr(GpuLock(path), mode)():
        log.put((name, "start", time.monotonic()))
        if started is not None:
            events[started].set()
        if hold_until is not None:
            events[hold_until].wait(5)
            time.sleep(SETTLE)
        else:
            time.sleep(hold)
        log.put((name, "end", time.monotonic()))


def _run(path, plans: list[dict], event_names) -> list[tuple[str, str]]:
    log = CTX.Queue()
    events = {e: CTX.Event() for e in event_names}
    procs = [CTX.Process(target=_proc, kwargs={"path": path, "log": log, "events": events, **p}) for p in plans]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    got = sorted((log.get(timeout=5) for _ in range(2 * len(plans))), key=lambda e: e[2])
    return [(name, what) for name, what, _ in got]


def test_shared_holders_overlap(tmp_path):
    # a holds until b has started: b must get in beside it (else a gives up after 5 s and the order shows it)
    seq = _run(tmp_path / "gpu.lock", [
        dict(mode="shared", name="a", started="a_in", hold_until="b_in"),
        dict(mode="shared", name="b", after="a_in", started="b_in", hold=3 * SETTLE)], ["a_in", "b_in"])
    assert seq == [("a", "start"), ("b", "start"), ("a", "end"), ("b", "end")]


def test_an_exclusive_holder_runs_alone_and_a_waiting_writer_goes_before_later_readers(tmp_path):
    # r1 holds; w asks and waits; r2 asks while w waits and the lock is only held shared: r2 must come after w
    # (a plain readers-writer lock would let r2 in beside r1 at once)
    seq = _run(tmp_path / "gpu.lock", [
        dict(mode="shared", name="r1", started="r1_in", hold_until="r2_asks"),
        dict(mode="exclusive", name="w", after="r1_in", announce="w_asks", hold=0.2),
        dict(mode="shared", name="r2", after="w_asks", announce="r2_asks")], ["r1_in", "w_asks", "r2_asks"])
    assert seq == [("r1", "start"), ("r1", "end"), ("w", "start"), ("w", "end"), ("r2", "start"), ("r2", "end")]


def test_two_writers_never_overlap(tmp_path):
    seq = _run(tmp_path / "gpu.lock", [
        dict(mode="exclusive", name="a", started="a_in", hold_until="b_asks"),
        dict(mode="exclusive", name="b", after="a_in", announce="b_asks")], ["a_in", "b_asks"])
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
