"""`qerl <stage> ...`: the console entry; each stage is also `python -m qerl.<stage>`.

The GPU benchmarks are not part of the installed package: `python -m bench.<name>` from the repository root.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import sys

STAGES = {
    "quantize": "qerl.quantize", "train": "qerl.train", "merge": "qerl.merge", "evaluate": "qerl.evaluate",
    "tables": "qerl.tables", "config": "qerl.config", "resources": "qerl.resources", "data": "qerl.data",
}
BENCH_HINT = "the benchmarks are not installed: run `python -m bench.{name}` from the repository root (bench/)"


def _summary(module: str) -> str:
    """The first line of a module's docstring, read from its source (importing the stages would load torch)."""
    spec = importlib.util.find_spec(module)
    try:
        doc = ast.get_docstring(ast.parse(open(spec.origin, encoding="utf-8").read())) or ""
    except (OSError, SyntaxError, TypeError):
        doc = ""
    return doc.splitlines()[0] if doc else ""


def usage() -> str:
    lines = [f"usage: qerl {{{','.join(STAGES)}}} [args...]   (`qerl <command> --help` for its options)", "",
             "commands:"]
    lines += [f"  {name:<10} {_summary(module)}" for name, module in STAGES.items()]
    lines += ["", "Each command is also `python -m qerl.<command>`; the whole pipeline runs through Snakemake "
              "(`snakemake --cores 1`).", BENCH_HINT.format(name="<name>")[0].upper()
              + BENCH_HINT.format(name="<name>")[1:] + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the former `qerl bench <name>`: say where the benchmarks went
        sys.exit("qerl bench: " + BENCH_HINT.format(name=argv[1] if len(argv) > 1 else "<name>"))
    if argv[:1] in (["-h"], ["--help"], ["help"]):
        print(usage())
        return
    if not argv or argv[0] not in STAGES:
        sys.exit(usage() if not argv else f"qerl: unknown command {argv[0]!r}\n\n{usage()}")
    module = importlib.import_module(STAGES[argv[0]])
    from qerl.stage import run_main

    run_main(module.main, argv[1:])


if __name__ == "__main__":
    main()
