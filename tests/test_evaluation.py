"""pass@1 statistics against scipy, interval coverage at n=30, evaluate_benchmark with a fake engine, eval.json."""
from __future__ import annotations

import dataclasses
import datetime
import json
import re
import time

import numpy as np
import pytest
from scipy import stats

from qerl.errors import QerlError
from qerl.evaluation import (benchmark_entry, evaluate_benchmark, find_result, load_eval_json, pass_at_1_stats,
                             result_key, validate_eval, wilson_interval, write_eval_json)


# ------------------------------------------------------------------ statistics
@pytest.mark.parametrize("successes,n", [(0, 30), (3, 30), (15, 30), (29, 30), (30, 30), (412, 500)])
def test_wilson_matches_scipy(successes, n):
    ref = stats.binomtest(successes, n).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = wilson_interval(successes, n)
    assert low == pytest.approx(ref.low, abs=1e-12) and high == pytest.approx(ref.high, abs=1e-12)


def test_k1_stats_are_proportion_with_wilson():
    correct = [[True]] * 7 + [[False]] * 23
    s = pass_at_1_stats(correct)
    assert s["accuracy"] == pytest.approx(7 / 30) and s["k"] == 1 and s["n_problems"] == 30
    assert s["stderr"] == pytest.approx(np.std([1] * 7 + [0] * 23, ddof=1) / np.sqrt(30))
    ref = stats.binomtest(7, 30).proportion_ci(method="wilson")
    assert (s["ci95_low"], s["ci95_high"]) == pytest.approx((ref.low, ref.high))


def test_k_samples_use_t_interval_over_problems():
    rng = np.random.default_rng(0)
    matrix = rng.random((30, 16)) < rng.random((30, 1))
    s = pass_at_1_stats(matrix.tolist())
    means = matrix.mean(axis=1)
    ref = stats.ttest_1samp(means, 0.0).confidence_interval(0.95)
    assert s["accuracy"] == pytest.approx(means.mean(), rel=1e-12)
    assert s["stderr"] == pytest.approx(stats.sem(means), rel=1e-12)
    assert (s["ci95_low"], s["ci95_high"]) == pytest.approx((max(0, ref.low), min(1, ref.high)), rel=1e-9)


def test_degenerate_scores_keep_uncertainty():
    for value in (True, False):
        s = pass_at_1_stats([[value] * 4] * 30)
        assert s["stderr"] == 0.0 and s["ci95_high"] - s["ci95_low"] > 0.1  # n=30 never means certainty
    with pytest.raises(QerlError, match="same number"):
        pass_at_1_stats([[True, False], [True]])


def test_k1_interval_coverage_at_n30_is_honest():
    """Simulate AIME-sized benchmarks: the 95% interval must cover the true accuracy >= ~93% of the time."""
    rng = np.random.default_rng(1)
    for p in (0.05, 0.15, 0.5):
        draws = rng.random((2000, 30)) < p
        covered = 0
        for row in draws:
            s = pass_at_1_stats([[bool(x)] for x in row])
            covered += s["ci95_low"] <= p <= s["ci95_high"]
        assert covered / 2000 > 0.93, (p, covered / 2000)


# ------------------------------------------------------------------ evaluate_benchmark with a fake engine
@dataclasses.dataclass
class FakeSampling:
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    max_tokens: int = 16
    stop: tuple = ()
    seed: int | None = None


@dataclasses.dataclass
class FakeOutput:
    prompt_ids: list
    completion_ids: list
    logprobs: list
    finish_reasons: list


class FakeEngine:
    """Answers "What is a - b?" correctly on sample j unless (a + j) is divisible by 3; every 5th row truncates."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.calls = []

    def generate(self, prompt_ids, n, sampling):
        self.calls.append((len(prompt_ids), n))
        completions, reasons = [], []
        for ids in prompt_ids:
            a, b = map(int, re.search(r"What is (\d+) - (\d+)\?", self.tok.decode(ids)).groups())
            for j in range(n):
                value = a - b if (a + j) % 3 else a - b + 1
                completions.append(self.tok(f"Answer: {value}", add_special_tokens=False)["input_ids"]
                                   + [self.tok.convert_tokens_to_ids("<|im_end|>")])
                reasons.append("length" if len(reasons) % 5 == 4 else "stop")
        return FakeOutput([p for p in prompt_ids for _ in range(n)], completions,
                          [[0.0] * len(c) for c in completions], reasons)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


RECORDS = [{"id": f"p{i}", "question": f"What is {a} - {b}?", "answer": str(a - b)}
           for i, (a, b) in enumerate([(5, 1), (6, 2), (7, 7), (12, 3), (20, 8), (9, 0), (13, 13)])]


def test_evaluate_benchmark_sampled(tokenizer):
    engine = FakeEngine(tokenizer)
    summary, problems = evaluate_benchmark(engine, tokenizer, RECORDS, kind="numeric", template="answer_line",
                                           sampling=FakeSampling(), k=3, batch_size=3)
    assert engine.calls == [(3, 3), (3, 3), (1, 3)]
    expected = [[(int(r["question"].split()[2]) + j) % 3 != 0 for j in range(3)] for r in RECORDS]
    assert [[s["correct"] for s in p["samples"]] for p in problems] == expected
    ref = pass_at_1_stats(expected)
    assert summary["accuracy"] == pytest.approx(ref["accuracy"]) and summary["ci95_low"] == ref["ci95_low"]
    assert summary["mode"] == "sampled" and summary["k"] == 3 and summary["n_samples"] == 21
    assert summary["grading_timeouts"] == 0 and not any(s["grading_timed_out"] for p in problems for s in p["samples"])
    assert summary["n_truncated"] == sum(1 for i in range(21) if (i % 9) % 5 == 4)  # per-batch counter in fake
    n_tokens = [s["n_tokens"] for p in problems for s in p["samples"]]
    assert summary["mean_response_tokens"] == pytest.approx(sum(n_tokens) / 21)
    assert problems[0]["id"] == "p0" and problems[0]["samples"][0]["extracted"] == "4"
    assert "<|im_end|>" not in problems[0]["samples"][0]["text"]


def test_greedy_uses_one_sample(tokenizer):
    engine = FakeEngine(tokenizer)
    summary, _ = evaluate_benchmark(engine, tokenizer, RECORDS, kind="numeric", template="answer_line",
                                    sampling=FakeSampling(temperature=0.0), k=8, batch_size=8)
    assert engine.calls == [(7, 1)] and summary["mode"] == "greedy" and summary["k"] == 1
    assert summary["accuracy"] == pytest.approx(sum(int(r["question"].split()[2]) % 3 != 0 for r in RECORDS) / 7)


# ------------------------------------------------------------------ eval.json
def _doc(tokenizer):
    engine = FakeEngine(tokenizer)
    doc = {"experiment": "demo", "model": {"path": "results/demo/merged", "base": "tiny"},
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(), "benchmarks": {}}
    for variant in ("base", "trained"):
        summary, _ = evaluate_benchmark(engine, tokenizer, RECORDS, kind="numeric", template="answer_line",
                                        sampling=FakeSampling(temperature=0.0), k=1, batch_size=4)
        doc["benchmarks"][result_key("demo", variant, "greedy")] = benchmark_entry(
            summary, benchmark="demo", variant=variant)
    return doc


def test_eval_json_roundtrip_and_lookup(tokenizer, tmp_path):
    doc = _doc(tokenizer)
    path = write_eval_json(doc, tmp_path / "eval.json")
    loaded = load_eval_json(path)
    assert find_result(loaded, "demo", "base")["variant"] == "base"
    assert find_result(loaded, "demo", "trained", "greedy")["n_problems"] == 7
    assert find_result(loaded, "demo", "quantized_base") is None
    json.dumps(loaded)


@pytest.mark.parametrize("mutate,where", [
    (lambda d: d.pop("experiment"), "<root>"),
    (lambda d: d["benchmarks"]["demo/base/greedy"].update(accuracy=1.5), "benchmarks/demo/base/greedy/accuracy"),
    (lambda d: d["benchmarks"]["demo/base/greedy"].update(variant="finetuned"), "benchmarks/demo/base/greedy/variant"),
    (lambda d: d["benchmarks"]["demo/trained/greedy"].pop("ci95"), "benchmarks/demo/trained/greedy"),
    (lambda d: d["benchmarks"]["demo/trained/greedy"].update(ci95=[0.9, 1.0]), "benchmarks/demo/trained/greedy/ci95"),
])
def test_validate_eval_names_failing_path(tokenizer, tmp_path, mutate, where):
    doc = _doc(tokenizer)
    mutate(doc)
    with pytest.raises(QerlError) as exc:
        validate_eval(doc)
    assert f"at {where}" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(QerlError):
        write_eval_json(doc, tmp_path / "eval.json")
    assert not (tmp_path / "eval.json").exists()


def test_evaluate_benchmark_with_the_torch_engine(tiny_model_dir):
    """Contract check against the real rollout engine on the tiny random model (accuracy itself is ~0)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.rewards import grade
    from qerl.rollout import SamplingParams, make_engine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = make_engine("torch", model, tok)
    summary, problems = evaluate_benchmark(engine, tok, RECORDS[:5], kind="numeric", template="answer_line",
                                           sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=0),
                                           k=2, batch_size=2)
    samples = [s for p in problems for s in p["samples"]]
    assert len(problems) == 5 and len(samples) == 10 and summary["n_samples"] == 10
    assert all(1 <= s["n_tokens"] <= 6 and s["finish_reason"] in ("stop", "length") for s in samples)
    assert summary["n_truncated"] == sum(s["finish_reason"] == "length" for s in samples)
    assert all(s["correct"] == grade(s["text"], p["gold"], "numeric") for p in problems for s in p["samples"])
    assert summary["sampling"]["max_tokens"] == 6 and summary["mode"] == "sampled"


# ------------------------------------------------------------------ grading limit
MB = 1 << 20


class TextEngine:
    """Completion row r is the single token id r; the test's batch_decode turns it into texts[r]."""

    def __init__(self):
        self.rows = 0

    def generate(self, prompt_ids, n, sampling):
        ids = [[self.rows + r] for r in range(len(prompt_ids) * n)]
        self.rows += len(ids)
        return FakeOutput([p for p in prompt_ids for _ in range(n)], ids, [[0.0]] * len(ids), ["stop"] * len(ids))


def _evaluate_texts(monkeypatch, tokenizer, texts, records, **kw):
    monkeypatch.setattr(tokenizer, "batch_decode", lambda ids, **_: [texts[row[0]] for row in ids])
    k = len(texts) // len(records)
    return evaluate_benchmark(TextEngine(), tokenizer, records, kind="math", template="answer_line",
                              sampling=FakeSampling(), k=k, batch_size=1, **kw)


@pytest.mark.parametrize("text", ["<answer>" * (MB // 8) + " junk 7", "\\boxed{" * (MB // 7) + "7",
                                  "<think>" * (MB // 7) + "</think>"], ids=["answer", "boxed", "think"])
def test_hostile_megabyte_is_graded_quickly(tokenizer, monkeypatch, text):
    from qerl.rewards import grade

    assert grade("\\boxed{7}", "7", "math")  # math-verify's one-time imports stay out of the timing
    t0 = time.monotonic()
    summary, problems = _evaluate_texts(monkeypatch, tokenizer, [text], RECORDS[:1])
    assert time.monotonic() - t0 < 8.0  # ~0.1 s; the lazy tag regex took minutes on these
    assert summary["n_samples"] == 1 and problems[0]["samples"][0]["text"] is text


def test_timed_out_samples_are_wrong_and_counted(tokenizer, monkeypatch, tmp_path):
    import qerl.grading

    monkeypatch.setattr(qerl.grading, "_math_equal", lambda *a: time.sleep(30) or True)
    t0 = time.monotonic()
    summary, problems = _evaluate_texts(monkeypatch, tokenizer, ["<answer>4</answer>"] * 4, RECORDS[:2],
                                        grading_timeout_s=0.2)
    assert time.monotonic() - t0 < 4 * 0.2 + 10.0  # not waiting out the samples' 4 x 30 s
    assert summary["grading_timeouts"] == 4 and summary["accuracy"] == 0.0
    assert all(s["grading_timed_out"] and not s["correct"] for p in problems for s in p["samples"])
    doc = {"experiment": "demo", "model": {"path": "m"}, "created": "2025-01-01T00:00:00+00:00",
           "benchmarks": {"demo/trained/sampled": benchmark_entry(summary, benchmark="demo", variant="trained")}}
    assert load_eval_json(write_eval_json(doc, tmp_path / "eval.json"))["benchmarks"]["demo/trained/sampled"][
        "grading_timeouts"] == 4
    doc["benchmarks"]["demo/trained/sampled"]["grading_timeouts"] = -1
    with pytest.raises(QerlError, match="grading_timeouts"):
        validate_eval(doc)
