"""CPU test of the Table 3 benchmark (bench.table3) on a tiny model: each method writes the JSON qerl.tables reads
(NVFP4 and NF4 on random weights, BF16 from a checkpoint), rows end at the drawn lengths, and Table 3 renders ours
beside the paper's with the device and the length law in its caption."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import table3
from bench.random_models import build_random_model
from bench.table3_worker import ForcedLengths, draw_lengths, state_dict_bytes
from qerl import tables

REPO = Path(__file__).resolve().parents[2]
TINY = ["--rollout-batches", "2", "--e2e-batches", "1", "--group", "2", "--prompt-len", "8", "--max-completion", "5",
        "--median", "3", "--sigma", "0.5", "--steps", "1", "--micro-batch", "2", "--lora-r", "2", "--in-process"]


@pytest.fixture(scope="module")
def runs(tokenizer_dir, tiny_model_dir, tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    out = tmp_path_factory.mktemp("table3")
    paths = {}
    # one GRPO step (NVFP4) is enough on 2 CPU cores; the others: size and rollout (tests/test_nf4.py trains NF4)
    for method, extra in (("qerl", []), ("qlora", ["--e2e-batches", ""]),
                          ("lora", ["--checkpoint", str(tiny_model_dir), "--e2e-batches", ""])):
        paths[method] = out / f"{method}.json"
        assert table3.main(["--size", "tiny", "--method", method, "--out", str(paths[method]),
                            "--tokenizer", str(tokenizer_dir), *TINY, *extra]) == 0
    return {m: json.loads(p.read_text()) for m, p in paths.items()}, paths


def test_each_method_writes_the_tables_schema(runs):
    docs, _ = runs
    for method, doc in docs.items():
        assert doc["errors"] == {} and doc["method"] == method and doc["device"].startswith("cpu")
        assert doc["model_size_gb"] > 0 and set(doc["rollout_tokens_per_s"]) == {"2"}
        part = doc["rollout"]["2"]
        assert part["lengths"] == draw_lengths(2, 3, 0.5, 5, (0, 2, 0))  # the drawn law, the same for every method
        assert part["tokens"] == sum(part["lengths"]) and part["decode_steps"] == max(part["lengths"])
        assert doc["protocol"]["lengths"]["median"] == 3 and doc["protocol"]["num_generations"] == 2
        if method != "qerl":
            continue
        assert set(doc["e2e_step_seconds"]) == {"1"} and doc["e2e_step_seconds"]["1"] > 0
        step = doc["e2e"]["1"]["steps"][0]  # the trainer's own rollout path is forced too: the next draw of width 2
        assert step["rows"] == 2 and step["step_seconds"] > 0
        assert step["rollout_tokens"] == sum(draw_lengths(2, 3, 0.5, 5, (0, 2, 1)))
    assert docs["lora"]["weights"] == "checkpoint" and docs["qerl"]["weights"].startswith("random")
    # the 4-bit bases beside the same random model in float32: their decoder weights shrank, embeddings did not
    dense = state_dict_bytes(build_random_model("tiny", fp4=False, device="cpu", dtype=torch.float32))
    linears = 2 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128)  # 2 layers: q, o; k, v; gate, up, down
    for method in ("qerl", "qlora"):  # 4-bit codes + scales: between 1/8 and 1/6 of the float32 weights
        saved = dense - docs[method]["model_bytes"]
        assert 4 * linears * (1 - 1 / 6) < saved < 4 * linears * (1 - 1 / 8), (method, saved)


def test_tables_render_the_bench_json(runs, tmp_path):
    docs, paths = runs
    rows = {"lora": "bf16_lora", "qlora": "nf4_lora", "qerl": "nvfp4_lora"}
    experiments = {f"x-{m}": {"row_key": rows[m], "model_size": "7B", "bench_path": str(p)} for m, p in paths.items()}
    for doc, path in zip(docs.values(), paths.values()):  # name the paper's batch sizes, keep the figures
        doc["rollout_tokens_per_s"] = {"2": 10.0, "8": 40.0}
        doc["e2e_step_seconds"] = {"2": 2.0, "4": 3.0, "8": 4.0} if doc["method"] == "lora" else \
            {"2": 1.0, "4": 2.0, "8": 4.0}
        path.write_text(json.dumps(doc))
    written = tables.render_tables(experiments, tmp_path, plots=False)
    md = written["table3.md"].read_text()
    assert "| Qwen2.5-7B-Instruct | QeRL | NVFP4 |" in md and "x2.00 (1.0 s)" in md and "x1.00 (4.0 s)" in md
    assert "random weights of the real Qwen2.5 shapes" in md and "median 3" in md and "cpu x" in md
    assert "rollout engine paged (paged KV cache" in md  # the engine the figures came from
    lines = written["table3.csv"].read_text().splitlines()
    assert any(line.startswith("table3,7B,qlora,e2e_speedup,2,ok,2.0") for line in lines)


def test_speedups_need_one_device_and_one_engine(tmp_path):
    base = {"device": "A", "e2e_step_seconds": {"2": 2.0}}
    other = {"device": "B", "e2e_step_seconds": {"2": 1.0}}
    assert tables._speedup(base, other, 2) == (None, "- (1.0 s)")
    assert tables._speedup(base, {**other, "device": "A"}, 2) == (2.0, "x2.00 (1.0 s)")
    assert tables._speedup(base, {"device": "A"}, 2) == (None, tables.MISSING)
    paged = {"protocol": {"engine": table3.ENGINES["paged"]}}  # nor across rollout engines (older JSONs: torch)
    assert tables._speedup(base, {**other, "device": "A", **paged}, 2) == (None, "- (1.0 s)")
    assert tables._speedup({**base, **paged}, {**other, "device": "A", **paged}, 2) == (2.0, "x2.00 (1.0 s)")


def test_the_paged_engine_ends_rows_at_their_lengths_and_the_torch_engine_still_runs(runs, tokenizer_dir,
                                                                                    tmp_path):
    """The default engine is the recipes' paged one (rows leave the batch at their drawn lengths, its warm-up
    captures what the timed call replays); --engine torch measures on the static engine with the same draws."""
    docs, _ = runs
    paged = docs["qerl"]
    assert paged["engine"] == "paged" and paged["protocol"]["engine"].startswith("paged")
    assert paged["rollout"]["2"]["warm_up"]["steps"] > 0  # the warm-up ran through the engine
    assert paged["e2e"]["1"]["steps"][0]["captures_while_timed"] == 0  # CPU: nothing to capture
    out = tmp_path / "torch.json"
    assert table3.main(["--size", "tiny", "--method", "qerl", "--out", str(out), "--tokenizer", str(tokenizer_dir),
                        *TINY, "--engine", "torch", "--compile", "off", "--e2e-batches", ""]) == 0
    doc = json.loads(out.read_text())
    assert doc["engine"] == "torch" and doc["protocol"]["engine"].startswith("torch") and doc["compile"] is False
    assert doc["rollout"]["2"]["lengths"] == paged["rollout"]["2"]["lengths"]  # the same draw on either engine


def test_forced_lengths_cut_rows_and_stop_after_the_longest():
    from qerl.rollout import RolloutOutput

    class Engine:  # records the stop it was given; returns full-length rows
        _stop_after = None
        seen = []

        def generate(self, prompts, n=1, sampling=None):
            self.seen.append(self._stop_after)
            rows = len(prompts) * n
            return RolloutOutput(prompt_ids=[[1]] * rows, completion_ids=[[7] * 9] * rows,
                                 logprobs=[[-1.0] * 9] * rows, finish_reasons=["length"] * rows)

        def policy_rollout(self, prompts, n):  # the trainer's way in: through the instance's generate
            return self.generate(prompts, n=n)

    engine = Engine()
    ForcedLengths(engine, median=4, sigma=0.8, cap=9, seed=1)
    out = engine.policy_rollout([[1], [2]], n=2)
    lengths = draw_lengths(4, 4, 0.8, 9, (1, 4, 0))
    assert [len(c) for c in out.completion_ids] == lengths and engine.seen == [max(lengths) - 1]
    assert out.finish_reasons == ["stop"] * 4 and engine._stop_after is None
    engine._stop_after = 3  # a warm_up call: passed through as it is, nothing drawn
    assert len(engine.generate([[1]], n=2).completion_ids[0]) == 9 and engine.seen[-1] == 3
    engine._stop_after = None
    again = engine.generate([[1], [2]], n=2)
    assert [len(c) for c in again.completion_ids] == draw_lengths(4, 4, 0.8, 9, (1, 4, 1))  # the next draw


def test_experiments_come_from_the_config(capsys, tmp_path):
    config = str(REPO / "config" / "config.yaml")
    specs = table3.specs_from_config(["qwen7b-nf4-lora", "qwen7b-nvfp4-lora"], config, str(tmp_path))
    assert [(s["size"], s["method"], s["lora_r"]) for s in specs] == [("7B", "qlora", 32), ("7B", "qerl", 32)]
    assert specs[1]["checkpoint"] is None and specs[0]["out"] == str(tmp_path / "qwen7b-nf4-lora.json")
    assert table3.main(["--experiments", "nope", "--config", config]) == 2
    assert "'nope' is not an experiment" in capsys.readouterr().err
    assert table3.main(["--experiments", "qwen3b-mxfp4-lora", "--config", config]) == 2
    assert "not a Table 3 row" in capsys.readouterr().err


def test_a_retry_merges_the_missing_parts_into_the_json(runs, tokenizer_dir, tmp_path):
    """--merge (the retry alone): the parts measured now replace their errors; the JSON's other figures stay, and
    the protocol and `retried_alone` say what the file holds."""
    docs, paths = runs
    doc = dict(docs["qlora"])  # size and rollout at batch 2, no step
    doc["errors"] = {"e2e_b1": "QerlError: the update of step 101 ran out of GPU memory"}
    path = tmp_path / "qlora.json"
    path.write_text(json.dumps(doc))
    assert table3.main(["--size", "tiny", "--method", "qerl", "--out", str(path), "--tokenizer", str(tokenizer_dir),
                        *TINY, "--rollout-batches", "", "--merge"]) == 0
    merged = json.loads(path.read_text())
    assert merged["errors"] == {} and merged["rollout_tokens_per_s"] == doc["rollout_tokens_per_s"]
    assert merged["rollout"]["2"] == doc["rollout"]["2"] and merged["e2e_step_seconds"]["1"] > 0
    assert merged["protocol"]["rollout_batches"] == [2] and merged["protocol"]["e2e_batches"] == [1]
    assert merged["retried_alone"] == ["e2e_b1"]


def test_retry_plan_names_the_missing_parts_after_a_shared_pass_or_a_dead_worker(tmp_path):
    import argparse

    def spec(name, figures):
        out = tmp_path / f"{name}.json"
        if figures is not None:
            out.write_text(json.dumps({"rollout_tokens_per_s": figures[0], "e2e_step_seconds": figures[1]}))
        return {"name": name, "out": str(out)}

    specs = [spec("whole", ({"2": 1.0, "8": 2.0}, {"2": 1.0, "4": 1.0})),
             spec("oom", ({"2": 1.0, "8": 2.0}, {"4": 3.0})), spec("never", None)]
    args = argparse.Namespace(rollout_batches=[2, 8], e2e_batches=[2, 4], jobs=2)
    plan = {s["name"]: (r, e) for s, r, e in table3.retry_plan(specs, args, {"whole": 0, "oom": 0})}
    assert plan == {"oom": ([], [2]), "never": ([2, 8], [2, 4])}
    args.jobs = 1  # alone already: only a worker that died is retried
    plan = {s["name"]: (r, e) for s, r, e in table3.retry_plan(specs, args, {"whole": 0, "oom": 0, "never": 1})}
    assert plan == {"never": ([2, 8], [2, 4])}


def test_a_lost_cuda_context_skips_the_rest_and_exits_nonzero(tokenizer_dir, tmp_path, monkeypatch):
    """A sticky CUDA error (illegal address): the part's error is kept, the later parts are marked not run instead
    of failing one by one, the JSON is written, and the worker exits 1 so that the driver retries in a fresh
    process."""
    from bench import table3_worker

    def illegal_address(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(table3_worker, "_rollout", illegal_address)
    monkeypatch.setattr(table3_worker, "cuda_alive", lambda: False)
    out = tmp_path / "lost.json"
    tiny = [a for a in TINY if a != "--in-process"]
    code = table3.main(["--size", "tiny", "--method", "qerl", "--out", str(out), "--tokenizer", str(tokenizer_dir),
                        *tiny, "--worker-spec", json.dumps(table3._specs(table3._parse(
                            ["--size", "tiny", "--method", "qerl", "--out", str(out)]))[0])])
    doc = json.loads(out.read_text())
    assert code == 1 and doc["cuda_context_lost"] is True
    assert doc["errors"]["rollout_b2"].startswith("RuntimeError: CUDA error: an illegal memory access")
    assert doc["errors"]["e2e_b1"].startswith("not run") and doc["e2e_step_seconds"] == {}
