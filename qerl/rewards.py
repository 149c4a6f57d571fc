"""Answer extraction, grading and TRL-style reward functions.

    from qerl.rewards import grade, correctness_reward, get_reward_fn
    grade("<think>...</think><answer>18</answer>", "Janet ... #### 18", "gsm8k")   # True

Grading kinds (gold formats of the real sets, see ../shared/data/README.md):
  gsm8k    gold is a worked solution ending in "#### N"; exact numeric match
  aime     gold "025" == 25 (zero-padded integer string)
  amc      gold 27.0 == 27 (JSON float)
  numeric  gold is a plain number ("8", "-3.5", "1,000")
  math     gold is LaTeX ("\\frac{14}{3}", or a full solution with \\boxed{}): math-verify parse + verify

The model's answer is taken, in this order, from the last <answer>...</answer>, the last \\boxed{...},
the last "Answer: X" / "answer is X" / "#### X", and (unless strict) the last number (numeric kinds) or the
whole response (math kind, math-verify then picks the last expression).

Time limit: math-verify bounds each parse and each comparison with SIGALRM (`timeout_s`, whole seconds), so one
grade costs at most ~3 * timeout_s (gold parse, prediction parse, verify). SIGALRM only works in the main
thread: off the main thread (e.g. a thread pool in a trainer) math grading runs in a spawned worker process
that is killed after 3 * timeout_s, so a pathological expression (9^9^9^9...) can never hang the caller.
Numeric kinds use exact rational arithmetic on short strings and need no time limit.
"""
from __future__ import annotations

import functools
import importlib
import logging
import re
import threading
from fractions import Fraction
from typing import Any, Callable

from qerl.errors import QerlError

log = logging.getLogger(__name__)

GRADING_KINDS = ("gsm8k", "math", "aime", "amc", "numeric")
DEFAULT_TIMEOUT_S = 5
_MAX_ANSWER_CHARS = 2000  # an "answer" longer than this is not an answer; keeps parsing bounded

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)\s*(?:is|:)\s*(.+)|####\s*(.+)", re.IGNORECASE
)
_NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+−]?\.\d+")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


def _check_kind(kind: str) -> None:
    if kind not in GRADING_KINDS:
        raise QerlError(f"grading kind {kind!r} is unknown; expected one of {', '.join(GRADING_KINDS)}")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} with balanced braces (regexes cannot balance braces)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed"):].strip()  # "\boxed 5" form
        return rest.split()[0].rstrip("$.") if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def _strip_math_delims(s: str) -> str:
    s = s.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()
    return s.rstrip(".").strip()


def extract_answer(text: str, kind: str = "math", *, strict: bool = False) -> str | None:
    """The model's final answer as a string, or None. See the module docstring for the order of precedence."""
    _check_kind(kind)
    if not isinstance(text, str):
        return None
    tags = _ANSWER_TAG.findall(text)
    if tags:
        inner = tags[-1]
        boxed = last_boxed(inner)
        return _strip_math_delims(boxed if boxed is not None else inner)
    boxed = last_boxed(text)
    if boxed is not None:
        return _strip_math_delims(boxed)
    lines = [m for m in _ANSWER_LINE.finditer(text)]
    if lines:
        m = lines[-1]
        return _strip_math_delims((m.group(1) or m.group(2)).strip())
    if strict:
        return None
    if kind == "math":
        return text.strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(s: Any) -> Fraction | None:
    """Exact value of a plain number string ("1,234", "$18.00", "-3/4", "\\frac{1}{2}", "25%"), else None."""
    if isinstance(s, bool) or s is None:
        return None
    if isinstance(s, (int, float)):
        return Fraction(str(s))
    s = str(s).strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "{,}"):
        s = s.replace(junk, "")
    s = s.replace("−", "-").replace(" ", "").rstrip(".")
    m = _FRAC.match(s)
    if m:
        den = int(m.group(3))
        return None if den == 0 else (-1 if m.group(1) else 1) * Fraction(int(m.group(2)), den)
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s) if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?", s) else None
    except (ValueError, ZeroDivisionError):
        return None


def _numeric_value(answer: str) -> Fraction | None:
    """A number from an extracted answer: the whole string if it is one, else its last number ("18 dollars")."""
    value = parse_number(answer)
    if value is not None:
        return value
    cleaned = re.sub(r"\\text\{[^{}]*\}", " ", answer)
    numbers = _NUMBER.findall(cleaned)
    return parse_number(numbers[-1]) if numbers else None


def gold_answer(gold: Any, kind: str) -> str:
    """The comparable part of a gold answer: after "####" (gsm8k), the \\boxed{} of a solution (math), else as is."""
    _check_kind(kind)
    text = str(gold).strip() if gold is not None else ""
    if kind == "gsm8k" and "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    elif kind == "math" and "\\boxed" in text:
        text = last_boxed(text) or text
    return _strip_math_delims(text)


def _gold_number(gold: Any, kind: str) -> Fraction:
    value = parse_number(gold) if isinstance(gold, (int, float)) else parse_number(gold_answer(gold, kind))
    if value is None:
        raise QerlError(f"gold answer {str(gold)[-80:]!r} is not a number (grading kind {kind!r})")
    return value


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=4096)
def _parse_gold_latex(gold: str, timeout_s: int):
    from math_verify import parse

    parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
    return parsed or parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_s)


def _norm_str(s: str) -> str:
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|\s)", "", s)
    s = re.sub(r"\\text(bf|rm)?\{([^{}]*)\}", r"\2", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).strip("$.").lower()


def _clean_latex(s: str) -> str:
    """Drop currency "\\$" (it reads as a math delimiter to the parser) and thin spaces inside numbers."""
    return s.replace("\\$", "").replace("\\!", "").replace("{,}", ",").strip()


def _math_equal(pred: str, gold: str, timeout_s: int) -> bool:
    """math-verify equivalence of two LaTeX answers (each already extracted), with a string fallback."""
    from math_verify import parse, verify

    if _norm_str(pred) == _norm_str(gold) and _norm_str(gold):
        return True
    pred, gold = _clean_latex(pred), _clean_latex(gold)
    gold_parsed = _parse_gold_latex(gold, timeout_s)
    if not gold_parsed:
        return False
    text = pred if ("$" in pred or "\\(" in pred or "\\boxed" in pred) else f"${pred}$"
    pred_parsed = parse(text, parsing_timeout=timeout_s)
    if not pred_parsed and text != pred:
        pred_parsed = parse(pred, parsing_timeout=timeout_s)
    return bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


_POOL = None


def _math_equal_isolated(pred: str, gold: str, timeout_s: int) -> bool:
    """Off the main thread SIGALRM is unavailable: run in a worker process and kill it if it overruns.

    The worker is forked (it needs nothing but math-verify, imported here first, and no re-import of __main__);
    if a fork ever inherits a held lock, the worker stalls, the timeout fires and the sample is graded wrong.
    """
    import multiprocessing
    import os

    import math_verify  # noqa: F401  (imported before the fork so the worker has it)

    global _POOL
    if _POOL is None:
        method = "fork" if os.name == "posix" else "spawn"
        _POOL = multiprocessing.get_context(method).Pool(1)
    job = _POOL.apply_async(_math_equal, (pred, gold, timeout_s))
    limit = 3 * (timeout_s or DEFAULT_TIMEOUT_S) + 2
    try:
        return bool(job.get(timeout=limit))
    except multiprocessing.TimeoutError:
        log.warning("math grading of %r took over %ss: graded wrong", pred[:60], limit)
        _POOL.terminate()
        _POOL = None
        return False


def grade(response: str, gold: Any, kind: str = "math", *, strict: bool = False,
          timeout_s: int = DEFAULT_TIMEOUT_S) -> bool:
    """True when the model's final answer in `response` equals `gold` under the rules of `kind`."""
    _check_kind(kind)
    pred = extract_answer(response, kind, strict=strict)
    if pred is None or len(pred) > _MAX_ANSWER_CHARS and kind != "math":
        return False
    if kind == "math":
        if len(pred) > _MAX_ANSWER_CHARS:  # whole-response fallback: keep only the tail math-verify looks at
            pred = pred[-_MAX_ANSWER_CHARS:]
        gold_str = gold_answer(gold, kind)
        if _in_main_thread():
            return _math_equal(pred, gold_str, timeout_s)
        return _math_equal_isolated(pred, gold_str, timeout_s)
    target = _gold_number(gold, kind)
    value = _numeric_value(pred)
    if value is not None:
        return value == target
    if "\\" in pred:  # LaTeX such as \frac{50}{2} or \sqrt{625}: let math-verify decide
        return _math_equal(pred, str(target), timeout_s) if _in_main_thread() else \
            _math_equal_isolated(pred, str(target), timeout_s)
    return False


# ----------------------------------------------------------------------------------------------- rewards
def completion_text(completion: Any) -> str:
    """TRL passes either strings or conversations ([{"role": "assistant", "content": ...}]): return the text."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion)
    return "" if completion is None else str(completion)


def correctness_reward(completions: list, answers: list | None = None, kind: str = "math", *,
                       strict: bool = False, timeout_s: int = DEFAULT_TIMEOUT_S, **kw) -> list[float]:
    """1.0 for a correct final answer, else 0.0. `answers` may also arrive as TRL's dataset column `answer`."""
    if answers is None:
        answers = kw.get("answer")
    if answers is None or len(answers) != len(completions):
        raise QerlError(f"correctness_reward: answers has {None if answers is None else len(answers)} items, "
                        f"expected one per completion ({len(completions)})")
    return [float(grade(completion_text(c), a, kind, strict=strict, timeout_s=timeout_s))
            for c, a in zip(completions, answers)]


_THINK_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)
_ANSWER_LINE_FORMAT = re.compile(r"^[ \t]*Answer:[ \t]*[-+]?\d[\d,]*(?:\.\d+)?[ \t]*$", re.MULTILINE)


def _answer_line_score(text: str, trailing_penalty: float) -> float:
    matches = list(_ANSWER_LINE_FORMAT.finditer(text))
    if not matches:
        return 0.0
    trailing = text[matches[0].end():]
    return 1.0 if not trailing.strip() else -trailing_penalty


def format_reward(completions: list, style: str = "think", *, trailing_penalty: float = 0.5,
                  **kw) -> list[float]:
    """Format reward.

    style="think": 1.0 when the completion is exactly <think>...</think> <answer>...</answer> (the paper's format).
    style="answer_line" (demo task): 1.0 when a line "Answer: N" ends the completion, 0.0 when there is none, and
    -trailing_penalty when text follows the first answer line: the cheapest way to lengthen a completion is to
    keep talking after the answer, and this makes that strictly worse than stopping.
    """
    texts = [completion_text(c) for c in completions]
    if style == "think":
        return [1.0 if _THINK_FORMAT.match(t) else 0.0 for t in texts]
    if style == "answer_line":
        return [_answer_line_score(t, trailing_penalty) for t in texts]
    raise QerlError(f"format_reward style {style!r} is unknown; expected 'think' or 'answer_line'")


BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "think_format": functools.partial(format_reward, style="think"),
    "answer_line_format": functools.partial(format_reward, style="answer_line"),
}


def get_reward_fn(spec: str) -> Callable[..., list[float]]:
    """A builtin reward name (see BUILTIN_REWARDS) or an import path "pkg.mod:fn" / "pkg.mod.fn"."""
    if not isinstance(spec, str) or not spec:
        raise QerlError(f"reward function spec {spec!r} must be a non-empty string")
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module_name or not attr:
        raise QerlError(f"reward function {spec!r} is neither a builtin ({', '.join(BUILTIN_REWARDS)}) "
                        "nor an import path 'pkg.mod:fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise QerlError(f"reward function {spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise QerlError(f"reward function {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn
