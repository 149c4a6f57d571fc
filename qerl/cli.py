"""`qerl <stage> ...`: the console entry; each stage is also `python -m qerl.<stage>`."""
from __future__ import annotations

import importlib
import sys

STAGES = {
    "quantize": "qerl.quantize", "train": "qerl.train", "merge": "qerl.merge", "evaluate": "qerl.evaluate",
    "tables": "qerl.tables", "config": "qerl.config", "resources": "qerl.resources", "data": "qerl.data",
}
BENCHES = ("kernels", "rollout", "e2e", "aqn_entropy")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHES:  # qerl bench rollout ... (tables + JSON)
        importlib.import_module(f"qerl.bench.{argv[1]}").main(argv[2:])
        return
    if not argv or argv[0] not in STAGES:
        sys.exit(f"usage: qerl {{{','.join(STAGES)}}} [args...] | qerl bench {{{','.join(BENCHES)}}} [args...]"
                 "  (each is also python -m qerl.<name>)")
    module = importlib.import_module(STAGES[argv[0]])
    from qerl.stage import run_main

    run_main(module.main, argv[1:])


if __name__ == "__main__":
    main()
