"""Answer extraction and grading: is the model's final answer the gold one, in bounded time on any text.

    from qerl.grading import grade, grade_completion
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

Time limit: the whole grade of one completion (extraction, math-verify parse of both sides, verify) runs under one
wall-time limit, `timeout_s` seconds (a float, default 1.0; the trainer and evaluation read it from
`train.grading_timeout_s` / `eval.grading_timeout_s`). Past it the sample grades wrong and counts as a timeout:
`grade_completion` returns a Grade with timed_out=True (qerl.rewards' correctness_reward and call_reward add it to
a GradingStats). The limit is SIGALRM in the main thread and a killable worker process elsewhere (qerl.time_limit).
Extraction itself is linear in the text (str.find scans and regexes that cannot backtrack across the text), and
only the last _MAX_EXAMINED_CHARS of a completion are examined, so a hostile megabyte cannot even reach the limit.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import re
from fractions import Fraction
from typing import Any

from qerl.errors import QerlError
from qerl.time_limit import call_with_limit, shutdown_worker

log = logging.getLogger(__name__)

GRADING_KINDS = ("gsm8k", "math", "aime", "amc", "numeric")
DEFAULT_TIMEOUT_S = 1.0
_MAX_ANSWER_CHARS = 2000  # an "answer" longer than this is not an answer; keeps parsing bounded
# Answers sit at the end: 256K characters is about twice a 32k-token completion, so every real completion is
# examined whole and only a runaway or hostile one loses its head (which holds no final answer).
_MAX_EXAMINED_CHARS = 256 * 1024

# One tag at a time (a lazy <answer>(.*?)</answer> rescans to the end for every unclosed tag: quadratic).
_OPEN_TAG = re.compile("<answer>", re.IGNORECASE)
_CLOSE_TAG = re.compile("</answer>", re.IGNORECASE)
_ANSWER_LINE = re.compile(
    r"(?:final answer|answer)\s*(?:is|:)\s*(.+)|####\s*(.+)", re.IGNORECASE
)
_NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+−]?\.\d+")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")


def _check_kind(kind: str) -> None:
    if kind not in GRADING_KINDS:
        raise QerlError(f"grading kind {kind!r} is unknown; expected one of {', '.join(GRADING_KINDS)}")


def last_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>: each opening tag pairs with the next closing tag, as in a lazy
    regex's findall, in one left-to-right pass."""
    inner, pos = None, 0
    while (opening := _OPEN_TAG.search(text, pos)) is not None:
        closing = _CLOSE_TAG.search(text, opening.end())
        if closing is None:  # no later opening tag can close either
            break
        inner, pos = text[opening.end():closing.start()], closing.end()
    return inner


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
    inner = last_answer_tag(text)
    if inner is not None:
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
    s = re.sub(r"\\text\{([^{}]*)\}", lambda m: m.group(1).lstrip(), s)  # \s*([^{}]*) would backtrack
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
    """The comparable part of a gold answer: after "####" (gsm8k), the last \\boxed{} (a solution's), else as is."""
    _check_kind(kind)
    text = str(gold).strip() if gold is not None else ""
    if kind == "gsm8k" and "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    if "\\boxed" in text:  # a solution's (math) or a bare \boxed{12} gold of any kind
        text = last_boxed(text) or text
    return _strip_math_delims(text)


# Real golds hold at most 10 digits in a row (../shared/data); int() refuses past 4,300 and sympy slows long before.
MAX_GOLD_DIGITS = 1000
_CONTROL_CHAR = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def control_char(text: str) -> str | None:
    """'the control character '\\x00' at offset 2' for the first C0/DEL character of text (tabs and newlines
    allowed), else None."""
    m = _CONTROL_CHAR.search(text)
    return None if m is None else f"the control character {m.group()!r} at offset {m.start()}"


def gold_problem(gold: Any, kind: str) -> str | None:
    """Why the grader cannot use `gold` under `kind` (a phrase completing "the gold answer ..."), or None when it
    can. Numeric kinds need a number (fractions, decimals, signs, \\frac, "1,000", "$18" included); the math kind
    takes any LaTeX or text. Both refuse control characters, answers over _MAX_ANSWER_CHARS and numbers of more
    than MAX_GOLD_DIGITS digits."""
    _check_kind(kind)
    text = str(gold) if gold is not None else ""
    if (bad := control_char(text)) is not None:
        return f"holds {bad}"
    answer = gold_answer(gold, kind)
    if not answer:
        return "is empty" + (" after its '####'" if kind == "gsm8k" else "")
    digits = max(map(len, re.findall(r"\d+", answer.replace("{,}", "").replace(",", ""))), default=0)
    if digits > MAX_GOLD_DIGITS:
        return f"holds a {digits}-digit number (at most {MAX_GOLD_DIGITS} digits)"
    if len(answer) > _MAX_ANSWER_CHARS:
        return f"is {len(answer)} characters long (at most {_MAX_ANSWER_CHARS})"
    if kind != "math" and parse_number(gold if isinstance(gold, (int, float)) else answer) is None:
        return "is not a number" + (" after its '####'" if kind == "gsm8k" and "####" in text else
                                    " (gsm8k golds end in '#### N')" if kind == "gsm8k" else "")
    return None


def _gold_number(gold: Any, kind: str) -> Fraction:
    value = parse_number(gold) if isinstance(gold, (int, float)) else parse_number(gold_answer(gold, kind))
    if value is None:
        raise QerlError(f"gold answer {str(gold)[-80:]!r} is not a number (grading kind {kind!r})")
    return value


@functools.lru_cache(maxsize=4096)
def _parse_gold_latex(gold: str):
    from math_verify import parse

    parsed = parse(f"${gold}$", parsing_timeout=None)
    return parsed or parse(f"\\boxed{{{gold}}}", parsing_timeout=None)


def _norm_str(s: str) -> str:
    s = re.sub(r"\\(left|right|displaystyle|!|,|;|\s)", "", s)
    s = re.sub(r"\\text(bf|rm)?\{([^{}]*)\}", r"\2", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return re.sub(r"\s+", "", s).strip("$.").lower()


def _clean_latex(s: str) -> str:
    """Drop currency "\\$" (it reads as a math delimiter to the parser) and thin spaces inside numbers."""
    return s.replace("\\$", "").replace("\\!", "").replace("{,}", ",").strip()


@functools.cache
def _warm_up_math_verify() -> None:
    """Import math-verify and run it once outside any limit: its first call imports sympy and the LaTeX grammar,
    which would otherwise eat the first sample's time. Its own SIGALRM timeouts stay off (parsing_timeout=None):
    they would cancel the per-sample timer, which bounds the whole grade instead."""
    import math_verify.grader
    import math_verify.parser

    math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True  # we time it
    math_verify.verify(_parse_gold_latex("1"), math_verify.parse("$1$", parsing_timeout=None), timeout_seconds=None)
    shutdown_worker()  # a worker forked before this would import sympy inside its first limit


def _math_equal(pred: str, gold: str) -> bool:
    """math-verify equivalence of two LaTeX answers (each already extracted), with a string fallback."""
    from math_verify import parse, verify

    if _norm_str(pred) == _norm_str(gold) and _norm_str(gold):
        return True
    pred, gold = _clean_latex(pred), _clean_latex(gold)
    gold_parsed = _parse_gold_latex(gold)
    if not gold_parsed:
        return False
    text = pred if ("$" in pred or "\\(" in pred or "\\boxed" in pred) else f"${pred}$"
    pred_parsed = parse(text, parsing_timeout=None)
    if not pred_parsed and text != pred:
        pred_parsed = parse(pred, parsing_timeout=None)
    return bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


# ----------------------------------------------------------------------------------------------- grading
@dataclasses.dataclass(frozen=True)
class Grade:
    """One graded completion: correct, the extracted answer (None if none or timed out), and whether the limit hit."""
    correct: bool
    extracted: str | None
    timed_out: bool = False


@dataclasses.dataclass
class GradingStats:
    """Tally of a batch's grades, filled by correctness_reward / call_reward when passed as `stats`."""
    graded: int = 0
    timeouts: int = 0

    def add(self, timed_out: bool, n: int = 1) -> None:
        self.graded += n
        self.timeouts += n if timed_out else 0


def _grade_unlimited(response: str, gold: Any, kind: str, strict: bool) -> tuple[bool, str | None]:
    """(correct, extracted answer) with no time limit: call through grade_completion."""
    pred = extract_answer(response, kind, strict=strict)
    if pred is None or len(pred) > _MAX_ANSWER_CHARS and kind != "math":
        return False, pred
    if kind == "math":
        # whole-response fallback: keep only the tail math-verify looks at
        return _math_equal(pred[-_MAX_ANSWER_CHARS:], gold_answer(gold, kind)), pred
    target = _gold_number(gold, kind)
    value = _numeric_value(pred)
    if value is not None:
        return value == target, pred
    # LaTeX such as \frac{50}{2} or \sqrt{625}: let math-verify decide
    return ("\\" in pred and _math_equal(pred, str(target))), pred


def check_timeout(timeout_s: Any) -> float:
    """A grading limit as float seconds; one line naming grading_timeout_s when it is not a positive number."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise QerlError(f"grading_timeout_s must be a positive number of seconds; got {timeout_s!r}")
    return float(timeout_s)


def grade_completion(response: str, gold: Any, kind: str = "math", *, strict: bool = False,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> Grade:
    """Grade one completion within `timeout_s` seconds of wall time; past it, a wrong Grade with timed_out=True."""
    _check_kind(kind)
    seconds = check_timeout(timeout_s)
    if not isinstance(response, str):
        return Grade(False, None)
    text = response[-_MAX_EXAMINED_CHARS:]
    if kind != "math":
        _gold_number(gold, kind)  # a bad gold is the user's mistake: raise it here, not as a timeout
    if kind == "math" or "\\" in text:
        _warm_up_math_verify()
    finished, result = call_with_limit(_grade_unlimited, (text, gold, kind, strict), seconds=seconds)
    if not finished:
        log.warning("grading took over %.3gs: graded wrong (completion ends %r)", seconds, text[-60:])
        return Grade(False, None, timed_out=True)
    return Grade(*result)


def grade(response: str, gold: Any, kind: str = "math", *, strict: bool = False,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """True when the model's final answer in `response` equals `gold` under the rules of `kind` (see
    grade_completion for the time limit)."""
    return grade_completion(response, gold, kind, strict=strict, timeout_s=timeout_s).correct
