"""Record loading (real files, field detection, errors), chat prompts, the demo task, benchmark resolution."""
from __future__ import annotations

import json

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


def test_empty_and_broken_inputs(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(QerlError, match="empty"):
        data.load_records(tmp_path / "train.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(QerlError, match=r"bad.jsonl:2"):
        data.load_records(tmp_path / "bad.jsonl")
    with pytest.raises(QerlError, match="no file for split 'validation'"):
        data.load_records(tmp_path, split="validation")
    with pytest.raises(QerlError, match="does not exist"):
        data.load_records(tmp_path / "nope.jsonl")


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
    with pytest.raises(QerlError, match="valid names: gsm8k, math500, aime24, aime25, amc23, demo"):
        benchmarks.resolve_benchmark("mmlu")
    with pytest.raises(QerlError, match="local only"):
        benchmarks.resolve_benchmark("demo", data_dir=tmp_path)
    data.make_demo_task(tmp_path / "demo_task")
    spec, recs = benchmarks.load_benchmark("demo", data_dir=tmp_path)
    assert spec.template == "answer_line" and len(recs) == 150
