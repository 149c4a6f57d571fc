"""Grading agrees with the gold answers of the real sets; wrong answers grade wrong; rewards and time limits."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from qerl.errors import QerlError
from qerl.rewards import (correctness_reward, extract_answer, format_reward, get_reward_fn, grade,
                          gold_answer, parse_number)


def _load(data_dir, rel):
    path = data_dir / rel
    if not path.exists():
        pytest.skip(f"{path} not found")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _failures(records, response, gold, kind):
    return [r for r in records if not grade(response(r), gold(r), kind)]


# ------------------------------------------------------------------ acceptance: reference solutions grade correct
@pytest.mark.parametrize("split,count", [("train", 7473), ("test", 1319)])
def test_gsm8k_reference_solutions_grade_correct(data_dir, split, count):
    recs = _load(data_dir, f"gsm8k/{split}.jsonl")
    assert len(recs) == count
    assert _failures(recs, lambda r: r["answer"], lambda r: r["answer"], "gsm8k") == []


@pytest.fixture
def math_verify_only(monkeypatch):
    """Switch off the normalised-string shortcut, so math-verify itself must find every pair equal."""
    import qerl.rewards

    monkeypatch.setattr(qerl.rewards, "_norm_str", lambda s: object())


@pytest.mark.parametrize("field", ["solution", "answer"])
def test_math500_reference_grades_correct(data_dir, field, math_verify_only):
    recs = _load(data_dir, "math500/test.jsonl")
    assert len(recs) == 500
    assert _failures(recs, lambda r: r[field], lambda r: r["answer"], "math") == []


def test_aime24_reference_grades_correct(data_dir):
    recs = _load(data_dir, "aime24/test.jsonl")
    assert _failures(recs, lambda r: str(r["answer"]), lambda r: r["answer"], "aime") == []
    bad = _failures(recs, lambda r: r["solution"], lambda r: r["answer"], "aime")
    # One AoPS solution (id 60) ends "$180 + 24 = 204$. -sepehr2010": no marked answer, the last number is the
    # author's name. Every other solution grades correct; with the answer marked it grades correct too.
    assert [r["id"] for r in bad] == [60]
    assert grade(bad[0]["solution"].replace("-sepehr2010", "").strip() + " Answer: 204", "204", "aime")


def test_amc23_reference_grades_correct(data_dir):
    recs = _load(data_dir, "amc23/test.jsonl")
    assert len(recs) == 40 and isinstance(recs[0]["answer"], float)
    assert _failures(recs, lambda r: str(r["answer"]), lambda r: r["answer"], "amc") == []
    assert _failures(recs, lambda r: f"\\boxed{{{int(r['answer'])}}}", lambda r: r["answer"], "amc") == []


def test_math_train_reference_grades_correct(data_dir, math_verify_only):
    recs = _load(data_dir, "math_train/train.jsonl")
    empty = [r["index"] for r in recs if not str(r["answer"]).strip()]
    assert len(empty) == 2  # documented in ../shared/data/README.md: nothing to grade against
    assert not grade("<answer></answer>", "", "math") and not grade("<answer>0</answer>", "", "math")
    # 1,500 of the 7,498 (all of them take ~50 s; they all pass, see the report); every "\$" answer is included.
    usable = [r for r in recs if str(r["answer"]).strip()]
    sample = random.Random(0).sample(usable, 1500) + [r for r in usable if "\\$" in r["answer"]]
    assert _failures(sample, lambda r: f"<answer>{r['answer']}</answer>", lambda r: r["answer"], "math") == []


# ------------------------------------------------------------------ wrong answers grade wrong
def test_perturbed_numeric_answers_grade_wrong(data_dir):
    gsm = _load(data_dir, "gsm8k/test.jsonl")[:300]
    wrong = lambda r: f"#### {parse_number(gold_answer(r['answer'], 'gsm8k')) + 1}"  # noqa: E731
    assert [r for r in gsm if grade(wrong(r), r["answer"], "gsm8k")] == []
    aime = _load(data_dir, "aime24/test.jsonl")
    assert not any(grade(f"\\boxed{{{int(r['answer']) + 1}}}", r["answer"], "aime") for r in aime)
    amc = _load(data_dir, "amc23/test.jsonl")
    assert not any(grade(f"<answer>{r['answer'] + 1}</answer>", r["answer"], "amc") for r in amc)


def test_other_problems_answers_grade_wrong_on_math500(data_dir):
    recs = _load(data_dir, "math500/test.jsonl")[:200]
    answers = [r["answer"] for r in recs]
    hits = []
    for i, r in enumerate(recs):
        j = next(j % len(recs) for j in range(i + 1, i + len(recs)) if answers[j % len(recs)] != r["answer"])
        if grade(f"<answer>{answers[j]}</answer>", r["answer"], "math"):
            hits.append((r["answer"], answers[j]))
    # The only neighbour pair that grades equal is a true equivalence: math-verify reads "x=5" as its value.
    assert hits == [("5", "x=5")]


# ------------------------------------------------------------------ extraction
@pytest.mark.parametrize("text,kind,expected", [
    ("<think>2+2</think> <answer>4</answer>", "numeric", "4"),
    ("<answer>so \\boxed{\\frac{1}{2}}</answer>", "math", "\\frac{1}{2}"),
    ("We get \\boxed{\\frac{a}{b+\\sqrt{2}}}.", "math", "\\frac{a}{b+\\sqrt{2}}"),
    ("Thus the answer is $12$.", "numeric", "12"),
    ("Answer: -7", "numeric", "-7"),
    ("blah\n#### 1,234", "gsm8k", "1,234"),
    ("I think it is 3 or maybe 5", "numeric", "5"),
    ("no digits here", "numeric", None),
])
def test_extract_answer(text, kind, expected):
    assert extract_answer(text, kind) == expected


def test_strict_extraction_needs_a_marker():
    assert extract_answer("it is 5", "numeric", strict=True) is None
    assert not grade("it is 5", "5", "numeric", strict=True)
    assert grade("it is 5", "5", "numeric")


@pytest.mark.parametrize("response,gold,kind,expected", [
    ("\\boxed{\\$18.00}", "x #### 18", "gsm8k", True),
    ("Answer: 18 dollars", "#### 18", "gsm8k", True),
    ("Answer: 1,000", "1000", "numeric", True),
    ("<answer>\\frac{50}{2}</answer>", "025", "aime", True),
    ("<answer>0.5</answer>", "\\frac{1}{2}", "math", True),
    ("<answer>\\frac{\\sqrt{2}}{2}</answer>", "\\frac{1}{\\sqrt{2}}", "math", True),
    ("<answer>\\frac{\\sqrt{3}}{2}</answer>", "\\frac{1}{\\sqrt{2}}", "math", False),
    ("\\boxed{18.90}", "\\$18.90", "math", True),
    ("\\boxed{\\$32,348}", "\\$32,\\!348", "math", True),
    ("\\boxed{\\$32,349}", "\\$32,\\!348", "math", False),
    ("<answer>19</answer>", "#### 18", "gsm8k", False),
])
def test_grade_cases(response, gold, kind, expected):
    assert grade(response, gold, kind) is expected


def test_unknown_kind_is_a_one_line_error():
    with pytest.raises(QerlError, match="grading kind 'mmlu'"):
        grade("1", "1", "mmlu")


# ------------------------------------------------------------------ time limit
PATHOLOGICAL = "\\boxed{9^{9^{9^{9^{9^{9}}}}}} "


def test_pathological_sample_cannot_hang_main_thread():
    t0 = time.monotonic()
    assert grade(PATHOLOGICAL, "3", "math", timeout_s=1) is False
    assert time.monotonic() - t0 < 3 * 1 + 2


def test_pathological_sample_cannot_hang_worker_thread():
    result = {}

    def run():
        t0 = time.monotonic()
        result["bad"] = grade(PATHOLOGICAL, "3", "math", timeout_s=1)
        result["good"] = grade("\\boxed{\\frac{1}{2}}", "0.5", "math", timeout_s=1)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert result["bad"] is False and result["good"] is True
    assert result["seconds"] < 3 * 1 + 2 + 5


# ------------------------------------------------------------------ reward functions
def test_correctness_reward_accepts_strings_and_conversations():
    completions = ["<answer>4</answer>", [{"role": "assistant", "content": "<answer>5</answer>"}]]
    assert correctness_reward(completions, ["4", "4"], kind="numeric") == [1.0, 0.0]
    assert correctness_reward(completions, answer=["4", "5"], kind="numeric") == [1.0, 1.0]
    with pytest.raises(QerlError, match="one per completion"):
        correctness_reward(completions, ["4"], kind="numeric")


def test_think_format_reward():
    good = "<think>a</think>\n<answer>4</answer>"
    assert format_reward([good, "<answer>4</answer>", good + " extra", "<think>a</think>"]) == [1.0, 0, 0, 0]


def test_answer_line_format_penalises_trailing_text():
    rewards = format_reward(["Answer: 8", "17 - 9 = 8\nAnswer: 8\n", "8", "Answer: 8\nBecause 17 - 9 is 8."],
                            style="answer_line", trailing_penalty=0.5)
    assert rewards == [1.0, 1.0, 0.0, -0.5]


def test_get_reward_fn_builtin_and_dotted():
    assert get_reward_fn("correctness") is correctness_reward
    assert get_reward_fn("qerl.rewards:format_reward") is format_reward
    assert get_reward_fn("qerl.rewards.format_reward") is format_reward
    assert get_reward_fn("answer_line_format")(["Answer: 3"]) == [1.0]
    for bad in ("nope", "qerl.nonexistent:fn", "qerl.rewards:nothing"):
        with pytest.raises(QerlError):
            get_reward_fn(bad)
