"""Golds and prompts the grader cannot use are refused when the data is read (train and evaluate alike), naming
the file and line; every real file passes; grading never raises on a hostile completion."""
from __future__ import annotations

import json
import re

import pytest

from qerl import benchmarks, data
from qerl.errors import QerlError
from qerl.grading import grade_completion

# (answer_field, kind) of the real files, as their benchmark specs and config/config.yaml grade them
REAL = {"gsm8k/train.jsonl": "gsm8k", "gsm8k/test.jsonl": "gsm8k", "math500/test.jsonl": "math",
        "aime24/test.jsonl": "aime", "amc23/test.jsonl": "amc", "math_train/train.jsonl": "math"}


def test_no_real_gold_is_refused(data_dir):
    from qerl.grading import gold_problem

    for rel, kind in REAL.items():
        recs = data.load_records(data_dir / rel, answer_kind=kind)
        assert recs, rel
        assert [r["answer"] for r in recs if gold_problem(r["answer"], kind)] == [], rel
    for name in ("gsm8k", "math500", "aime24", "amc23"):  # as evaluate reads them
        assert benchmarks.load_benchmark(name, data_dir)[1]


@pytest.mark.parametrize("gold,kind", [
    ("1/2", "numeric"), ("\\frac{1}{2}", "numeric"), ("-3.5", "numeric"), ("+7", "numeric"), ("1,000", "numeric"),
    ("$18.00", "numeric"), ("25%", "numeric"), ("\\boxed{12}", "numeric"), ("9" * 1000, "numeric"),
    ("Janet sells ... #### 1,234", "gsm8k"), ("025", "aime"), ("27.0", "amc"), ("\\sqrt{2}", "math"),
    ("\\frac{1}{2}", "math"), ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "math"), ("\\text{Evelyn}", "math"),
    ("twelve", "math"), ("x \\in [-2,7]", "math"), ("p - q", "math")])
def test_benchmark_answer_forms_are_accepted(gold, kind):
    from qerl.grading import MAX_GOLD_DIGITS, gold_problem

    assert len(gold) <= 2000 and MAX_GOLD_DIGITS >= 1000
    assert gold_problem(gold, kind) is None


@pytest.mark.parametrize("gold,kind,reason", [
    ("twelve", "numeric", "is not a number"),
    ("\\sqrt{2}", "aime", "is not a number"),
    ("12\x00", "numeric", r"control character '\\x00' at offset 2"),
    ("\\frac{1}{2}\x00", "math", "control character"),
    ("1" * 5000, "numeric", "5000-digit number"),
    ("1" * 5000, "math", "5000-digit number"),
    ("so the answer is 18", "gsm8k", "gsm8k golds end in '#### N'"),
    ("solution #### eighteen", "gsm8k", "not a number after its '####'"),
    ("x" * 3000, "math", "3000 characters long"),
])
def test_unusable_golds_are_refused_with_file_and_line(tmp_path, gold, kind, reason):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "7"}) + "\n" + json.dumps({"question": "q", "answer": gold})
                    + "\n")
    with pytest.raises(QerlError) as exc:
        data.load_records(path, answer_kind=kind)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{path}:2: answer field 'answer'") and re.search(reason, msg), msg
    assert len(msg) < 400


def test_a_prompt_with_a_nul_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"question": "What is 2\x00+2?", "answer": "4"}) + "\n")
    with pytest.raises(QerlError, match=re.escape(f"{path}:1: question field 'question' holds the control "
                                                  "character '\\x00' at offset 9")):
        data.load_records(path)


def test_evaluate_refuses_a_bad_benchmark_gold_before_any_model(tmp_path, capsys):
    from qerl.evaluate import main
    from tests.stage_errors import stage_error_line

    bench = tmp_path / "aime24" / "test.jsonl"
    bench.parent.mkdir()
    bench.write_text(json.dumps({"problem": "p", "answer": "025"}) + "\n"
                     + json.dumps({"problem": "p", "answer": "twelve"}) + "\n")
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"benchmarks": [{"name": "aime24"}], "variants": ["trained"], "data_dir": str(tmp_path)}))
    line = stage_error_line(capsys, main, ["--experiment", "x", "--trained", str(tmp_path / "no-model"),
                                           "--out", str(tmp_path / "eval.json.out"), "--config-json", cfg.read_text()])
    assert f"{bench}:2: answer field 'answer' 'twelve' cannot be graded as 'aime'" in line, line


HOSTILE_COMPLETIONS = ["9" * 5000, "12\x00", "\x00", "\\boxed{" + "9" * 5000 + "}", "<answer>" + "9" * 5000 + "</answer>",
                       "Answer: " + "9" * 5000, "<answer>1" + "0" * 4400 + "/3</answer>", "\\frac{" + "9" * 4400 + "}{3}",
                       "<answer>1." + "9" * 5000 + "</answer>", "\\boxed{\x00}", "<answer>1e99999</answer>",
                       "<answer>0/0</answer>", "\\frac{1}{0}", "<answer>\\frac{" + "9" * 999 + "}{" + "9" * 999 + "}</answer>"]


@pytest.mark.parametrize("kind,gold", [("numeric", "12"), ("math", "\\frac{1}{2}"), ("gsm8k", "x #### 12"),
                                       ("aime", "025"), ("amc", 27.0)])
def test_grading_never_raises_on_a_hostile_completion(kind, gold):
    for text in HOSTILE_COMPLETIONS:
        graded = grade_completion(text, gold, kind, timeout_s=5.0)  # must return, not raise
        assert graded.correct is (text == "12\x00" and kind in ("numeric", "gsm8k")), text[:40]
