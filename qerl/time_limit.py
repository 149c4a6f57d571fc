"""Run one call under a wall-time limit, so a grader or reward function on model text can never hang its caller.

    from qerl.time_limit import call_with_limit
    finished, value = call_with_limit(grade_one, (text, gold), seconds=1.0)   # (False, None) past the limit

Main thread: an interval timer (SIGALRM) raises TimeLimitExceeded inside whatever Python code is running. It is a
BaseException, so libraries' `except Exception` (math-verify and sympy have many) cannot swallow it, and it fires
again every REFIRE_S in case a bare `except:` does; a result that arrives after any firing is discarded. An outer
timer (a caller's own alarm) is saved and restored with its remaining time. C code that never returns to the
interpreter (one enormous integer power) is not interrupted in the main thread.
Other threads cannot take signals: the call runs in a worker process (forked once, so it already has every module
the caller imported) that is killed when the limit passes and forked again on the next call. The function and its
arguments must pickle (module-level functions do); one that does not runs in the calling thread without a limit,
with a warning.
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

REFIRE_S = 0.05


class TimeLimitExceeded(BaseException):
    """Raised inside the limited call by the alarm; never escapes call_with_limit."""


def call_with_limit(fn: Callable, args: tuple = (), kwargs: dict | None = None, *,
                    seconds: float) -> tuple[bool, Any]:
    """(True, fn(*args, **kwargs)) if it returns within `seconds`, else (False, None). Its exceptions propagate."""
    kwargs = kwargs or {}
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _call_with_alarm(fn, args, kwargs, seconds)
    return _WORKER.call(fn, args, kwargs, seconds)


class _Alarm:
    def __init__(self):
        self.armed, self.fired = True, False

    def __call__(self, signum, frame):
        if self.armed:
            self.fired = True
            raise TimeLimitExceeded


def _call_with_alarm(fn: Callable, args: tuple, kwargs: dict, seconds: float) -> tuple[bool, Any]:
    outer_handler = signal.getsignal(signal.SIGALRM)
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    alarm, start = _Alarm(), time.monotonic()
    signal.signal(signal.SIGALRM, alarm)
    # an outer alarm due sooner fires first here (this call then counts as over its limit), and again after
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_delay) if outer_delay else seconds, REFIRE_S)
    try:
        value = fn(*args, **kwargs)
        return (False, None) if alarm.fired else (True, value)
    except TimeLimitExceeded:
        return False, None
    finally:
        alarm.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler if outer_handler is not None else signal.SIG_DFL)
        if outer_delay:
            left = max(outer_delay - (time.monotonic() - start), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, outer_interval)


def _serve(conn) -> None:
    """Worker loop: run each (fn, args, kwargs) received and send back (ok, value or exception)."""
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(*args, **kwargs))
        except Exception as exc:  # handed back to the caller, which re-raises it
            reply = (False, exc)
        try:
            conn.send(reply)
        except Exception as exc:  # an unpicklable result or exception
            conn.send((False, RuntimeError(f"{getattr(fn, '__name__', fn)}: {type(exc).__name__}: {exc}")))


class _Worker:
    """One lazily forked worker process; a lock keeps threads from interleaving on its pipe (waiting for it is not
    counted in the limit)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.proc = self.conn = None

    def _start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="qerl-time-limit")
        self.proc.start()
        child.close()

    def call(self, fn: Callable, args: tuple, kwargs: dict, seconds: float) -> tuple[bool, Any]:
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            log.warning("%s cannot be sent to a worker process (%s): it runs without a time limit off the "
                        "main thread", getattr(fn, "__qualname__", fn), exc)
            return True, fn(*args, **kwargs)
        with self.lock:
            if self.proc is None or not self.proc.is_alive():
                self._start()
            self.conn.send_bytes(payload)
            if not self.conn.poll(seconds):
                self.shutdown()
                return False, None
            try:
                ok, value = self.conn.recv()
            except (EOFError, OSError):  # the worker died (out of memory, a crash in C code): no result
                log.warning("time-limit worker died running %s", getattr(fn, "__qualname__", fn))
                self.shutdown()
                return False, None
        if not ok:
            raise value
        return True, value

    def shutdown(self) -> None:
        """Kill the worker; the next call forks a fresh one that has what the caller imported or patched since."""
        with self.lock:
            if self.proc is not None:
                self.proc.kill()
                self.proc.join()
                self.conn.close()
            self.proc = self.conn = None


_WORKER = _Worker()
shutdown_worker = _WORKER.shutdown
