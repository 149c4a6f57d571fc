"""Progress lines (qerl.progress): off a terminal, a `qerl progress` line at the first step, at most once per
interval after it and at the last step, with an ETA from the steps run in this process."""
from __future__ import annotations

import io

from qerl.progress import PREFIX, StepProgress, duration


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_progress_lines_at_the_first_step_once_a_minute_and_at_the_last():
    out, clock = io.StringIO(), Clock()
    progress = StepProgress("train demo", total=5, initial=1, stream=out, every_s=60.0, clock=clock)
    for seconds in (20, 20, 50, 10):  # steps 2..5 (resumed after step 1)
        clock.now += seconds
        progress.step(reward=0.5, step_s=float(seconds))
    lines = out.getvalue().splitlines()
    assert all(line.startswith(PREFIX) and "\r" not in line for line in lines)
    # the first step, then >= 60 s later (step 4 at t = 90 after t = 20; not step 3 at t = 40), and the last step
    assert [line.split()[5] for line in lines] == ["2/5", "4/5", "5/5"]
    assert lines[0] == f"{PREFIX} train demo: step 2/5 reward 0.5 step_s 20 elapsed 0m20s eta 1m00s"
    assert lines[-1].endswith("elapsed 1m40s eta 0m00s")


def test_other_ranks_write_nothing_and_durations_read_well():
    out = io.StringIO()
    progress = StepProgress("train", total=3, stream=out, enabled=False)
    progress.step(reward=1.0)
    progress.close()
    assert out.getvalue() == ""
    assert duration(59.6) == "1m00s" and duration(3725) == "1h02m" and duration(-1) == "0m00s"
