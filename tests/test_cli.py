"""The `qerl` console entry dispatches to the stage CLIs; the benchmarks are not installed with it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from qerl import cli

CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


def test_unknown_command_prints_usage():
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert "usage: qerl" in str(exc.value) and "python -m bench.<name>" in str(exc.value)


@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_help_lists_every_command_with_its_line(capsys, flag):
    cli.main([flag])
    out = capsys.readouterr().out
    for name in cli.STAGES:
        line = next(line for line in out.splitlines() if line.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10, line  # a description, read from the module's docstring
    assert "Stage 2: GRPO" in out and "python -m bench.<name>" in out


def test_stage_dispatch_runs_the_module_main(capsys):
    cli.main(["config", "check", str(CONFIG)])
    assert capsys.readouterr().out.startswith("ok:")


def test_bench_points_to_the_repository_modules_without_importing_them(monkeypatch):
    monkeypatch.delitem(sys.modules, "bench.kernels", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "kernels", "--rows", "1"])
    assert "python -m bench.kernels" in str(exc.value) and "repository root" in str(exc.value)
    assert "bench.kernels" not in sys.modules  # nothing outside the installed package is imported
