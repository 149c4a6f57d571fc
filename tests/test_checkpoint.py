"""qerl.checkpoint on a tiny torch module: the fingerprint sees what changes a result (and only that), a checkpoint
of another fingerprint or of the old flat layout is never resumed, files load with weights_only (a planted pickle
runs nothing), and a non-finite state is never written nor named as the last good checkpoint."""
from __future__ import annotations

import functools
import json
import logging
import math

import pytest
import torch
from safetensors.torch import save_file

from qerl.checkpoint import (NON_DETERMINING_KEYS, CheckpointRun, Fingerprint, NonFiniteState, config_digest,
                             data_digest, load_checkpoint, model_digest)
from qerl.config import TrainConfig, parse_section
from qerl.errors import QerlError

FP_A = Fingerprint({"config": "c1", "data": "d1", "model": "m1"})
FP_B = Fingerprint({"config": "c2", "data": "d1", "model": "m1"})  # only the config differs


def _warmup_then_cosine(step: int, warmup: int, total: int) -> float:
    return (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * step / total))


def _parts(seed: int = 0):
    """A module with a frozen part, AdamW and a LambdaLR over a functools.partial (what transformers'
    get_scheduler builds, without its import time)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].requires_grad_(False)  # a frozen part is not checkpointed
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(_warmup_then_cosine, warmup=1, total=10))
    return model, opt, sched


def _step(model, opt, sched):
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _saved(root, fp=FP_A, steps=(1,)):
    model, opt, sched = _parts()
    run = CheckpointRun(root, fp)
    for s in steps:
        _step(model, opt, sched)
        run.save(s, model, opt, sched, {"log_history": [{"step": s, "reward": 0.5}]})
    return run, model, opt, sched


# ------------------------------------------------------------------------------------------ fingerprint
def test_config_digest_ignores_only_when_to_save_and_log():
    assert set(NON_DETERMINING_KEYS) <= set(TrainConfig.model_fields)
    base = parse_section("train", {"data": {"source": "x.jsonl"}}).model_dump(mode="json")
    same = {**base, "save_steps": base["save_steps"] + 7, "logging_steps": base["logging_steps"] + 3}
    assert config_digest(same) == config_digest(base)
    # a run resumes on other nodes and GPUs; a checkpoint written before num_nodes existed keeps its fingerprint
    assert config_digest({**base, "num_nodes": 2, "num_gpus": 4}) == config_digest(base)
    assert config_digest({k: v for k, v in base.items() if k != "num_nodes"}) == config_digest(base)
    for changed in ({**base, "learning_rate": base["learning_rate"] * 2},
                    {**base, "lora": {**base["lora"], "lora_r": base["lora"]["lora_r"] + 1}},
                    {**base, "data": {**base["data"], "limit": 3}},
                    {**base, "gradient_checkpointing": not base["gradient_checkpointing"]}):
        assert config_digest(changed) != config_digest(base)


def test_data_digest_is_the_records_content():
    recs = [{"id": "0", "question": "1+1", "answer": "2"}, {"id": "1", "question": "2+2", "answer": "4"}]
    assert data_digest(recs) == data_digest(json.loads(json.dumps(recs)))
    assert data_digest(recs) != data_digest([recs[0], {**recs[1], "answer": "5"}])
    assert data_digest(recs) != data_digest(recs[::-1])


def test_model_digest_reads_the_bytes_not_only_the_headers(tmp_path):
    """Same tensor names, dtypes, shapes and file sizes with other values (a re-quantization with another
    calibration set) is another model; a stage report beside the weights is not."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    save_file({"w": torch.zeros(8, 8)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "quantize.json").write_text('{"seconds": 1.0}')
    before = model_digest(tmp_path)
    (tmp_path / "quantize.json").write_text('{"seconds": 2.0}')
    assert model_digest(tmp_path) == before
    save_file({"w": torch.ones(8, 8)}, str(tmp_path / "model.safetensors"))
    assert model_digest(tmp_path) != before
    save_file({"w": torch.zeros(8, 8)}, str(tmp_path / "model.safetensors"))
    assert model_digest(tmp_path) == before
    (tmp_path / "tokenizer_config.json").write_text("{}")  # the tokenizer shapes the prompts
    assert model_digest(tmp_path) != before


# ------------------------------------------------------------------------------------------ layout, resume
def test_layout_and_bit_exact_round_trip(tmp_path):
    run, model, opt, sched = _saved(tmp_path, steps=(1, 2, 3))
    rng_at_save = torch.get_rng_state()
    assert [p.relative_to(tmp_path).as_posix() for p in run.checkpoints()] == [
        f"{FP_A.short}/step-000002", f"{FP_A.short}/step-000003"]  # the two newest are kept
    assert json.loads((run.dir / "fingerprint.json").read_text())["fingerprint"] == FP_A.digest
    assert run.resumable() == run.dir / "step-000003"
    fresh, opt2, sched2 = _parts()  # the frozen part comes from the base model, the trainable one from the file
    torch.nn.init.zeros_(fresh[0].weight.data)
    state = load_checkpoint(run.resumable(), fresh, opt2, sched2)
    assert state["step"] == 3 and state["fingerprint"]["fingerprint"] == FP_A.digest
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()) if a.requires_grad)
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    _step(model, opt, sched)
    torch.set_rng_state(rng_at_save)  # the next step of both sees the same batch
    _step(fresh, opt2, sched2)
    assert torch.equal(model[0].weight, fresh[0].weight) and sched.get_last_lr() == sched2.get_last_lr()


def test_another_fingerprint_never_resumes(tmp_path, caplog):
    run_a, *_ = _saved(tmp_path)
    run_b = CheckpointRun(tmp_path, FP_B)
    with caplog.at_level(logging.INFO, logger="qerl.train"):
        assert run_b.resumable() is None
    assert str(run_a.dir) in caplog.text  # named, so a user can delete it
    # a checkpoint of A inside B's folder (copied by hand) is refused by its stored fingerprint
    run_b.dir.mkdir()
    (run_a.dir / "step-000001").rename(run_b.dir / "step-000001")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qerl.train"):
        assert run_b.resumable() is None
    assert "not resuming" in caplog.text and "config differ" in caplog.text


def test_old_flat_layout_is_never_resumed(tmp_path, caplog):
    legacy, model, opt, sched = _saved(tmp_path / "elsewhere")
    (legacy.dir / "step-000001").rename(tmp_path / "step-000001")  # <checkpoint-dir>/step-N, as before
    state = json.loads((tmp_path / "step-000001" / "trainer_state.json").read_text())
    state.pop("fingerprint")
    (tmp_path / "step-000001" / "trainer_state.json").write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="qerl.train"):
        assert CheckpointRun(tmp_path, FP_A).resumable() is None
    assert "old layout" in caplog.text and "step-000001" in caplog.text and "never resumed" in caplog.text


# ------------------------------------------------------------------------------------------ safety
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this calls open(marker, "w"): a file appears if code ran
        return open, (str(self.marker), "w")


def test_planted_pickle_is_refused_and_runs_nothing(tmp_path):
    run, *_ = _saved(tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _RunsCode(marker)}, run.dir / "step-000001" / "optim.pt")
    model, opt, sched = _parts()
    with pytest.raises(QerlError) as err:
        load_checkpoint(run.resumable(), model, opt, sched)
    assert "refused to load" in str(err.value) and "optim.pt" in str(err.value)
    assert "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["weight", "optimizer"])
def test_nonfinite_state_is_never_written(tmp_path, where):
    run, model, opt, sched = _saved(tmp_path)
    _step(model, opt, sched)
    with torch.no_grad():
        if where == "weight":
            model[0].weight[0, 0] = float("inf")
        else:
            opt.state[model[0].bias]["exp_avg_sq"][0] = float("nan")
    with pytest.raises(NonFiniteState, match="non-finite values in (trainable 0.weight|optimizer state)"):
        run.save(2, model, opt, sched, {})
    assert [p.name for p in run.checkpoints()] == ["step-000001"]


def test_last_good_is_verified_finite(tmp_path):
    run, model, opt, sched = _saved(tmp_path, steps=(1, 2))
    bad = run.dir / "step-000002" / "trainable.pt"  # written before this check existed, or damaged
    torch.save({k: torch.full_like(v, float("nan")) for k, v in torch.load(bad).items()}, bad)
    assert run.last_good() == str(run.dir / "step-000001")
    with pytest.raises(QerlError, match="non-finite values in trainable"):
        load_checkpoint(run.dir / "step-000002", model, opt, sched)
