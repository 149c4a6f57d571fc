"""A CUDA out-of-memory error reaches the user as one line naming the phase and the knobs that lower the need:
from GRPOTrainer's rollout and update (library callers too) and from any stage's main."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.errors import QerlError, is_out_of_memory, out_of_memory

TORCH_SAYS = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
              "2.31 GiB is free. Including non-PyTorch memory, this process has 76.85 GiB memory in use. Of the "
              "allocated memory 70.1 GiB is allocated by PyTorch, and 5.2 GiB is reserved but unallocated. If "
              "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def test_the_line_keeps_what_torch_tried_and_what_was_free():
    err = out_of_memory(torch.OutOfMemoryError(TORCH_SAYS), "the update of step 3", "lower train.micro_batch_size")
    text = str(err)
    assert "\n" not in text and text.startswith("the update of step 3 ran out of GPU memory (CUDA out of memory. ")
    assert "Tried to allocate 20.00 GiB" in text and "of which 2.31 GiB is free)" in text
    assert text.endswith("; lower train.micro_batch_size") and "Including" not in text
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x")) and not is_out_of_memory(RuntimeError(TORCH_SAYS))


@pytest.fixture()
def trainer(tiny_model_dir, tmp_path):
    from bench.e2e_workers import _random_reward
    from qerl.config import TrainConfig
    from qerl.policy import LoraSpec, load_policy
    from qerl.trainer import GRPOTrainer

    model, tok = load_policy(tiny_model_dir, mode="lora", dtype=torch.float32, device="cpu",
                             lora=LoraSpec(r=2, alpha=4))
    cfg = TrainConfig(mode="lora", data={"source": "bench"}, rewards=["bench.e2e_workers:_random_reward"],
                      num_generations=2, batch_size=2, micro_batch_size=2, max_steps=1, max_completion_length=4,
                      aqn=None, lora={"lora_r": 2, "lora_alpha": 4}, dtype="float32")
    return GRPOTrainer(cfg, model, tok, [list(range(100, 108)), list(range(200, 206))], ["0", "0"],
                       [("random", _random_reward, 1.0)], checkpoint_dir=tmp_path)


def _raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError(TORCH_SAYS)


def test_rollout_and_update_name_their_phase_and_knobs(trainer, monkeypatch):
    batch = trainer.rollout(0)  # a real one first: the update below gets a real batch
    monkeypatch.setattr(trainer.engine, "policy_rollout", _raise_oom)
    with pytest.raises(QerlError) as rollout_err:
        trainer.rollout(1)
    assert str(rollout_err.value).startswith("the rollout of step 2 ran out of GPU memory (CUDA out of memory.")
    assert "gpu_memory_utilization (now " in str(rollout_err.value) and "qerl.config memory" in str(rollout_err.value)
    assert isinstance(rollout_err.value.__cause__, torch.OutOfMemoryError)  # library callers keep torch's error
    monkeypatch.setattr(trainer, "policy_logprobs", _raise_oom, raising=False)
    monkeypatch.setattr(torch.Tensor, "backward", _raise_oom)  # whichever the update reaches first
    with pytest.raises(QerlError, match=r"^the update of step 1 ran out of GPU memory .*micro_batch_size \(now 2\)"):
        trainer.update(batch, 0)


def test_other_errors_pass_through_unchanged(trainer, monkeypatch):
    monkeypatch.setattr(trainer.engine, "policy_rollout", lambda *a, **k: (_ for _ in ()).throw(ValueError("bug")))
    with pytest.raises(ValueError, match="bug"):
        trainer.rollout(0)


def test_a_stage_main_prints_one_line_and_exits_2(tmp_path):
    script = ("import torch\nfrom qerl.stage import run_main\n"
              "def main(argv):\n    raise torch.OutOfMemoryError(" + repr(TORCH_SAYS) + ")\n"
              "run_main(main, [])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("error: this stage ran out of GPU memory (CUDA out of memory.")
    assert "Traceback" not in proc.stderr
