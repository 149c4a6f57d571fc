"""Training stage: kill -9 mid-run + --resume ends with the same adapter as an uninterrupted run; NaN stops."""
from __future__ import annotations

import json
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
    while not (ck_b / "step-000002").exists() and proc.poll() is None and time.time() < deadline:
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


def test_existing_checkpoints_without_resume_is_an_error(nvfp4_dir, task, tmp_path):
    (tmp_path / "ck" / "step-000001").mkdir(parents=True)
    proc = subprocess.run(_cmd(nvfp4_dir, tmp_path / "o", tmp_path / "ck", tmp_path / "res", _train_config(task),
                               False), env=_env(task), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "--resume" in proc.stderr


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(nvfp4_dir, task, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(task))
    from qerl import trainer as trainer_mod
    from qerl.config import parse_section
    from qerl.errors import QerlError
    from qerl.train import _setup_data, _setup_model, _setup_rewards

    cfg = parse_section("train", _train_config(task))
    model, tok = _setup_model(cfg, str(nvfp4_dir))
    prompts, answers = _setup_data(cfg, tok)
    tr = trainer_mod.GRPOTrainer(cfg, model, tok, prompts, answers, _setup_rewards(cfg),
                                 checkpoint_dir=tmp_path / "ck")
    real = trainer_mod.policy_loss
    calls = {"n": 0}

    def flaky(*args, **kw):
        loss, m = real(*args, **kw)
        calls["n"] += 1
        return (loss * float("nan") if calls["n"] > 4 else loss), m

    monkeypatch.setattr(trainer_mod, "policy_loss", flaky)
    with pytest.raises(QerlError, match=r"non-finite loss at step 3; the last good checkpoint is .*step-000002"):
        tr.train()
    assert (tmp_path / "ck" / "step-000002" / "trainable.pt").is_file()


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

    adapters = []
    for chunks in (1, 3):
        cfg = parse_section("train", {**_train_config(task), "gradient_checkpointing": True, "mlp_chunks": chunks})
        torch.manual_seed(0)
        model, tok = _setup_model(cfg, str(nvfp4_dir))
        prompts, answers = _setup_data(cfg, tok)
        tr = trainer_mod.GRPOTrainer(cfg, model, tok, prompts, answers, _setup_rewards(cfg),
                                     checkpoint_dir=tmp_path / f"ck{chunks}")
        mlps = decoder_mlps(model)
        assert mlps and all(hasattr(m, "_qerl_untiled_forward") == (chunks > 1) for m in mlps)
        tr.update(tr.rollout(0), 0)
        adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    for name in adapters[0]:
        torch.testing.assert_close(adapters[1][name], adapters[0][name], rtol=1e-5, atol=1e-7)
