"""`qerl <stage> ...`: the console entry; each stage is also `python -m qerl.<stage>`.

The GPU benchmarks are not part of the installed package: `python -m bench.<name>` from the repository root.
"""
from __future__ import annotations

import importlib
import sys

STAGES = {
    "quantize": "qerl.quantize", "train": "qerl.train", "merge": "qerl.merge", "evaluate": "qerl.evaluate",
    "tables": "qerl.tables", "config": "qerl.config", "resources": "qerl.resources", "data": "qerl.data",
}
BENCH_HINT = "the benchmarks are not installed: run `python -m bench.{name}` from the repository root (bench/)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the former `qerl bench <name>`: say where the benchmarks went
        sys.exit("qerl bench: " + BENCH_HINT.format(name=argv[1] if len(argv) > 1 else "<name>"))
    if not argv or argv[0] not in STAGES:
        sys.exit(f"usage: qerl {{{','.join(STAGES)}}} [args...]  (each is also python -m qerl.<name>; "
                 + BENCH_HINT.format(name="<name>") + ")")
    module = importlib.import_module(STAGES[argv[0]])
    from qerl.stage import run_main

    run_main(module.main, argv[1:])


if __name__ == "__main__":
    main()
