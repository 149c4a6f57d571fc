"""Training stage: kill -9 mid-run + --resume ends with the same adapter as an uninterrupted run and the whole
metric curve in the resumed MLflow run; a changed config never resumes; a non-finite loss, gradient or weight
stops the run naming a checkpoint that is really finite; bad data fail before the model loads."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


TOY_REWARD = "def text_length(completions, **kw):\n    return [len(c) / 10.0 for c in completions]\n"


def _train_config(task: Path) -> dict:
    """A random tiny model never answers right: a length reward (by import path) gives the groups variance."""
    return {
        "mode": "qlora_fp4",
        "data": {"source": str(task / "train.jsonl"), "answer_kind": "numeric", "template": "answer_line",
                 "limit": 12},
        "rewards": ["correctness", "toy_rewards:text_length"], "reward_weights": [1.0, 0.1],
        "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "max_steps": 5, "learning_rate": 5e-3,
        "max_prompt_length": 128, "max_completion_length": 5, "lora": {"lora_r": 4, "lora_alpha": 8},
        "aqn": {"sigma_start": 1e-2, "sigma_end": 1e-3, "num_stages": 3}, "dtype": "float32", "save_steps": 1,
        "rollout": {"temperature": 1.0}, "rollout_correction": "tis",
    }


def _cmd(model: Path, out: Path, ckpt: Path, results: Path, cfg: dict, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "qerl.train", "--experiment", "resume", "--model", str(model), "--out", str(out),
           "--checkpoint-dir", str(ckpt), "--config-json", json.dumps(cfg), "--results-dir", str(results)]
    return cmd + (["--resume"] if resume else [])


def _env(reward_dir: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(reward_dir), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=path)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from qerl.data import make_demo_task

    out = tmp_path_factory.mktemp("task")
    make_demo_task(out, seed=0)
    (out / "toy_rewards.py").write_text(TOY_REWARD)
    return out


def test_kill_and_resume_equals_uninterrupted(nvfp4_dir, task, tmp_path):
    cfg = _train_config(task)
    full = subprocess.run(_cmd(nvfp4_dir, tmp_path / "a", tmp_path / "ck_a", tmp_path / "res", cfg, False),
                          env=_env(task), capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]

    ck_b = tmp_path / "ck_b"
    proc = subprocess.Popen(_cmd(nvfp4_dir, tmp_path / "b", ck_b, tmp_path / "res", cfg, True), env=_env(task),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not list(ck_b.glob("*/step-000002")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "training finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "b").exists()
    resumed = subprocess.run(_cmd(nvfp4_dir, tmp_path / "b", ck_b, tmp_path / "res", cfg, True), env=_env(task),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr

    a = load_file(tmp_path / "a" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k), "training did not move the adapter"
    hist_a = json.loads((tmp_path / "a" / "trainer_state.json").read_text())["log_history"]
    hist_b = json.loads((tmp_path / "b" / "trainer_state.json").read_text())["log_history"]
    assert [h["reward"] for h in hist_a] == [h["reward"] for h in hist_b]
    card = (tmp_path / "b" / "README.md").read_text()  # the model card, not peft's empty template
    assert card.startswith("---\n") and f"`{nvfp4_dir}`" in card and "5 steps" in card and "AQN" in card
    # the resumed MLflow run holds the metrics of the steps before the kill too, each once
    from mlflow.tracking import MlflowClient

    run_file = json.loads((tmp_path / "res" / "resume" / "runs" / "train.json").read_text())
    history = MlflowClient(run_file["tracking_uri"]).get_metric_history(run_file["run_id"], "reward")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]
    assert {m.step: m.value for m in history} == {h["step"]: h["reward"] for h in hist_a}


def _args(model: Path, out: Path, ckpt: Path, results: Path, cfg: dict, resume: bool) -> list[str]:
    return _cmd(model, out, ckpt, results, cfg, resume)[3:]  # the CLI arguments, for an in-process main()


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter_model.safetensors")


def test_changed_config_starts_fresh_and_the_old_config_resumes(nvfp4_dir, task, tmp_path, monkeypatch, caplog):
    """Snakemake always passes --resume: after learning_rate changes, the finished run's checkpoint must not be
    "resumed" (0 steps, the old adapter under the new config); switching back resumes the old folder."""
    monkeypatch.syspath_prepend(str(task))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from qerl.train import main

    cfg = {**_train_config(task), "max_steps": 1}
    ck, res = tmp_path / "ck", tmp_path / "res"
    main(_args(nvfp4_dir, tmp_path / "a", ck, res, cfg, True))
    first = [p for p in ck.iterdir() if p.is_dir()]
    with caplog.at_level(logging.INFO, logger="qerl.train"):
        main(_args(nvfp4_dir, tmp_path / "b", ck, res, {**cfg, "learning_rate": 2e-3}, True))
    assert "resumed from" not in caplog.text and "starting fresh" in caplog.text
    assert str(first[0]) in caplog.text  # the other config's folder is named, for deletion
    assert len([p for p in ck.iterdir() if p.is_dir()]) == 2
    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    assert any(not torch.equal(a[k], b[k]) for k in a)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qerl.train"):
        main(_args(nvfp4_dir, tmp_path / "c", ck, res, {**cfg, "save_steps": 5}, True))  # save_steps: same run
    assert f"resumed from {first[0] / 'step-000001'}" in caplog.text
    c = _adapter(tmp_path / "c")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_existing_checkpoints_without_resume_is_an_error(nvfp4_dir, task, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from qerl.config import parse_section
    from qerl.stage import run_main
    from qerl.train import _load_data, _setup_checkpoints, main

    cfg = _train_config(task)
    section = parse_section("train", cfg)
    ck = tmp_path / "ck"
    (ck / "step-000001").mkdir(parents=True)  # the old flat layout: never resumed, no reason to refuse a fresh run
    (ck / "step-000001" / "trainer_state.json").write_text('{"step": 1}')
    with caplog.at_level(logging.WARNING, logger="qerl.train"):
        run = _setup_checkpoints(section, _load_data(section), str(nvfp4_dir), ck, resume=False)
    assert "old layout" in caplog.text
    (run.dir / "step-000003").mkdir(parents=True)
    (run.dir / "step-000003" / "trainer_state.json").write_text('{"step": 3}')
    with pytest.raises(SystemExit) as exit_:
        run_main(main, _args(nvfp4_dir, tmp_path / "o", ck, tmp_path / "res", cfg, False))
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and "--resume" in line and str(run.dir) in line and "step-000003" in line


def test_bad_data_fail_before_the_model_loads(nvfp4_dir, task, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from qerl import train
    from qerl.errors import QerlError

    def no_model(*a, **kw):
        raise AssertionError("the model was loaded before the data were validated")

    monkeypatch.setattr(train, "_setup_model", no_model)
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "1+1", "answer": "2"}\n{"question": "2+2", \n')
    cfg = {**_train_config(task), "data": {**_train_config(task)["data"], "source": str(bad)}}
    with pytest.raises(QerlError, match=r"train.jsonl:2: not valid JSON"):
        train.main(_args(nvfp4_dir, tmp_path / "o", tmp_path / "ck", tmp_path / "res", cfg, True))


def _trainer(task, nvfp4_dir, tmp_path, monkeypatch, **overrides):
    """A trainer wired as qerl.train wires it (fingerprint folder under tmp_path/ck), outside the CLI."""
    monkeypatch.syspath_prepend(str(task))
    from qerl import trainer as trainer_mod
    from qerl.config import parse_section
    from qerl.train import _load_data, _setup_checkpoints, _setup_data, _setup_model, _setup_rewards

    cfg = parse_section("train", {**_train_config(task), **overrides})
    records = _load_data(cfg)
    run = _setup_checkpoints(cfg, records, str(nvfp4_dir), tmp_path / "ck", resume=True)
    torch.manual_seed(cfg.seed)
    model, tok = _setup_model(cfg, str(nvfp4_dir))
    prompts, answers = _setup_data(cfg, tok, records)
    return trainer_mod.GRPOTrainer(cfg, model, tok, prompts, answers, _setup_rewards(cfg),
                                   checkpoint_dir=tmp_path / "ck", fingerprint=run.fingerprint), run


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(nvfp4_dir, task, tmp_path, monkeypatch):
    from qerl import trainer as trainer_mod
    from qerl.errors import QerlError

    tr, run = _trainer(task, nvfp4_dir, tmp_path, monkeypatch)
    real = trainer_mod.policy_loss
    calls = {"n": 0}

    def flaky(*args, **kw):
        loss, m = real(*args, **kw)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 4 else loss), m

    monkeypatch.setattr(trainer_mod, "policy_loss", flaky)
    with pytest.raises(QerlError, match=r"non-finite loss at step 3; the last good checkpoint is .*step-000002"):
        tr.train()
    assert (run.dir / "step-000002" / "trainable.pt").is_file()


def test_nonfinite_gradient_is_never_applied(nvfp4_dir, task, tmp_path, monkeypatch):
    """A finite loss with an infinite gradient (a half-precision overflow in backward): clipping would scale every
    gradient by nan and AdamW write nan weights into the next checkpoint; the run stops before the update."""
    from qerl.errors import QerlError

    tr, run = _trainer(task, nvfp4_dir, tmp_path, monkeypatch)
    name, lora_b = next((n, p) for n, p in tr.model.named_parameters() if "lora_B" in n)
    lora_b.register_hook(lambda g: g * float("inf") if tr.step == 2 else g)
    with pytest.raises(QerlError, match=r"non-finite gradient norm at step 3 \(update not applied\); the last good "
                                        r"checkpoint is .*step-000002$"):
        tr.train()
    saved = torch.load(run.dir / "step-000002" / "trainable.pt", weights_only=True)
    now = _trainable(tr.model)
    assert all(torch.equal(saved[k], now[k]) for k in saved) and torch.isfinite(now[name]).all()
    assert not (run.dir / "step-000003").exists()


def test_nonfinite_weights_are_never_checkpointed(nvfp4_dir, task, tmp_path, monkeypatch):
    from qerl.errors import QerlError

    tr, run = _trainer(task, nvfp4_dir, tmp_path, monkeypatch)
    name, lora_a = next((n, p) for n, p in tr.model.named_parameters() if "lora_A" in n)
    real_step = tr.optimizer.step

    def overflowing_step(*a, **kw):
        out = real_step(*a, **kw)
        if tr.step == 2:
            with torch.no_grad():
                lora_a.view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(tr.optimizer, "step", overflowing_step)
    with pytest.raises(QerlError, match=rf"non-finite values in trainable {name} after step 3 \(checkpoint not "
                                        r"written\); the last good checkpoint is .*step-000002$"):
        tr.train()
    assert [p.name for p in run.checkpoints()] == ["step-000001", "step-000002"]


def test_offloaded_activations_give_the_same_update(nvfp4_dir, task, tmp_path, monkeypatch):
    """offload_activations + gradient checkpointing: the same batch gives the same adapter after one update, and
    the tensors saved for backward really went through the offload hooks."""
    monkeypatch.syspath_prepend(str(task))
    from qerl import trainer as trainer_mod
    from qerl.config import parse_section
    from qerl.train import _setup_data, _setup_model, _setup_rewards

    packed = []
    real_save_on_cpu = torch.autograd.graph.save_on_cpu

    class CountingSaveOnCpu(real_save_on_cpu):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            pack = self.pack_hook
            self.pack_hook = lambda t: (packed.append(t.shape), pack(t))[1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    adapters = []
    for offload in (False, True):
        cfg = parse_section("train", {**_train_config(task), "gradient_checkpointing": True,
                                      "offload_activations": offload})
        torch.manual_seed(0)  # same LoRA init for both
        model, tok = _setup_model(cfg, str(nvfp4_dir))
        prompts, answers = _setup_data(cfg, tok)
        tr = trainer_mod.GRPOTrainer(cfg, model, tok, prompts, answers, _setup_rewards(cfg),
                                     checkpoint_dir=tmp_path / f"ck{offload}")
        batch = tr.rollout(0)
        tr.update(batch, 0)
        adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    assert packed, "nothing was saved through the offload hooks"
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for name in adapters[0]:
        torch.testing.assert_close(adapters[1][name], adapters[0][name], rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in adapters[1].values())


def test_mlp_chunks_give_the_same_update(nvfp4_dir, task, tmp_path, monkeypatch):
    """train.mlp_chunks tiles every decoder MLP of the trained model; one update equals the untiled one."""
    monkeypatch.syspath_prepend(str(task))
    from qerl import trainer as trainer_mod
    from qerl.config import parse_section
    from qerl.tiled_mlp import decoder_mlps
    from qerl.train import _setup_data, _setup_model, _setup_rewards

    steps = []
    for chunks in (1, 3):
        cfg = parse_section("train", {**_train_config(task), "gradient_checkpointing": True, "mlp_chunks": chunks})
        torch.manual_seed(0)
        model, tok = _setup_model(cfg, str(nvfp4_dir))
        prompts, answers = _setup_data(cfg, tok)
        tr = trainer_mod.GRPOTrainer(cfg, model, tok, prompts, answers, _setup_rewards(cfg),
                                     checkpoint_dir=tmp_path / f"ck{chunks}")
        mlps = decoder_mlps(model)
        assert mlps and all(hasattr(m, "_qerl_untiled_forward") == (chunks > 1) for m in mlps)
        start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        tr.update(tr.rollout(0), 0)
        steps.append({n: p.detach() - start[n] for n, p in model.named_parameters() if p.requires_grad})
    # float32 GEMMs round by their row count (the slices'), and AdamW's first step is ~lr * sign(g) where a
    # gradient is near 0: compare each tensor's step by its norm, not element by element
    for name, step in steps[0].items():  # (LoRA A does not move in the first step: B starts at zero)
        assert (steps[1][name] - step).norm() <= 1e-4 * step.norm(), name
    assert sum(float(step.norm()) > 0 for step in steps[0].values()) >= len(steps[0]) // 2


def test_paged_engine_trains_as_the_torch_engine(nvfp4_dir, task, tmp_path):
    """rollout.engine paged through the training stage: same rollouts, so the same adapter as the torch engine
    (rows depend only on (seed, row)); its KV pool is given back before each update."""
    adapters, histories = {}, {}
    for engine in ("torch", "paged"):
        cfg = {**_train_config(task), "max_steps": 2, "save_steps": 2,
               "rollout": {"temperature": 1.0, "engine": engine, "block_size": 4, "max_num_batched_tokens": 64}}
        out = tmp_path / engine
        proc = subprocess.run(_cmd(nvfp4_dir, out, tmp_path / f"ck_{engine}", tmp_path / "res", cfg, False),
                              env=_env(task), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        adapters[engine] = load_file(str(out / "adapter_model.safetensors"))
        histories[engine] = json.loads((out / "trainer_state.json").read_text())["log_history"]
    for key in ("reward", "completions/mean_length", "rewards/text_length/mean"):
        assert [row[key] for row in histories["paged"]] == [row[key] for row in histories["torch"]], key
    assert adapters["torch"].keys() == adapters["paged"].keys()
    for name, value in adapters["torch"].items():
        # same tokens; the packed forward's log-probs (TIS weights) differ from the padded one's by ~1e-7
        torch.testing.assert_close(adapters["paged"][name], value, rtol=1e-4, atol=1e-5)
