"""The tables rule writes under the config's results_dir, as every other rule does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tables_follow_the_configured_results_dir(tmp_path):
    results = tmp_path / "my results"  # a space too: the rule quotes its paths
    target = results / "tables" / "table1.md"
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--nolock", "--cores", "1",
                           "--config", f"results_dir={results}", "--", str(target)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    jobs = [line.split()[1].rstrip(":") for line in proc.stdout.splitlines() if line.startswith("rule ")]
    assert jobs == ["tables"]
    assert f"--out-dir '{results}/tables'" in proc.stdout  # the shell command writes there, quoted
