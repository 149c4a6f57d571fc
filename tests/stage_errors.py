"""Shared by the stage-CLI tests: a stage main that must fail with exactly one `error:` line and exit code 2."""
from __future__ import annotations

import pytest

from qerl.stage import run_main


def stage_error_line(capsys, main, argv) -> str:
    """Run main(argv) through run_main; it must exit 2 printing exactly one `error:` line, which is returned."""
    with pytest.raises(SystemExit) as exc:
        run_main(main, argv)
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    return lines[0]
