"""Grading agrees with the gold answers of the real sets; wrong answers grade wrong; rewards and time limits."""
from __future__ import annotations

import json
import random
import re
import threading
import time
from types import SimpleNamespace

import pytest

import qerl.grading
from qerl import time_limit
from qerl.errors import QerlError
from qerl.grading import (GradingStats, extract_answer, grade, grade_completion, gold_answer, last_answer_tag,
                          last_boxed, parse_number)
from qerl.rewards import call_reward, correctness_reward, format_reward, get_reward_fn


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
    monkeypatch.setattr(qerl.grading, "_norm_str", lambda s: object())


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


# ------------------------------------------------------------------ linear extraction agrees with the old regexes
_OLD_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_OLD_THINK = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def _old_extract(text, kind, strict):
    """extract_answer as it was with the lazy tag regex (quadratic on unclosed tags): the reference semantics."""
    tags = _OLD_TAG.findall(text)
    if tags:
        boxed = last_boxed(tags[-1])
        return qerl.grading._strip_math_delims(boxed if boxed is not None else tags[-1])
    boxed = last_boxed(text)
    if boxed is not None:
        return qerl.grading._strip_math_delims(boxed)
    lines = list(qerl.grading._ANSWER_LINE.finditer(text))
    if lines:
        return qerl.grading._strip_math_delims((lines[-1].group(1) or lines[-1].group(2)).strip())
    if strict:
        return None
    if kind == "math":
        return text.strip() or None
    numbers = qerl.grading._NUMBER.findall(text)
    return numbers[-1] if numbers else None


_PIECES = ["<answer>", "</answer>", "<ANSWER>", "</Answer>", "<anſwer>", "<think>", "</think>", "<THINK>",
           "\\boxed{", "{", "}", "\\fbox{", "Answer: ", "The answer is ", "#### ", "5", "-3.5", "\\frac{1}{2}",
           "x", "$", " ", "\n", "\t", "\u3000", "\x1c", "."]
_EDGE_CASES = [
    "", "<answer>", "</answer>", "<answer></answer>", "<answer>1</answer><answer>2</answer>",
    "<answer><answer>1</answer></answer>", "<answer>1</answer>junk<answer>2", "<ANSWER>3</answer>",
    "<answer>a</answer><answer>b</answer> Answer: 9", "<answer>\\boxed{7} so 8</answer>",
    "<think>a</think><answer>4</answer>", " \n<think>a</think>\n\n<answer>4</answer>\n",
    "<think>a</think> x <answer>4</answer>", "<think></think><answer></answer>", "<think><answer>4</answer>",
    "<think>a</think><answer>4</answer></think><answer>5</answer>", "<think>a</think><answer>4</answer> extra",
    "<think></think><answer></answer>x</answer>", "<think>a</think><answer>4</answer>\n\u3000",
    "<think>a</think>\t<answer>1</answer><answer>2</answer>", "<think></answer>",
]


def _corpus():
    rng = random.Random(0)
    pieces = lambda n: "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, n)))  # noqa: E731
    shaped = [f"{pieces(2)}<think>{pieces(5)}</think>{pieces(2)}<answer>{pieces(5)}</answer>{pieces(2)}"
              for _ in range(2000)]  # near the think format, so that both answers occur often
    return _EDGE_CASES + shaped + [pieces(14) for _ in range(4000)]


def test_linear_extraction_matches_the_regex_semantics():
    for text in _corpus():
        tags = _OLD_TAG.findall(text)
        assert last_answer_tag(text) == (tags[-1] if tags else None), text
        for kind, strict in (("math", False), ("numeric", False), ("gsm8k", True)):
            assert extract_answer(text, kind, strict=strict) == _old_extract(text, kind, strict), (text, kind)
        assert format_reward([text]) == [1.0 if _OLD_THINK.match(text) else 0.0], text


def test_text_macro_spaces_are_dropped_in_linear_time():
    assert parse_number("\\text{ \t5}") == 5 and parse_number("\\text{5 }") == 5 and parse_number("\\text{ }5") == 5
    t0 = time.process_time()  # CPU time: a busy machine does not slow it, backtracking does
    assert parse_number("\\text{" + " " * 50_000 + "{") is None
    assert time.process_time() - t0 < 2.0  # \s*([^{}]*) backtracked: ~25 s


# ------------------------------------------------------------------ hostile text: linear, then bounded
MB = 1 << 20
HOSTILE = {
    "unclosed_answer_tags": "<answer>" * (MB // 8) + " junk 7",
    "nested_boxed": "\\boxed{" * (MB // 7) + "7",
    "unclosed_think_tags": "<think>" * (MB // 7) + "</think>",
    "think_answer_pairs_then_junk": "<think>" + "</think><answer></answer>" * (MB // 25) + " x",
    "answer_words": "the answer " * (MB // 11),
    "text_macro_spaces": "Answer: \\text{" + " " * MB + "{",
}


@pytest.fixture(scope="module")
def warm_grader():
    """math-verify's first call imports sympy (seconds, once per process); keep it out of the timed tests."""
    assert grade("<answer>\\frac{1}{2}</answer>", "0.5", "math")


@pytest.mark.parametrize("name", list(HOSTILE))
def test_extraction_and_format_are_linear_on_a_hostile_megabyte(name):
    text = HOSTILE[name]
    t0 = time.process_time()  # CPU time: a busy machine does not slow it, backtracking does
    for kind in ("math", "numeric"):
        extract_answer(text, kind)
    format_reward([text]), format_reward([text], style="answer_line")
    assert time.process_time() - t0 < 2.0  # ~0.05 s; the regexes took minutes on these


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_megabyte_is_graded_quickly(name, warm_grader):
    text, t0 = HOSTILE[name], time.monotonic()
    stats = GradingStats()
    rewards = (correctness_reward([text], ["7"], kind="math", stats=stats)
               + format_reward([text]) + format_reward([text], style="answer_line"))
    assert time.monotonic() - t0 < 8.0  # the 1 s limit plus linear scans (~1 s); unbounded took minutes
    assert len(rewards) == 3 and stats.graded == 1
    t0 = time.monotonic()
    correctness_reward([text], ["7"], kind="gsm8k", timeout_s=0.5)
    assert time.monotonic() - t0 < 8.0


@pytest.mark.parametrize("response,gold,kind", [
    ("<think>x</think><answer>\\frac{1}{2}</answer>", "0.5", "math"),
    ("so 18" + " pad" * 40_000 + " <answer>18</answer>", "#### 18", "gsm8k"),  # long but ordinary
])
def test_normal_answers_grade_as_before_with_nothing_counted(response, gold, kind):
    g = grade_completion(response, gold, kind)
    assert g.correct and not g.timed_out and g.extracted is not None


# ------------------------------------------------------------------ time limit around the whole grade
PATHOLOGICAL = "\\boxed{9^{9^{9^{9^{9^{9}}}}}} "
SLACK_S = 5.0  # room for a loaded 2-core CI machine (forking a worker, sympy imports); every overrun would take 30 s


def _sleep(*args, **kw):
    time.sleep(30)
    return True


def _sleepy_reward(completions, **kw):
    time.sleep(30)
    return [1.0] * len(completions)


def _echo_reward(completions, answers=None, kind=None, **kw):
    return [float(len(c)) + (kind == "numeric") for c in completions]


@pytest.fixture
def fresh_worker():
    """The worker process is forked lazily: restart it so it sees this test's monkeypatches, and after."""
    time_limit.shutdown_worker()
    yield
    time_limit.shutdown_worker()


def _in_thread(fn):
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn()))
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    return result["value"]


def _run_in(where, fn):
    """The main thread times with SIGALRM, any other thread with a worker process: test both."""
    return fn() if where == "main" else _in_thread(fn)


def _timed(fn):
    t0 = time.monotonic()
    value = fn()
    return value, time.monotonic() - t0


def test_pathological_sample_cannot_hang_main_thread(warm_grader):
    g, seconds = _timed(lambda: grade_completion(PATHOLOGICAL, "3", "math", timeout_s=0.5))
    assert not g.correct and seconds < 0.5 + SLACK_S


def test_pathological_sample_cannot_hang_worker_thread(warm_grader, fresh_worker):
    def run():
        return (grade(PATHOLOGICAL, "3", "math", timeout_s=0.5), grade("\\boxed{\\frac{1}{2}}", "0.5", "math"))

    (bad, good), seconds = _timed(lambda: _in_thread(run))
    assert bad is False and good is True
    assert seconds < 0.5 + 1.0 + 2 * SLACK_S  # second grade includes forking a fresh worker


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("patched,kind", [("_math_equal", "math"), ("extract_answer", "numeric")])
def test_over_the_limit_grades_wrong_and_counts(monkeypatch, fresh_worker, warm_grader, where, patched, kind):
    monkeypatch.setattr(qerl.grading, patched, _sleep)  # extraction too is inside the limit, not only verify
    stats = GradingStats()
    call = lambda: correctness_reward(["<answer>5</answer>", "Answer: 5"], ["5", "5"], kind=kind,  # noqa: E731
                                      timeout_s=0.3, stats=stats)
    rewards, seconds = _timed(lambda: _run_in(where, call))
    assert rewards == [0.0, 0.0] and stats.timeouts == 2 and stats.graded == 2
    assert seconds < 2 * 0.3 + 2 * SLACK_S
    g = grade_completion("<answer>5</answer>", "5", kind, timeout_s=0.3)
    assert g == qerl.grading.Grade(False, None, timed_out=True)


def test_limit_is_a_positive_number_of_seconds():
    for bad in (0, -1.0, "1", None, True):
        with pytest.raises(QerlError, match="grading_timeout_s"):
            grade("<answer>5</answer>", "5", "numeric", timeout_s=bad)
    assert grade("<answer>5</answer>", "5", "numeric", timeout_s=0.25)


def test_a_callers_alarm_survives_a_grade():
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.6)
        assert grade("<answer>5</answer>", "5", "numeric")
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.6
        time.sleep(1.0)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("where", ["main", "thread"])
def test_custom_reward_runs_under_a_per_call_limit(fresh_worker, where):
    stats = GradingStats()
    run = lambda fn: call_reward(fn, ["ab", "c"], answers=["1", "2"], kind="numeric",  # noqa: E731
                                 timeout_s=0.2, stats=stats)
    values, seconds = _timed(lambda: _run_in(where, lambda: run(_sleepy_reward)))
    assert values == [0.0, 0.0] and stats.timeouts == 2 and seconds < 2 * 0.2 + 2 * SLACK_S
    assert _run_in(where, lambda: run(_echo_reward)) == [3.0, 2.0]
    assert stats.timeouts == 2 and stats.graded == 4


def test_builtin_rewards_get_the_limit_and_the_tally(monkeypatch):
    monkeypatch.setattr(qerl.grading, "_math_equal", _sleep)
    stats = GradingStats()
    assert call_reward(get_reward_fn("correctness"), ["\\boxed{x}"], answers=["x"], kind="math",
                       timeout_s=0.2, stats=stats) == [0.0]
    assert call_reward(get_reward_fn("think_format"), ["<think></think><answer>1</answer>"], answers=["1"],
                       kind="math", timeout_s=0.2, stats=stats) == [1.0]
    assert stats.timeouts == 1


def test_trainer_logs_grading_timeouts(monkeypatch):
    from qerl.trainer import GRPOTrainer

    monkeypatch.setattr(qerl.grading, "extract_answer", _sleep)
    trainer = SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(answer_kind="numeric"), grading_timeout_s=0.2),
                              reward_fns=[("correctness", correctness_reward, 1.0), ("echo", _echo_reward, 0.5),
                                          ("sleepy", _sleepy_reward, 1.0)])
    (total, metrics), seconds = _timed(lambda: GRPOTrainer.score(trainer, ["Answer: 4", "x"], ["4", "4"]))
    assert metrics["rewards/grading_timeouts"] == 4.0  # 2 correctness samples + the sleepy call's 2
    assert total.tolist() == [0.5 * 10, 0.5 * 2] and seconds < 3 * 2 * 0.2 + 3 * SLACK_S


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


def test_grading_names_are_still_importable_from_rewards():
    import qerl.rewards

    for name in ("grade", "grade_completion", "extract_answer", "gold_answer", "parse_number", "Grade",
                 "GradingStats", "GRADING_KINDS", "DEFAULT_TIMEOUT_S", "last_answer_tag", "last_boxed"):
        assert getattr(qerl.rewards, name) is getattr(qerl.grading, name), name
