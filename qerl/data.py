"""Datasets and prompts: load question/answer records, build chat prompts, write the demo task.

    python -m qerl.data demo --out resources/demo_task   # train/test.jsonl of small subtractions, heldout.jsonl

`load_records` reads a local .jsonl/.json/.parquet file (or a directory holding `{split}.*`) or a hub dataset
through `datasets.load_dataset`, and returns plain dicts {id, question, answer} so that every later stage sees one
format whatever the source (GSM8K question/answer, MATH problem/solution|answer, AIME/AMC problem/answer).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Iterable

from qerl.errors import QerlError

log = logging.getLogger(__name__)

QUESTION_FIELDS = ("question", "problem", "prompt", "query", "input")
# "answer" before "solution": a short final answer grades faster and more reliably than a worked solution.
ANSWER_FIELDS = ("answer", "final_answer", "solution", "target", "output")
ID_FIELDS = ("id", "unique_id", "index", "idx")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")

# The paper (appendix E) appends this instruction to each problem.
QERL_THINK_SUFFIX = (
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>: <think> ...</think> <answer> ... </answer>."
)
BOXED_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
ANSWER_LINE_SUFFIX = "Give only the final answer in the form 'Answer: N'."
TEMPLATES = ("qerl_think", "boxed", "answer_line")


# ------------------------------------------------------------------------------------------ loading
# Rows travel as (location, row): the location ("file:line" for JSONL) is what every error names.
Rows = list[tuple[str, Any]]


def _json_kind(value: Any) -> str:
    """How a JSON value reads in an error: 'a list [1, 2]', 'null', 'a number 3'."""
    kinds = {type(None): "null", bool: "a boolean", list: "a list", dict: "an object", str: "a string",
             int: "a number", float: "a number"}
    kind = kinds.get(type(value), type(value).__name__)
    return kind if value is None else f"{kind} {json.dumps(value, default=str, ensure_ascii=False)[:40]}"


def _read_text(path: Path) -> str:
    """The file as UTF-8 text (a BOM allowed); bad bytes are reported with their line and offset."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise QerlError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise QerlError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                        "save the file as UTF-8") from None


def _read_jsonl(path: Path) -> Rows:
    rows = []
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other characters splitlines() breaks on.
    for lineno, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise QerlError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise QerlError(f"{path}:{lineno}: expected a JSON object per line, got {_json_kind(row)}")
        rows.append((f"{path}:{lineno}", row))
    return rows


def _read_json(path: Path) -> Rows:
    try:
        doc = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise QerlError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    rows = doc.get("data", doc.get("rows")) if isinstance(doc, dict) else doc
    if not isinstance(rows, list):
        raise QerlError(f"{path}: expected a JSON list of records (or {{'data': [...]}}), got "
                        f"{_json_kind(doc if rows is None else rows)[:60]}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise QerlError(f"{path} record {i}: expected a JSON object, got {_json_kind(row)}")
    return [(f"{path} record {i}", row) for i, row in enumerate(rows)]


def _read_parquet(path: Path) -> Rows:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError, ValueError) as exc:  # not parquet, truncated, unreadable
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QerlError(f"{path}: not a readable parquet file ({reason})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(rows)]


def _read_local_file(path: Path) -> Rows:
    """(location, row) of one local file; every problem with the file is one QerlError naming it."""
    readers = {".parquet": _read_parquet, ".json": _read_json, ".jsonl": _read_jsonl}
    return readers[path.suffix](path)


def _local_split_file(directory: Path, split: str) -> Path:
    """`{split}.jsonl|json|parquet` in a directory, or the one `{split}-*` / `data/{split}-*` parquet shard set."""
    for suffix in LOCAL_SUFFIXES:
        if (directory / f"{split}{suffix}").is_file():
            return directory / f"{split}{suffix}"
    shards = sorted(directory.glob(f"{split}-*.parquet")) + sorted(directory.glob(f"data/{split}-*.parquet"))
    if shards:
        return shards[0] if len(shards) == 1 else directory
    present = sorted(p.name for p in directory.iterdir())
    raise QerlError(f"{directory}: no data file for split {split!r} (expected {split}.jsonl, {split}.json or "
                    f"{split}.parquet); present: {', '.join(present) or 'nothing'}")


def _read_source(source: str | Path, split: str, config_name: str | None) -> tuple[Rows, str]:
    path = Path(source)
    if path.is_dir():
        target = _local_split_file(path, split)
        if target == path:  # several parquet shards
            files = sorted(path.glob(f"{split}-*.parquet")) + sorted(path.glob(f"data/{split}-*.parquet"))
            return [row for f in files for row in _read_local_file(f)], str(path)
        return _read_local_file(target), str(target)
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise QerlError(f"{path}: unsupported data file type {path.suffix!r}; expected .jsonl, .json or .parquet")
        return _read_local_file(path), str(path)
    if str(source).endswith(LOCAL_SUFFIXES) or str(source).startswith((".", "/")):
        raise QerlError(f"data file {source} does not exist")
    where = f"{source}[{split}]"
    return [(f"{where} row {i}", row) for i, row in enumerate(_read_hub(str(source), split, config_name))], where


def _read_hub(name: str, split: str, config_name: str | None) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config_name, split=split)
    except Exception as exc:  # offline, unknown name, unknown split: one line, the library's reason
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise QerlError(f"dataset {name!r} (config {config_name!r}, split {split!r}) could not be loaded: "
                        f"{reason}") from None
    return ds.to_list()


def _pick_field(rows: Rows, given: str | None, candidates: Iterable[str], role: str) -> str:
    loc, first = rows[0]
    present = ", ".join(first) or "none"
    if given is not None:
        if given not in first:
            raise QerlError(f"{loc}: {role} field {given!r} not found; fields present: {present}")
        return given
    for name in candidates:
        if name in first:
            return name
    raise QerlError(f"{loc}: no {role} field (tried {', '.join(candidates)}); fields present: {present}; "
                    f"set {role}_field")


def _question_str(value: Any, field: str, loc: str) -> str:
    from qerl.grading import control_char

    if not isinstance(value, str) or not value.strip():
        raise QerlError(f"{loc}: question field {field!r} must be a non-empty string, got {_json_kind(value)}")
    if (bad := control_char(value)) is not None:
        raise QerlError(f"{loc}: question field {field!r} holds {bad}; a prompt is text")
    return value


def _check_gold(answer: str, field: str, loc: str, kind: str) -> None:
    """The grader's refusal of a gold (qerl.grading.gold_problem), raised now with the record, not hours into a run."""
    from qerl.grading import gold_problem

    problem = gold_problem(answer, kind)
    if problem is not None:
        shown = answer if len(answer) <= 60 else f"...{answer[-50:]}"
        raise QerlError(f"{loc}: answer field {field!r} {shown!r} cannot be graded as {kind!r}: the gold {problem}")


def _answer_str(value: Any, field: str, loc: str) -> str:
    """The gold answer as text; "" (dropped by the caller) for null or blank."""
    if value is None or isinstance(value, str):
        return (value or "").strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else str(value)  # AMC stores 27.0
    raise QerlError(f"{loc}: answer field {field!r} must be a string or a number, got {_json_kind(value)}")


def _record(loc: str, row: dict, i: int, fields: tuple[str, str, str | None]) -> dict:
    q_field, a_field, id_field = fields
    for field in (q_field, a_field):
        if field not in row:
            raise QerlError(f"{loc}: no field {field!r}; fields present: {', '.join(row) or 'none'}")
    rec_id = row.get(id_field) if id_field else None
    return {"id": str(rec_id if rec_id is not None else i), "question": _question_str(row[q_field], q_field, loc),
            "answer": _answer_str(row[a_field], a_field, loc)}


def load_records(source: str | Path, *, split: str = "train", question_field: str | None = None,
                 answer_field: str | None = None, config_name: str | None = None,
                 limit: int | None = None, answer_kind: str | None = None) -> list[dict]:
    """[{id, question, answer}] from a local file/directory or a hub dataset; records with an empty answer dropped.

    Valid values: a question is a non-empty string; an answer is a string or a finite int/float (AIME/AMC store
    numbers; 27.0 becomes "27"), and a null or blank answer marks an unanswered record, dropped with a warning.
    Booleans, lists, objects and NaN/inf are rejected, since their str() is never a gold answer. Any bad file,
    line or value raises one QerlError naming the file (and line for JSONL). A question holding a control character
    (NUL...) is refused; with `answer_kind` (a grading kind) so is every gold the grader could not use
    (qerl.grading.gold_problem: "twelve" or "12\\0" where a number is due, a 5,000-digit number), so a bad record
    fails the stage at load, before any model, and not inside grading hours into a run.
    """
    rows, where = _read_source(source, split, config_name)
    if not rows:
        raise QerlError(f"{where}: no records (the file or split is empty)")
    q_field = _pick_field(rows, question_field, QUESTION_FIELDS, "question")
    a_field = _pick_field(rows, answer_field, ANSWER_FIELDS, "answer")
    id_field = next((f for f in ID_FIELDS if f in rows[0][1]), None)
    records, n_empty = [], 0
    for i, (loc, row) in enumerate(rows):
        record = _record(loc, row, i, (q_field, a_field, id_field))
        if not record["answer"]:
            n_empty += 1
            continue
        if answer_kind is not None:
            _check_gold(record["answer"], a_field, loc, answer_kind)
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    if n_empty:
        log.warning("%s: dropped %d record(s) with an empty %r", where, n_empty, a_field)
    if not records:
        raise QerlError(f"{where}: no record has a non-empty {a_field!r}")
    return records


# ------------------------------------------------------------------------------------------ prompts
def prompt_messages(question: str, template: str) -> list[dict]:
    """Chat messages for one question under a named template or a custom string containing {question}."""
    if template == "qerl_think":
        return [{"role": "user", "content": f"{question}\n{QERL_THINK_SUFFIX}"}]
    if template == "boxed":
        return [{"role": "system", "content": BOXED_SYSTEM}, {"role": "user", "content": question}]
    if template == "answer_line":
        return [{"role": "user", "content": f"{question}\n{ANSWER_LINE_SUFFIX}"}]
    if "{question}" not in template:
        raise QerlError(f"prompt template {template[:60]!r} is neither one of {', '.join(TEMPLATES)} "
                        "nor a string containing {question}")
    # str.replace, not str.format: templates may contain LaTeX braces such as \boxed{}.
    return [{"role": "user", "content": template.replace("{question}", question)}]


def build_prompt(tokenizer, question: str, template: str = "qerl_think") -> str:
    """The prompt text, rendered with the tokenizer's own chat template, ending where the assistant starts."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise QerlError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    return tokenizer.apply_chat_template(prompt_messages(question, template), tokenize=False,
                                         add_generation_prompt=True)


def encode_prompts(tokenizer, questions: list[str], template: str = "qerl_think") -> list[list[int]]:
    """Token ids per prompt. The chat template already holds the special tokens, so none are added again."""
    return [tokenizer(build_prompt(tokenizer, q, template), add_special_tokens=False)["input_ids"]
            for q in questions]


# ------------------------------------------------------------------------------------------ demo task
# a in 5..29 and 0 <= b <= a give 450 distinct pairs (a in 5..20 would give only 216 with b >= 0, 136 with
# b >= 5): enough for a 150-item test set that never appears in the 300-item train set.
DEMO_A_RANGE = (5, 29)
DEMO_N_TEST = 150
# Larger operands than any training question: does what RL taught carry over to numbers it never saw?
DEMO_HELDOUT_A_RANGE = (30, 99)
DEMO_N_HELDOUT = 100


def demo_pairs() -> list[tuple[int, int]]:
    lo, hi = DEMO_A_RANGE
    return [(a, b) for a in range(lo, hi + 1) for b in range(0, a + 1)]


def demo_heldout_pairs(seed: int = 0, n: int = DEMO_N_HELDOUT) -> list[tuple[int, int]]:
    """n distinct (a, b) with a in DEMO_HELDOUT_A_RANGE, 0 <= b <= a; drawn by their own generator so the
    train/test files stay what they were."""
    lo, hi = DEMO_HELDOUT_A_RANGE
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(0, a + 1)]
    return random.Random(f"heldout-{seed}").sample(pairs, n)


def _demo_record(split: str, i: int, a: int, b: int) -> dict:
    return {"id": f"demo-{split}-{i:04d}", "question": f"What is {a} - {b}?", "answer": str(a - b)}


def make_demo_task(out_dir: str | Path, *, seed: int = 0, n_train: int | None = None,
                   n_test: int = DEMO_N_TEST, n_heldout: int = DEMO_N_HELDOUT) -> dict[str, Path]:
    """Write train.jsonl / test.jsonl of "What is a - b?" with disjoint (a, b) pairs, and heldout.jsonl of larger
    operands (a in DEMO_HELDOUT_A_RANGE); same files for the same seed."""
    pairs = demo_pairs()
    n_train = len(pairs) - n_test if n_train is None else n_train
    if n_test < 1 or n_train < 1 or n_train + n_test > len(pairs):
        raise QerlError(f"demo task: n_train={n_train} + n_test={n_test} must be positive and at most "
                        f"{len(pairs)} (distinct pairs with a in {DEMO_A_RANGE}, 0 <= b <= a)")
    if n_heldout < 1 or n_heldout > 1000:  # 1000: far below the 4,515 larger pairs, and any eval stays quick
        raise QerlError(f"demo task: n_heldout={n_heldout} must be in 1..1000")
    random.Random(seed).shuffle(pairs)
    splits = {"test": pairs[:n_test], "train": pairs[n_test:n_test + n_train],
              "heldout": demo_heldout_pairs(seed, n_heldout)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, split_pairs in splits.items():
        paths[split] = out / f"{split}.jsonl"
        lines = [json.dumps(_demo_record(split, i, a, b)) for i, (a, b) in enumerate(split_pairs)]
        paths[split].write_text("\n".join(lines) + "\n", encoding="utf-8")
    meta = {"seed": seed, "a_range": list(DEMO_A_RANGE), "b_range": "0..a", "n_train": n_train, "n_test": n_test,
            "heldout_a_range": list(DEMO_HELDOUT_A_RANGE), "n_heldout": n_heldout}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl.data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="write the demo subtraction task")
    demo.add_argument("--out", required=True, help="output directory (train.jsonl, test.jsonl, meta.json)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--n-train", type=int, default=None)
    demo.add_argument("--n-test", type=int, default=DEMO_N_TEST)
    demo.add_argument("--n-heldout", type=int, default=DEMO_N_HELDOUT)
    args = parser.parse_args(argv)
    try:
        paths = make_demo_task(args.out, seed=args.seed, n_train=args.n_train, n_test=args.n_test,
                               n_heldout=args.n_heldout)
    except QerlError as exc:
        print(f"error: {exc}")
        return 2
    print(" ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
