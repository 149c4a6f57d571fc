"""Record loading (real files, field detection, errors), chat prompts, the demo task, benchmark resolution."""
from __future__ import annotations

import json
import re

import pytest

from qerl import benchmarks, data
from qerl.errors import QerlError
from qerl.rewards import grade


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("rel,split,n,answer0", [
    ("gsm8k", "test", 1319, None),
    ("math500/test.jsonl", "test", 500, "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("aime24", "test", 30, "204"),
    ("amc23", "test", 40, "27"),
    ("math_train", "train", 7498, "0"),  # 7500 minus the 2 empty answers
])
def test_load_real_sets_autodetects_fields(data_dir, rel, split, n, answer0):
    recs = data.load_records(data_dir / rel, split=split)
    assert len(recs) == n
    assert set(recs[0]) == {"id", "question", "answer"}
    raw = json.loads((data_dir / (rel if rel.endswith(".jsonl") else f"{rel}/{split}.jsonl")).open().readline())
    assert recs[0]["question"] == raw.get("question", raw.get("problem"))
    if answer0 is not None:
        assert recs[0]["answer"] == answer0
    else:
        assert recs[0]["answer"].endswith("#### 18")


def test_limit_and_explicit_fields(data_dir):
    recs = data.load_records(data_dir / "math500", split="test", answer_field="solution", limit=3)
    assert len(recs) == 3 and "\\boxed" in recs[0]["answer"]
    assert recs[0]["id"] == "test/precalculus/807.json"


def test_parquet_and_json_sources_match_jsonl(tmp_path, data_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (data_dir / "aime24/test.jsonl").read_text().splitlines()[:5]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    (tmp_path / "x.json").write_text(json.dumps(rows))
    expected = data.load_records(data_dir / "aime24/test.jsonl", limit=5)
    assert data.load_records(tmp_path, split="test") == expected
    assert data.load_records(tmp_path / "x.json") == expected


def test_missing_answer_field_is_one_line_naming_file_and_fields(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "q", "label": 3}) + "\n")
    with pytest.raises(QerlError) as exc:
        data.load_records(path)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and "answer" in msg and "question, label" in msg
    with pytest.raises(QerlError, match="answer field 'gold' not found"):
        data.load_records(path, answer_field="gold")


def _jsonl(*rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


GOOD = {"question": "q", "answer": "1"}
# (file name, bytes, expected message after the path): each a hostile file a user may hand to load_records.
HOSTILE = {
    "non_utf8_jsonl": ("t.jsonl", _jsonl(GOOD) + b'{"question": "caf\xe9", "answer": "2"}\n', r":2: not UTF-8"),
    "non_utf8_json": ("t.json", b'[{"question": "\xff", "answer": "1"}]', r":1: not UTF-8"),
    "array_line": ("t.jsonl", _jsonl(GOOD, "[1, 2]"), r":2: expected a JSON object per line, got a list \[1, 2\]"),
    "number_line": ("t.jsonl", _jsonl("42"), r":1: expected a JSON object per line, got a number 42"),
    "string_line": ("t.jsonl", _jsonl('"hi"'), r":1: expected a JSON object per line, got a string"),
    "invalid_jsonl": ("t.jsonl", _jsonl(GOOD, "{oops"), r":2: not valid JSON"),
    "invalid_json": ("t.json", b'[{"question": "q",', r": not valid JSON"),
    "json_not_a_list": ("t.json", b'{"x": 1}', r": expected a JSON list of records"),
    "json_list_of_numbers": ("t.json", b"[1, 2]", r" record 0: expected a JSON object, got a number 1"),
    "empty_jsonl": ("t.jsonl", b"", r": no records"),
    "blank_lines_only": ("t.jsonl", b"\n \n\n", r": no records"),
    "empty_json_list": ("t.json", b"[]", r": no records"),
    "no_answer_field": ("t.jsonl", _jsonl({"question": "q", "label": 3}),
                        r":1: no answer field .*fields present: question, label"),
    "later_record_lacks_answer": ("t.jsonl", _jsonl(GOOD, {"question": "q2"}),
                                  r":2: no field 'answer'; fields present: question"),
    "question_number": ("t.jsonl", _jsonl(GOOD, {"question": 5, "answer": "1"}),
                        r":2: question field 'question' must be a non-empty string, got a number 5"),
    "question_null": ("t.jsonl", _jsonl({"question": None, "answer": "1"}), r":1: question .* got null"),
    "question_blank": ("t.jsonl", _jsonl({"question": " ", "answer": "1"}), r":1: question .* got a string"),
    "question_list": ("t.jsonl", _jsonl({"problem": ["a"], "answer": "1"}), r":1: question field 'problem'"),
    "answer_list": ("t.jsonl", _jsonl({"question": "q", "answer": [1, 2]}),
                    r":1: answer field 'answer' must be a string or a number, got a list \[1, 2\]"),
    "answer_object": ("t.jsonl", _jsonl({"question": "q", "answer": {"v": 1}}), r":1: answer .* got an object"),
    "answer_bool": ("t.jsonl", _jsonl({"question": "q", "answer": True}), r":1: answer .* got a boolean true"),
    "answer_nan": ("t.jsonl", _jsonl('{"question": "q", "answer": NaN}'), r":1: answer .* got a number NaN"),
    "all_answers_empty": ("t.jsonl", _jsonl({"question": "q", "answer": None}, {"question": "q", "answer": ""}),
                          r": no record has a non-empty 'answer'"),
    "not_parquet": ("t.parquet", b"PAR1 this is not parquet", r": not a readable parquet file"),
    "csv_file": ("t.csv", b"question,answer\nq,1\n", r": unsupported data file type '.csv'"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_file_is_one_line_naming_the_file(tmp_path, case):
    name, content, expected = HOSTILE[case]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(QerlError) as exc:
        data.load_records(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    assert re.search(expected, msg[len(str(path)):]), msg


def test_parquet_with_a_list_answer_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([GOOD, {"question": "q2", "answer": None}]), tmp_path / "ok.parquet")
    assert [r["answer"] for r in data.load_records(tmp_path / "ok.parquet")] == ["1"]  # null: unanswered
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": ["1", "2"]}]), tmp_path / "bad.parquet")
    with pytest.raises(QerlError, match=r"bad.parquet row 0: answer field 'answer' .* got a list"):
        data.load_records(tmp_path / "bad.parquet")


def test_hub_rows_are_checked_like_files(monkeypatch):
    import datasets

    rows = [{"problem": "q", "answer": {"value": 7}}, {"problem": "q", "answer": {"value": 8}}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(rows))
    with pytest.raises(QerlError, match=r"^org/set\[test\] row 0: answer field 'answer' .* got an object"):
        data.load_records("org/set", split="test")


@pytest.mark.parametrize("files,expected", [
    ((), r"no data file for split 'train' .*present: nothing"),
    (("README.md", "test.jsonl"), r"no data file for split 'train' .*present: README.md, test.jsonl"),
])
def test_directory_without_data_file(tmp_path, files, expected):
    for name in files:
        (tmp_path / name).write_text("{}")
    with pytest.raises(QerlError, match=expected) as exc:
        data.load_records(tmp_path)
    assert str(exc.value).startswith(str(tmp_path)) and "\n" not in str(exc.value)
    with pytest.raises(QerlError, match="does not exist"):
        data.load_records(tmp_path / "nope.jsonl")


def test_numeric_answers_are_gold_answers_and_null_answers_are_dropped(tmp_path, caplog):
    path = tmp_path / "t.jsonl"
    path.write_bytes(_jsonl({"question": "a", "answer": 204}, {"question": "b", "answer": 27.0},
                            {"question": "c", "answer": 0.5}, {"question": "d", "answer": None},
                            '{"question": "e\u2028f", "answer": " x "}'))
    recs = data.load_records(path)
    assert [r["answer"] for r in recs] == ["204", "27", "0.5", "x"]
    assert recs[-1]["question"] == "e\u2028f"  # a line separator inside a JSON string is not a line break
    assert "dropped 1 record(s) with an empty 'answer'" in caplog.text
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + _jsonl(GOOD))  # editors on Windows write a BOM
    assert data.load_records(tmp_path / "bom.jsonl")[0]["question"] == "q"


def test_every_shared_data_file_loads(data_dir):
    files = sorted(data_dir.glob("*/*.jsonl"))
    assert len(files) >= 6
    for path in files:
        recs = data.load_records(path)
        assert recs, path
        assert all(isinstance(r["question"], str) and r["question"].strip() for r in recs), path
        assert all(isinstance(r["answer"], str) and r["answer"] for r in recs), path


@pytest.mark.parametrize("case", ["non_utf8_jsonl", "array_line", "answer_list", "empty_jsonl"])
def test_hostile_benchmark_file_is_one_line(tmp_path, case):
    _, content, expected = HOSTILE[case]
    path = tmp_path / "gsm8k" / "test.jsonl"
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(QerlError) as exc:
        benchmarks.load_benchmark("gsm8k", data_dir=tmp_path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(str(path)) and re.search(expected, msg), msg


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(QerlError, match="could not be loaded"):
        data.load_records("no-such-org/no-such-dataset", split="test")


def test_build_prompt_uses_chat_template(tokenizer):
    q = "What is 17 - 9?"
    for template, needle in [("qerl_think", "<think> </think>"), ("boxed", "\\boxed{}"),
                             ("answer_line", "Answer: N"), ("Q: {question} (use \\boxed{})", "Q: What is")]:
        prompt = data.build_prompt(tokenizer, q, template)
        expected = tokenizer.apply_chat_template(data.prompt_messages(q, template), tokenize=False,
                                                 add_generation_prompt=True)
        assert prompt == expected and q in prompt and needle in prompt
        assert prompt.endswith("<|im_start|>assistant\n")
    ids = data.encode_prompts(tokenizer, [q], "answer_line")[0]
    assert tokenizer.decode(ids) == data.build_prompt(tokenizer, q, "answer_line")
    with pytest.raises(QerlError, match="{question}"):
        data.build_prompt(tokenizer, q, "no placeholder")


def test_demo_task_is_deterministic_disjoint_and_correct(tmp_path):
    a = data.make_demo_task(tmp_path / "a", seed=0)
    b = data.make_demo_task(tmp_path / "b", seed=0)
    c = data.make_demo_task(tmp_path / "c", seed=1)
    assert a["train"].read_text() == b["train"].read_text() and a["test"].read_text() == b["test"].read_text()
    assert a["test"].read_text() != c["test"].read_text()
    train, test = (data.load_records(a[s]) for s in ("train", "test"))
    assert len(test) >= 100 and len(train) + len(test) == len(data.demo_pairs()) == 450
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for rec in train + test:
        x, y = (int(t) for t in rec["question"].removeprefix("What is ").removesuffix("?").split(" - "))
        assert 5 <= x <= 29 and 0 <= y <= x and int(rec["answer"]) == x - y
        assert grade(f"Answer: {x - y}", rec["answer"], "numeric")
    with pytest.raises(QerlError, match="at most 450"):
        data.make_demo_task(tmp_path / "d", n_train=400, n_test=100)


def test_demo_heldout_split_has_larger_operands_only(tmp_path):
    a = data.make_demo_task(tmp_path / "demo_task", seed=0)
    assert a["heldout"].read_text() == data.make_demo_task(tmp_path / "b", seed=0)["heldout"].read_text()
    heldout = data.load_records(a["heldout"])
    assert len(heldout) == data.DEMO_N_HELDOUT == len({r["question"] for r in heldout})
    for rec in heldout:
        x, y = (int(t) for t in rec["question"].removeprefix("What is ").removesuffix("?").split(" - "))
        assert 30 <= x <= 99 and 0 <= y <= x and int(rec["answer"]) == x - y
    spec, recs = benchmarks.load_benchmark("demo_large", data_dir=tmp_path)
    assert spec.template == "answer_line" and recs == heldout
    with pytest.raises(QerlError, match="n_heldout"):
        data.make_demo_task(tmp_path / "c", n_heldout=0)


def test_demo_cli(tmp_path):
    assert data.main(["demo", "--out", str(tmp_path / "demo")]) == 0
    assert (tmp_path / "demo" / "train.jsonl").exists() and (tmp_path / "demo" / "meta.json").exists()


def test_benchmarks_resolve_local_hub_and_errors(data_dir, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for name, n in [("gsm8k", 1319), ("math500", 500), ("aime24", 30), ("amc23", 40)]:
        spec, recs = benchmarks.load_benchmark(name, data_dir=data_dir)
        assert len(recs) == n and spec.kind in ("gsm8k", "math", "aime", "amc")
    online = benchmarks.resolve_benchmark("aime25", data_dir=data_dir)  # no local copy: the hub
    assert not online.is_local and online.source == "math-ai/aime25"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(QerlError, match="aime25.*offline"):
        benchmarks.resolve_benchmark("aime25", data_dir=data_dir)
    with pytest.raises(QerlError, match="valid names: gsm8k, math500, aime24, aime25, amc23, demo, demo_large"):
        benchmarks.resolve_benchmark("mmlu")
    with pytest.raises(QerlError, match="local only"):
        benchmarks.resolve_benchmark("demo", data_dir=tmp_path)
    data.make_demo_task(tmp_path / "demo_task")
    spec, recs = benchmarks.load_benchmark("demo", data_dir=tmp_path)
    assert spec.template == "answer_line" and len(recs) == 150
