"""Evaluation benchmarks by name: where the data lives, how to grade it, the paper's sampling protocol.

    from qerl.benchmarks import resolve_benchmark, load_benchmark
    spec, records = load_benchmark("aime24", data_dir="../shared/data")

A local file under `data_dir` (same layout as ../shared/data: <name>/test.jsonl) wins over the hub, so tests and
offline clusters use exactly the files that were checked; otherwise the hub dataset is loaded by `datasets`.
Defaults follow the paper (sec. 4.1): temperature 0.6, top-p 0.95, 4096 new tokens, pass@1 over k samples.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from qerl.errors import QerlError


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark. `local_file` is relative to a data dir; `hub_name` None means local only."""

    name: str
    kind: str                      # grading kind for qerl.rewards.grade
    local_file: str
    hub_name: str | None = None
    hub_config: str | None = None
    hub_split: str = "test"
    question_field: str | None = None   # None: auto-detect (qerl.data.QUESTION_FIELDS)
    answer_field: str | None = None
    template: str = "qerl_think"
    k: int = 1                      # samples per problem for sampled pass@1
    max_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 0.95


@dataclasses.dataclass(frozen=True)
class ResolvedBenchmark:
    spec: BenchmarkSpec
    source: str                     # a local path or a hub name
    split: str
    config_name: str | None
    is_local: bool


BENCHMARKS: dict[str, BenchmarkSpec] = {
    spec.name: spec for spec in (
        BenchmarkSpec("gsm8k", "gsm8k", "gsm8k/test.jsonl", "openai/gsm8k", "main", "test",
                      "question", "answer", k=1),
        BenchmarkSpec("math500", "math", "math500/test.jsonl", "HuggingFaceH4/MATH-500", None, "test",
                      "problem", "answer", k=4),
        BenchmarkSpec("aime24", "aime", "aime24/test.jsonl", "HuggingFaceH4/aime_2024", None, "train",
                      "problem", "answer", k=16),
        BenchmarkSpec("aime25", "aime", "aime25/test.jsonl", "math-ai/aime25", None, "test",
                      None, "answer", k=16),
        BenchmarkSpec("amc23", "amc", "amc23/test.jsonl", "math-ai/amc23", None, "test",
                      None, "answer", k=16),
        # The demo task (python -m qerl.data demo --out resources/demo_task): local only, short answers.
        BenchmarkSpec("demo", "numeric", "demo_task/test.jsonl", None, None, "test",
                      "question", "answer", template="answer_line", k=1, max_tokens=16),
        # Its held-out split of larger operands (a in 30..99, never in training): does the skill generalise?
        BenchmarkSpec("demo_large", "numeric", "demo_task/heldout.jsonl", None, None, "test",
                      "question", "answer", template="answer_line", k=1, max_tokens=16),
    )
}


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def get_spec(name: str) -> BenchmarkSpec:
    if name not in BENCHMARKS:
        raise QerlError(f"benchmark {name!r} does not exist; valid names: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def resolve_benchmark(name: str, data_dir: str | Path | None = None) -> ResolvedBenchmark:
    """Where to read `name` from: `data_dir/<local_file>` if present, else the hub (unless offline or local-only)."""
    spec = get_spec(name)
    local = Path(data_dir) / spec.local_file if data_dir is not None else None
    if local is not None and local.is_file():
        return ResolvedBenchmark(spec, str(local), "test", None, True)
    where = f"{local}" if local is not None else f"<data_dir>/{spec.local_file} (no data_dir given)"
    if spec.hub_name is None:
        raise QerlError(f"benchmark {name!r} is local only and {where} does not exist")
    if _offline():
        raise QerlError(f"benchmark {name!r}: {where} does not exist and the hub ({spec.hub_name}) is offline "
                        "(HF_HUB_OFFLINE=1); put the file there or go online")
    return ResolvedBenchmark(spec, spec.hub_name, spec.hub_split, spec.hub_config, False)


def load_benchmark(name: str, data_dir: str | Path | None = None,
                   limit: int | None = None) -> tuple[BenchmarkSpec, list[dict]]:
    """The spec and its records [{id, question, answer}]."""
    from qerl.data import load_records

    resolved = resolve_benchmark(name, data_dir)
    records = load_records(resolved.source, split=resolved.split, config_name=resolved.config_name,
                           question_field=resolved.spec.question_field,
                           answer_field=resolved.spec.answer_field, limit=limit,
                           answer_kind=resolved.spec.kind)
    return resolved.spec, records
