"""Progress of a long stage where the user looks: a bar on a terminal; otherwise a `qerl progress` line (step,
values, elapsed, ETA) at the first step, at most once a minute after it, and at the last, which the workflow's rules
copy to Snakemake's console (the per-step lines of the log are the stage's own, e.g. qerl.train's LoggingWindow).

    progress = StepProgress("train demo", total=40, initial=0)
    for ...:
        progress.step(reward=0.41, step_s=18.2)        # after each step
    progress.close()

A rule runs its stage as `... 2>&1 | tee <log> | grep '^qerl progress|^error:'` (workflow/rules/*.smk): the log
keeps every line, the console gets the progress lines and a failed stage's one error line.
"""
from __future__ import annotations

import sys
import time

PREFIX = "qerl progress"
CONSOLE_EVERY_S = 60.0


def duration(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class StepProgress:
    """Steps initial..total of one job; stream: where the lines go (stderr); enabled False for ranks other than 0."""

    def __init__(self, label: str, total: int, initial: int = 0, *, enabled: bool = True, stream=None,
                 every_s: float = CONSOLE_EVERY_S, clock=time.monotonic):
        self.label, self.total, self.done, self.enabled = label, total, initial, enabled
        self.stream = stream or sys.stderr
        self.every_s, self.clock = every_s, clock
        self.start, self.first = clock(), initial
        self.last_console = None
        self.bar = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=label, dynamic_ncols=True, file=self.stream)

    def eta(self) -> float | None:
        ran = self.done - self.first
        return (self.clock() - self.start) / ran * (self.total - self.done) if ran > 0 else None

    def step(self, **shown) -> None:
        """One step finished; shown: name -> number (floats with 4 significant digits)."""
        self.done += 1
        if not self.enabled:
            return
        text = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())
        if self.bar is not None:
            self.bar.set_postfix_str(text)
            self.bar.update(1)
            return
        now = self.clock()
        if self.last_console is None or now - self.last_console >= self.every_s or self.done == self.total:
            self.last_console = now
            eta = self.eta()
            print(f"{PREFIX} {self.label}: step {self.done}/{self.total} {text} elapsed {duration(now - self.start)}"
                  + (f" eta {duration(eta)}" if eta is not None else ""), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
