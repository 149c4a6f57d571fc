"""TRL-style reward functions (completions in, one float each out) on top of qerl.grading, and their registry.

    from qerl.rewards import correctness_reward, get_reward_fn, call_reward
    correctness_reward(["... Answer: 18"], ["18"], kind="numeric")          # [1.0]
    call_reward(get_reward_fn("my_pkg.rewards:brevity"), completions, timeout_s=1.0)

Builtins: correctness (qerl.grading under its per-completion limit), format (the paper's <think>/<answer> shape, or
the demo's "Answer: N" line), and *_format_if_correct (the same, paid only on a correct answer: no constant answer
can farm it). Reward functions that are not qerl's own (an import path from get_reward_fn) run under
one limit per call, timeout_s per completion (call_reward). Grading's public names (grade, grade_completion,
extract_answer, Grade, GradingStats, ...) are importable from here too.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from typing import Any, Callable

from qerl.errors import QerlError
from qerl.grading import (DEFAULT_TIMEOUT_S, GRADING_KINDS, Grade, GradingStats, check_timeout,  # noqa: F401
                          extract_answer, gold_answer, grade, grade_completion, last_answer_tag, last_boxed,
                          parse_number)
from qerl.time_limit import call_with_limit

log = logging.getLogger(__name__)


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
                       strict: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                       stats: GradingStats | None = None, **kw) -> list[float]:
    """1.0 for a correct final answer, else 0.0 (also when grading one completion takes over timeout_s seconds;
    `stats` counts those). `answers` may also arrive as TRL's dataset column `answer`."""
    if answers is None:
        answers = kw.get("answer")
    if answers is None or len(answers) != len(completions):
        raise QerlError(f"correctness_reward: answers has {None if answers is None else len(answers)} items, "
                        f"expected one per completion ({len(completions)})")
    grades = [grade_completion(completion_text(c), a, kind, strict=strict, timeout_s=timeout_s)
              for c, a in zip(completions, answers)]
    if stats is not None:
        for g in grades:
            stats.add(g.timed_out)
    return [float(g.correct) for g in grades]


# The anchored regex ^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$ backtracks quadratically on many tags;
# this finds the same thing with one search: the first </think> that whitespace joins to an <answer>.
_THINK_THEN_ANSWER = re.compile(r"</think>\s*<answer>")
_ANSWER_LINE_FORMAT = re.compile(r"^[ \t]*Answer:[ \t]*[-+]?\d[\d,]*(?:\.\d+)?[ \t]*$", re.MULTILINE)


def _is_think_format(text: str) -> bool:
    """<think>...</think> <answer>...</answer> with only whitespace around (str.strip and \\s agree)."""
    body = text.strip()
    if not (body.startswith("<think>") and body.endswith("</answer>")):
        return False
    joint = _THINK_THEN_ANSWER.search(body, len("<think>"))
    return joint is not None and joint.end() <= len(body) - len("</answer>")


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
        return [1.0 if _is_think_format(t) else 0.0 for t in texts]
    if style == "answer_line":
        return [_answer_line_score(t, trailing_penalty) for t in texts]
    raise QerlError(f"format_reward style {style!r} is unknown; expected 'think' or 'answer_line'")


def format_if_correct_reward(completions: list, answers: list | None = None, kind: str = "math", *,
                             style: str = "think", trailing_penalty: float = 0.5,
                             timeout_s: float = DEFAULT_TIMEOUT_S, stats: GradingStats | None = None,
                             **kw) -> list[float]:
    """format_reward, paid only on a correct answer (0.0 on a wrong one, its trailing penalty included).

    The plain format reward pays a well-formed wrong answer: a policy that writes the same well-formed answer to
    every prompt (the demo's "Answer: a", the first operand) earns the bonus on every item, and its groups, all
    equal, then give no gradient out of it. Gated per completion on correctness, not per group: any answer that is
    wrong earns nothing, so in a group without a correct answer the format term is 0 for all and never the only
    advantage signal, and it stays a per-completion reward like every other (groups are the trainer's layout).
    """
    correct = correctness_reward(completions, answers, kind, timeout_s=timeout_s, stats=stats, **kw)
    shape = format_reward(completions, style, trailing_penalty=trailing_penalty)
    return [s if c else 0.0 for s, c in zip(shape, correct)]


BUILTIN_REWARDS: dict[str, Callable[..., list[float]]] = {
    "correctness": correctness_reward,
    "format": format_reward,
    "think_format": functools.partial(format_reward, style="think"),
    "answer_line_format": functools.partial(format_reward, style="answer_line"),
    "think_format_if_correct": functools.partial(format_if_correct_reward, style="think"),
    "answer_line_format_if_correct": functools.partial(format_if_correct_reward, style="answer_line"),
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
    check_reward_signature(fn, spec)
    return fn


def check_reward_signature(fn: Callable, spec: str) -> None:
    """Refuse, at startup, a reward function that cannot take the trainer's call: the completions positionally and
    the keywords answers= and kind= (qerl.trainer through call_reward), instead of a TypeError at the first step."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have no signature: their first call will tell
        return
    try:
        sig.bind(["completion"], answers=["gold"], kind="math")
    except TypeError as exc:
        raise QerlError(f"reward function {spec!r}: {getattr(fn, '__name__', 'fn')}{sig} cannot be called as "
                        f"fn(completions, answers=..., kind=...) ({exc}); accept **kwargs, e.g. "
                        f"def {getattr(fn, '__name__', 'fn')}(completions, **kwargs)") from None


def call_reward(fn: Callable[..., list[float]], completions: list, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                stats: GradingStats | None = None, **kw) -> list[float]:
    """Call a reward function under the grading limit; `stats` counts the completions that hit it.

    qerl's own rewards bound themselves (correctness per completion, format by linear scans). Any other function
    (an import path from get_reward_fn, a callable given to the trainer) runs under one limit for the whole call,
    timeout_s per completion; past it, every completion of that call gets 0.0 and counts as timed out.
    """
    if getattr(fn, "func", fn) in _SELF_LIMITED:
        return fn(completions, timeout_s=timeout_s, stats=stats, **kw)
    n = len(completions)
    seconds = check_timeout(timeout_s) * max(1, n)
    finished, values = call_with_limit(fn, (completions,), kw, seconds=seconds)
    if stats is not None:
        stats.add(not finished, n)
    if not finished:
        log.warning("reward %s took over %.3gs for %d completions: all get 0.0",
                    getattr(fn, "__qualname__", fn), seconds, n)
        return [0.0] * n
    return values


_SELF_LIMITED = (correctness_reward, format_reward, format_if_correct_reward)
