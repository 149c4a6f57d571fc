"""The `qerl` console entry dispatches to the stage CLIs and benchmarks."""
from __future__ import annotations

from pathlib import Path

import pytest

from qerl import cli

CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


def test_unknown_command_prints_usage():
    with pytest.raises(SystemExit) as exc:
        cli.main(["frobnicate"])
    assert "usage: qerl" in str(exc.value) and "bench" in str(exc.value)


def test_stage_dispatch_runs_the_module_main(capsys):
    cli.main(["config", "check", str(CONFIG)])
    assert capsys.readouterr().out.startswith("ok:")


def test_bench_dispatch(monkeypatch):
    import qerl.bench.aqn_entropy as mod

    seen = {}
    monkeypatch.setattr(mod, "main", lambda argv: seen.setdefault("argv", argv))
    cli.main(["bench", "aqn_entropy", "--sigmas", "0"])
    assert seen["argv"] == ["--sigmas", "0"]
