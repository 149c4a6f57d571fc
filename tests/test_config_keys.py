"""Every config key is documented, refused when unknown, and read by the code that uses it.

The keys come from walking the pydantic models (a new key is checked without editing this file). "Read" is
recorded by tracing attribute reads of the config sections while the real consumers run on a probe config that
turns every optional path on: the Snakefile's dry run (top-level keys, paths, interpreters, MLflow settings) and
the four stage CLIs in-process on a tiny model (MLflow, llmcompressor and the vLLM engine stubbed). Reads made
inside qerl/config.py (validators, dumping a section to JSON) do not count: a key only the validator looks at
promises something the pipeline does not do.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
import typing
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from qerl import config as qcfg

REPO = Path(__file__).resolve().parents[1]
CONFIG_PY = qcfg.__file__


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def walk(model: type[BaseModel] = qcfg.Config, prefix: str = "") -> list[tuple[type[BaseModel], str, str]]:
    """(model, field, dotted key) of every leaf key under model; a section (or list/map of them) is descended."""
    leaves = []
    for name, field in model.model_fields.items():
        subs = _models_in(field.annotation)
        if not subs:
            leaves.append((model, name, prefix + name))
        for sub in subs:
            leaves += walk(sub, f"{prefix}{name}.")
    return leaves


def sections(model: type[BaseModel] = qcfg.Config) -> set[type[BaseModel]]:
    found = {model}
    for field in model.model_fields.values():
        for sub in _models_in(field.annotation):
            found |= sections(sub)
    return found


# ------------------------------------------------------------------------------------------ tracing reads
def _traced_getattribute(seen: set):
    plain = object.__getattribute__

    def traced(self, name):
        value = plain(self, name)
        if name in type(self).model_fields:
            caller = sys._getframe(1).f_code.co_filename
            if caller != CONFIG_PY and "pydantic" not in caller:
                seen.add(f"{type(self).__name__}.{name}")
        return value

    return traced


@contextmanager
def traced_reads():
    """Collect "<Model>.<field>" for every field read outside qerl/config.py while the block runs."""
    seen: set[str] = set()
    qcfg._Section.__getattribute__ = _traced_getattribute(seen)
    try:
        yield seen
    finally:
        del qcfg._Section.__getattribute__


_DRY_RUN = """
import atexit, json, sys
sys.path.insert(0, {tests!r})
from test_config_keys import _traced_getattribute
from qerl import config
seen = set()
config._Section.__getattribute__ = _traced_getattribute(seen)
atexit.register(lambda: open({out!r}, "w").write(json.dumps(sorted(seen))))
from snakemake.cli import main
main({argv!r})
"""


# ------------------------------------------------------------------------------------------ the probe config
def probe_experiment(task: Path) -> dict:
    """Every optional path on: a hub model with a revision, vLLM rollouts, AWQ calibration, TIS, KL, AQN,
    several updates per batch, sampled and greedy evaluation; epochs (not max_steps) set the length."""
    return {
        "model": "probe-org/probe-model", "model_revision": "probe-rev", "row": "demo", "model_size": "0.5B",
        "quantize": {"scheme": "nvfp4-awq", "calibration_samples": 2, "max_seq_length": 64},
        "train": {
            "mode": "lora",
            "data": {"source": str(task / "train.jsonl"), "split": "train", "question_field": "question",
                     "answer_field": "answer", "answer_kind": "numeric", "template": "answer_line", "limit": 2},
            "rewards": ["correctness", "answer_line_format"], "reward_weights": [1.0, 0.1],
            "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "num_train_epochs": 1.0,
            "num_iterations": 2, "max_prompt_length": 128, "max_completion_length": 3, "beta": 0.01,
            "rollout_correction": "tis", "gradient_checkpointing": True, "offload_activations": True,
            "mlp_chunks": 2, "fused_elementwise": False, "train_norms": True, "logging_steps": 1,
            "lora": {"lora_r": 2, "lora_alpha": 4, "lora_dropout": 0.1},
            "rollout": {"engine": "vllm", "temperature": 1.0, "stop": ["\n"]}, "dtype": "float32",
        },
        "merge": {"requantize": None},
        "eval": {
            "benchmarks": [{"name": "demo", "source": str(task / "test.jsonl"), "k": 2}],
            "data_dir": str(task), "variants": ["trained"], "greedy": True, "sampled": True,
            "max_new_tokens": 2, "stop": ["\n"], "template": "answer_line", "batch_size": 2, "limit": 2,
            "dtype": "float32",
        },
    }


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from qerl.data import make_demo_task

    out = tmp_path_factory.mktemp("task")
    make_demo_task(out, seed=0)
    return out


def _dry_run_reads(tmp_path: Path, task: Path) -> set[str]:
    cfg = {"default_target": "probe", "results_dir": "probe-results", "python": "/probe/bin/python",
           "vllm_python": "/probe-vllm/bin/python", "tokenizer_dir": "/probe/tokenizer", "data_dir": str(task),
           "mlflow": {"tracking_uri": "http://probe-host:5000", "experiment_name": "probe-mlflow"},
           "experiments": {"probe": probe_experiment(task)},
           "ablations": {"probe_ablation": {"base": "probe", "seeds": [0], "smooth_steps": 2,
                                            "train": {"max_steps": 1}, "eval": {"limit": 1},
                                            "methods": {"m": {"label": "M", "quantize": {"scheme": "nvfp4"},
                                                              "train": {"mode": "qlora_fp4"}}}}}}
    (tmp_path / "config").mkdir(parents=True)
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "reads.json"
    argv = ["-n", "-p", "--cores", "1", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
            "all", "probe-results/tables/table1.md", "resources/tiny-qwen2", "probe_ablation"]
    code = _DRY_RUN.format(tests=str(REPO / "tests"), out=str(out), argv=argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for value in ("probe-mlflow", "http://probe-host:5000", "/probe-vllm/bin/python", "/probe/tokenizer"):
        assert value in proc.stdout, value  # the values reach the job commands, not only the parser
    return set(json.loads(out.read_text()))


def _stub_stages(monkeypatch, tiny_model_dir: Path) -> None:
    """No MLflow store, no llmcompressor, a torch engine in place of vLLM: only the config reads matter here."""
    from qerl import tracking, trainer
    from qerl.quant import compress

    class Run:
        run_id = "probe"

        def __getattr__(self, name):
            return lambda *a, **k: None

    @contextmanager
    def stage_run(**kw):
        yield Run()

    def quantize_checkpoint(model_dir, out, scheme, **kw):
        shutil.copytree(model_dir, out, dirs_exist_ok=True)
        return {"scheme": scheme}

    real_make_engine = trainer.make_engine
    monkeypatch.setattr(tracking, "stage_run", stage_run)
    monkeypatch.setattr(compress, "quantize_checkpoint", quantize_checkpoint)
    monkeypatch.setattr(trainer, "make_engine", lambda name, model, tok, **kw: real_make_engine("torch", model, tok))


def _stage_reads(tmp_path: Path, task: Path, tiny_model_dir: Path) -> set[str]:
    from qerl import evaluate, merge, quantize, train
    from qerl.config import parse_section
    from qerl.stage import run_main
    from qerl.trainer import engine_options

    exp = probe_experiment(task)
    sec = {kind: json.dumps(exp[kind]) for kind in ("quantize", "train", "merge", "eval")}
    q, a, m = tmp_path / "quantized", tmp_path / "adapter", tmp_path / "merged"
    common = ["--experiment", "probe", "--results-dir", str(tmp_path / "results")]
    with traced_reads() as seen:
        run_main(quantize.main, [*common, "--model", str(tiny_model_dir), "--out", str(q), "--config-json",
                                 sec["quantize"], "--calibration-data-json", json.dumps(exp["train"]["data"])])
        run_main(train.main, [*common, "--model", str(q), "--out", str(a), "--config-json", sec["train"]])
        run_main(merge.main, [*common, "--base", str(q), "--adapter", str(a), "--out", str(m),
                              "--config-json", sec["merge"], "--dtype", "float32"])
        run_main(evaluate.main, [*common, "--trained", str(m), "--out", str(tmp_path / "eval.json"),
                                 "--config-json", sec["eval"]])
        # the probe rolls out with vLLM; the paged engine's knobs are read where the trainer builds its engine
        paged = {**exp["train"], "rollout": {**exp["train"]["rollout"], "engine": "paged"}}
        engine_options(parse_section("train", paged))
    return seen


# ------------------------------------------------------------------------------------------ tests
def test_every_section_refuses_unknown_keys():
    for model in sections():
        assert model.model_config.get("extra") == "forbid", model.__name__


def test_every_key_is_documented():
    doc = (REPO / "config" / "README.md").read_text()
    named = set(re.findall(r"`([A-Za-z_][\w.]*)`", doc))
    named |= {part for name in named for part in name.split(".")}
    missing = [key for _, name, key in walk() if name not in named]
    assert not missing, f"config/README.md does not name: {missing}"


def test_every_key_is_read_by_the_pipeline(tmp_path, task, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _stub_stages(monkeypatch, tiny_model_dir)
    reads = _dry_run_reads(tmp_path / "dry", task) | _stage_reads(tmp_path / "stages", task, tiny_model_dir)
    unread = [key for model, name, key in walk() if f"{model.__name__}.{name}" not in reads]
    assert not unread, f"config keys no code reads (wire them or delete them): {unread}"


def test_the_tracer_sees_a_key_nobody_reads(monkeypatch):
    """The check above can fail: a section field read only by its validator is reported as unread."""
    with traced_reads() as seen:
        cfg = qcfg.parse_section("train", {"data": {"source": "x"}, "epsilon": 0.2, "epsilon_high": 0.3})
        _ = cfg.learning_rate
    assert "TrainConfig.learning_rate" in seen
    assert "TrainConfig.epsilon_high" not in seen  # the validator compared it; nothing outside config.py did


def test_the_trainers_engines_stack_no_plain_projections():
    """A rollout's model is the one training owns (mode full: its weights, or a copy gathered from FSDP shards):
    its plain projections must keep their own tensors, so the trainer's engines group LoRA layers only."""
    from qerl.trainer import engine_options

    for engine in ("paged", "torch"):
        cfg = qcfg.TrainConfig(data={"source": "x"}, rollout={"engine": engine})
        assert engine_options(cfg)["plain_projections"] is False


def test_rollout_compile_reaches_the_engine_options():
    from qerl.trainer import engine_options

    for engine in ("torch", "paged"):
        for value in (True, False, "auto"):
            cfg = qcfg.TrainConfig(data={"source": "x"}, rollout={"engine": engine, "compile": value})
            assert engine_options(cfg)["compile"] == value
    with pytest.raises(ValueError):
        qcfg.TrainConfig(data={"source": "x"}, rollout={"compile": "sometimes"})
