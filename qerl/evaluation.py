"""Benchmark evaluation: generate with a rollout engine, grade, and summarise with honest uncertainty.

    summary, per_problem = evaluate_benchmark(engine, tokenizer, records, kind="aime", template="qerl_think",
                                              sampling=SamplingParams(temperature=0.6, top_p=0.95,
                                                                      max_tokens=4096), k=16, batch_size=8)

Statistics (`pass_at_1_stats`): accuracy is the mean over problems of the per-problem mean over k samples (pass@1
averaged over k, as the paper reports). The uncertainty is over problems, the unit that was sampled from the
benchmark's population; with AIME's 30 problems it is wide and must be shown:
  k == 1: Wilson score interval for a binomial proportion (stays inside [0, 1] and keeps honest coverage at
          n = 30 and at accuracies near 0 or 1, where the normal interval collapses).
  k > 1:  Student-t interval on the per-problem means (n - 1 degrees of freedom), clipped to [0, 1]; when every
          problem has the same mean of 0 or 1 (zero spread) the Wilson interval over problems is used instead, so
          a perfect or null score never claims zero uncertainty.
stderr is always the sample standard deviation of the per-problem means over sqrt(n).

eval.json (results/{experiment}/eval.json) follows workflow/schemas/eval.schema.json; `validate_eval` checks it.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from qerl.errors import QerlError

Z95 = 1.959963984540054
SCHEMA_PATH = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "eval.schema.json"


# ------------------------------------------------------------------------------------------ statistics
def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion successes / n."""
    if n <= 0:
        raise QerlError("wilson_interval: n must be positive")
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes <= 0 else max(0.0, min(p, center - half))
    high = 1.0 if successes >= n else min(1.0, max(p, center + half))
    return low, high


def pass_at_1_stats(correct: list[list[bool]]) -> dict:
    """accuracy, stderr, ci95_low/high, n_problems, k from a problems x samples matrix of booleans."""
    if not correct:
        raise QerlError("pass_at_1_stats: no problems")
    ks = {len(row) for row in correct}
    if len(ks) != 1 or 0 in ks:
        raise QerlError(f"pass_at_1_stats: every problem needs the same number (>0) of samples; got {sorted(ks)}")
    k, n = ks.pop(), len(correct)
    means = [sum(bool(c) for c in row) / k for row in correct]
    acc = sum(means) / n
    var = sum((m - acc) ** 2 for m in means) / (n - 1) if n > 1 else 0.0
    stderr = math.sqrt(var / n)
    if k == 1:
        low, high, method = *wilson_interval(sum(means), n), "wilson"
    elif var == 0.0 and acc in (0.0, 1.0):
        low, high, method = *wilson_interval(acc * n, n), "wilson_problems"
    else:
        from scipy.stats import t as student_t

        half = float(student_t.ppf(0.975, n - 1)) * stderr if n > 1 else float("inf")
        low, high, method = max(0.0, acc - half), min(1.0, acc + half), "student_t"
    return {"accuracy": acc, "stderr": stderr, "ci95_low": low, "ci95_high": high, "n_problems": n, "k": k,
            "ci_method": method}


# ------------------------------------------------------------------------------------------ running
def _sampling_dict(sampling: Any) -> dict:
    if dataclasses.is_dataclass(sampling):
        d = dataclasses.asdict(sampling)
    else:
        d = {k: v for k, v in vars(sampling).items() if not k.startswith("_")}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}


def _grade_rows(records: list[dict], texts: list[str], out, k: int, kind: str, offset: int, *,
                timeout_s: float, stats) -> list[dict]:
    """Per-problem records for one generated batch (rows prompt-major: i*k + j); `stats` counts timeouts."""
    from qerl.rewards import grade_completion

    problems = []
    for i, rec in enumerate(records):
        samples = []
        for j in range(k):
            row = i * k + j
            g = grade_completion(texts[row], rec["answer"], kind, timeout_s=timeout_s)
            stats.add(g.timed_out)
            samples.append({"text": texts[row], "extracted": g.extracted, "correct": g.correct,
                            "grading_timed_out": g.timed_out,
                            "n_tokens": len(out.completion_ids[row]), "finish_reason": out.finish_reasons[row]})
        problems.append({"index": offset + i, "id": rec.get("id", str(offset + i)), "gold": rec["answer"],
                         "accuracy": sum(s["correct"] for s in samples) / k, "samples": samples})
    return problems


def evaluate_benchmark(engine, tokenizer, records: list[dict], *, kind: str, template: str, sampling,
                       k: int = 1, batch_size: int = 8, grading_timeout_s: float = 1.0) -> tuple[dict, list[dict]]:
    """Generate k completions per problem, grade them, and return (summary, per_problem records).

    Grading one completion takes at most grading_timeout_s seconds; past it, the sample is wrong and counted in
    the summary's `grading_timeouts`."""
    from qerl.data import encode_prompts
    from qerl.rewards import GradingStats

    if not records:
        raise QerlError("evaluate_benchmark: no records")
    if k < 1 or batch_size < 1:
        raise QerlError(f"evaluate_benchmark: k={k} and batch_size={batch_size} must be >= 1")
    greedy = float(getattr(sampling, "temperature", 1.0)) == 0.0
    if greedy:
        k = 1  # greedy decoding gives the same completion k times
    per_problem: list[dict] = []
    stats = GradingStats()
    for start in range(0, len(records), batch_size):
        batch = records[start:start + batch_size]
        prompt_ids = encode_prompts(tokenizer, [r["question"] for r in batch], template)
        out = engine.generate(prompt_ids, k, sampling)
        if len(out.completion_ids) != len(batch) * k:
            raise QerlError(f"engine returned {len(out.completion_ids)} completions for {len(batch)} prompts "
                            f"x n={k}; expected {len(batch) * k}")
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        per_problem.extend(_grade_rows(batch, texts, out, k, kind, start, timeout_s=grading_timeout_s, stats=stats))
    samples = [s for p in per_problem for s in p["samples"]]
    summary = pass_at_1_stats([[s["correct"] for s in p["samples"]] for p in per_problem])
    summary.update({
        "mode": "greedy" if greedy else "sampled", "kind": kind, "template": template,
        "n_samples": len(samples),
        "mean_response_tokens": sum(s["n_tokens"] for s in samples) / len(samples),
        "n_truncated": sum(s["finish_reason"] == "length" for s in samples),
        "grading_timeouts": stats.timeouts,
        "sampling": _sampling_dict(sampling),
    })
    return summary, per_problem


# ------------------------------------------------------------------------------------------ eval.json
def result_key(benchmark: str, variant: str, mode: str) -> str:
    """Key of one result inside eval.json's `benchmarks` (a benchmark may appear per variant and mode)."""
    return f"{benchmark}/{variant}/{mode}"


def validate_eval(doc: dict) -> dict:
    """Validate an eval.json document against workflow/schemas/eval.schema.json; QerlError names the path."""
    import jsonschema

    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path) or "<root>"
        raise QerlError(f"eval.json invalid at {path}: {error.message}")
    for key, res in doc["benchmarks"].items():
        low, high = res["ci95"]
        if not low - 1e-9 <= res["accuracy"] <= high + 1e-9:
            raise QerlError(f"eval.json invalid at benchmarks/{key}/ci95: {res['ci95']} does not contain "
                            f"accuracy {res['accuracy']}")
    return doc


def write_eval_json(doc: dict, path: str | Path) -> Path:
    """Validate, then write (a file that fails the schema is never left behind)."""
    validate_eval(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def load_eval_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise QerlError(f"eval file {path} does not exist")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise QerlError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        return validate_eval(doc)
    except QerlError as exc:
        raise QerlError(f"{path}: {exc}") from None


def benchmark_entry(summary: dict, *, benchmark: str, variant: str, **extra) -> dict:
    """An eval.json `benchmarks` entry from an evaluate_benchmark summary."""
    entry = {"benchmark": benchmark, "variant": variant, "mode": summary["mode"],
             "accuracy": summary["accuracy"], "stderr": summary["stderr"],
             "ci95": [summary["ci95_low"], summary["ci95_high"]], "ci_method": summary["ci_method"],
             "n_problems": summary["n_problems"], "k": summary["k"], "n_samples": summary["n_samples"],
             "mean_response_tokens": summary["mean_response_tokens"], "n_truncated": summary["n_truncated"],
             "grading_timeouts": summary.get("grading_timeouts", 0),
             "kind": summary["kind"], "template": summary["template"], "sampling": summary["sampling"]}
    entry.update(extra)
    return entry


def find_result(doc: dict, benchmark: str, variant: str, mode: str | None = None) -> dict | None:
    """The entry for (benchmark, variant[, mode]); with mode None, "sampled" is preferred over "greedy"."""
    modes = [mode] if mode else ["sampled", "greedy"]
    for m in modes:
        for res in doc.get("benchmarks", {}).values():
            if res.get("benchmark") == benchmark and res.get("variant") == variant and res.get("mode") == m:
                return res
    return None
