"""Train inputs refused at startup with one line: a max_prompt_length below every prompt (at data load, before
the model), a custom reward that cannot take the trainer's arguments, lora.target_modules naming no layer."""
from __future__ import annotations

import json

import pytest

from qerl.errors import QerlError
from tests.stage_errors import stage_error_line


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from qerl.data import make_demo_task

    out = tmp_path_factory.mktemp("task")
    make_demo_task(out, seed=0)
    return out


def _train_line(capsys, model, task, tmp_path, **overrides) -> str:
    from qerl.train import main

    cfg = {"mode": "lora", "data": {"source": str(task / "train.jsonl"), "answer_kind": "numeric",
                                    "template": "answer_line", "limit": 4},
           "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "max_steps": 1, "max_completion_length": 2,
           "lora": {"lora_r": 2, "lora_alpha": 4}, "dtype": "float32", **overrides}
    return stage_error_line(capsys, main, ["--experiment", "x", "--model", str(model), "--out", str(tmp_path / "a"),
                                           "--results-dir", str(tmp_path / "res"), "--config-json", json.dumps(cfg)])


def test_max_prompt_length_below_every_prompt_is_refused_before_the_model(tiny_model_dir, task, tmp_path, capsys,
                                                                          monkeypatch):
    import qerl.policy

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(qerl.policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    line = _train_line(capsys, tiny_model_dir, task, tmp_path, max_prompt_length=8)
    assert "train.max_prompt_length=8 is shorter than every prompt" in line, line
    assert "all 4 dropped, the shortest is " in line and " tokens" in line, line
    assert not (tmp_path / "res").exists()  # no MLflow run either


TYPO_REWARDS = {
    "no_kwargs": "def reward(completions):\n    return [0.0] * len(completions)\n",
    "trl_style": "def reward(prompts, completions, **kw):\n    return [0.0] * len(completions)\n",
    "keyword_only": "def reward(*, completions, **kw):\n    return [0.0] * len(completions)\n",
}


@pytest.mark.parametrize("case", list(TYPO_REWARDS))
def test_a_reward_that_cannot_take_the_trainers_arguments_is_refused_at_startup(case, tmp_path, monkeypatch):
    from qerl.rewards import get_reward_fn

    (tmp_path / f"bad_{case}.py").write_text(TYPO_REWARDS[case])
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(QerlError) as exc:
        get_reward_fn(f"bad_{case}:reward")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"reward function 'bad_{case}:reward': reward(") and \
        "cannot be called as fn(completions, answers=..., kind=...)" in msg, msg


def test_rewards_that_take_the_trainers_arguments_pass(tmp_path, monkeypatch):
    from qerl.rewards import BUILTIN_REWARDS, check_reward_signature, get_reward_fn

    (tmp_path / "good_rewards.py").write_text(
        "def a(completions, **kw):\n    return []\n"
        "def b(completions, answers=None, kind='math'):\n    return []\n"
        "def c(completions, *args, answers, kind, **kw):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in "abc":
        assert callable(get_reward_fn(f"good_rewards:{name}"))
    for name, fn in BUILTIN_REWARDS.items():
        check_reward_signature(fn, name)


def test_train_stage_refuses_a_bad_reward_before_the_model(tiny_model_dir, task, tmp_path, capsys, monkeypatch):
    import qerl.policy

    (tmp_path / "stage_reward.py").write_text(TYPO_REWARDS["no_kwargs"])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(qerl.policy, "load_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    line = _train_line(capsys, tiny_model_dir, task, tmp_path, rewards=["stage_reward:reward"])
    assert "reward function 'stage_reward:reward': reward(completions) cannot be called" in line, line


@pytest.mark.parametrize("mode,fixture", [("lora", "tiny_model_dir"), ("qlora_fp4", "nvfp4_dir")])
def test_lora_targets_naming_no_layer_are_refused_with_the_names_that_exist(mode, fixture, request):
    from qerl.policy import LoraSpec, load_policy

    model_dir = request.getfixturevalue(fixture)
    with pytest.raises(QerlError) as exc:
        load_policy(model_dir, mode=mode, lora=LoraSpec(r=2, alpha=4, target_modules=("q_prj", "v_proj")))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("lora.target_modules ['q_prj'] name no layer of the model"), msg
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in msg, msg
    # dotted names match as peft matches them
    load_policy(model_dir, mode=mode, lora=LoraSpec(r=2, alpha=4, target_modules=("self_attn.q_proj",)))
