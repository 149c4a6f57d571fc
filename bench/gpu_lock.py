"""One GPU, several benchmark processes: timed work alone, set-up work together.

Compiling a decode graph, building random weights or measuring a peak of memory does not need the GPU to itself;
timing a rollout or a kernel does. `GpuLock(path)` is a readers-writer lock on two files shared by all the
processes of one benchmark run: `shared()` around set-up work (any number at once), `exclusive()` around timed
work (no other holder at all). A process waiting for `exclusive()` keeps new `shared()` holders out (writer
preference), so timed work waits at most for the set-up phases already running, never for ones started after it
asked. Both leave the GPU idle when they hand the lock on (every CUDA stream of the process synchronised, its cached
memory given back), so queued kernels of a set-up phase cannot run into a timed one. `GpuLock(None)` does nothing:
a process on its own.

    lock = GpuLock("/tmp/run/gpu.lock")
    with lock.shared():
        warm_up()          # compiles, captures graphs; other processes may do the same meanwhile
    with lock.exclusive():
        seconds = timed()  # nobody else runs GPU work now

Built on flock(2) (Linux and macOS; the lock dies with its process, so a crashed worker blocks nobody).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

import torch


class GpuLock:
    """A readers-writer lock over `path` (and `path`.turn) with writer preference; path None: no locking."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)
        self.waited_s = 0.0  # time spent waiting for the lock, summed over this process's sections
        self.held: str | None = None

    @contextlib.contextmanager
    def shared(self):
        """Set-up work: runs beside other shared holders, never beside an exclusive one."""
        with self._hold(fcntl.LOCK_SH, "shared"):
            yield

    @contextlib.contextmanager
    def exclusive(self):
        """Timed work: the only holder."""
        with self._hold(fcntl.LOCK_EX, "exclusive"):
            yield

    @contextlib.contextmanager
    def _hold(self, mode: int, name: str):
        if self.path is None:
            yield
            return
        if self.held is not None:
            raise RuntimeError(f"GpuLock({self.path}): {name} asked while {self.held} is held by this process")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(self.path.with_name(self.path.name + ".turn"), "a") as turn, open(self.path, "a") as main:
            # The turnstile: a writer holds it while it waits for the readers to drain, so readers that arrive
            # later queue behind it. Readers pass it at once when no writer is waiting.
            fcntl.flock(turn, fcntl.LOCK_EX)
            try:
                fcntl.flock(main, mode)
            finally:
                fcntl.flock(turn, fcntl.LOCK_UN)
            self.waited_s += time.perf_counter() - start
            self.held = name
            try:
                yield
            finally:
                _gpu_idle()
                self.held = None
                fcntl.flock(main, fcntl.LOCK_UN)


def _gpu_idle() -> None:
    """Wait for this process's queued GPU work (every stream) before the lock passes on, and give its cached memory
    back: the next holder may need it (three 7B workers on one 80 GB H100 ran a timed step out of memory)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
