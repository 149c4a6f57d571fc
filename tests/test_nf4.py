"""QLoRA's NF4 baseline (quantize.scheme nf4 + train.mode qlora_nf4) through bitsandbytes: the quantize stage's
checkpoint, the policy over it, two real training steps of the train stage on CPU, a step on the GPU, and the
one-line errors where bitsandbytes cannot run NF4."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from qerl.errors import QerlError

bnb = pytest.importorskip("bitsandbytes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cpu_nf4_or_skip():
    from qerl.quant.nf4 import require_nf4

    try:
        require_nf4("cpu", "test")
    except QerlError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model through the quantize stage's scheme nf4 (+ its report)."""
    from qerl.quant.compress import quantize_checkpoint

    if DEVICE == "cpu":
        _cpu_nf4_or_skip()
    out = tmp_path_factory.mktemp("tiny_nf4")
    report = quantize_checkpoint(tiny_model_dir, out, "nf4")
    (out / "report.json").write_text(json.dumps(report))
    return out


def test_nf4_checkpoint_sizes_and_error(nf4_dir):
    report = json.loads((nf4_dir / "report.json").read_text())
    cfg = json.loads((nf4_dir / "config.json").read_text())["quantization_config"]
    assert (cfg["quant_method"], cfg["bnb_4bit_quant_type"], cfg["bnb_4bit_use_double_quant"]) == \
        ("bitsandbytes", "nf4", True)
    # 4-bit codes + 8-bit absmax per 64 + fp32 per 256 = 0.26 of bf16, plus small per-layer tables (1 KB each)
    linears = report["quantized_linears"]
    assert 0.25 < linears["ratio"] < 0.3, linears
    assert report["relative_weight_error"]["num_layers"] == 14  # 2 layers x 7 projections
    assert 0.05 < report["relative_weight_error"]["mean"] < 0.15  # NF4's error on Gaussian weights (~0.1)
    saved = load_file(str(nf4_dir / "model.safetensors"))
    assert saved["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8


@pytest.mark.parametrize("source", ["nf4", "dense"])
def test_policy_over_nf4_trains_only_lora(source, nf4_dir, tiny_model_dir):
    from qerl.policy import LoraSpec, load_policy, trainable_parameter_names

    path = nf4_dir if source == "nf4" else tiny_model_dir  # dense: quantized while it loads
    model, _ = load_policy(path, mode="qlora_nf4", dtype=torch.float32, device=DEVICE, lora=LoraSpec(r=2, alpha=4),
                           gradient_checkpointing=True)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, bnb.nn.Linear4bit) and q.base_layer.weight.dtype == torch.uint8
    names = trainable_parameter_names(model)
    assert names and all("lora_" in n for n in names) and len(names) == 2 * 14
    ids = torch.randint(0, 1000, (2, 12), device=DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


TOY_REWARD = "def distinct_characters(completions, **kw):\n    return [len(set(c)) / 10.0 for c in completions]\n"


def _train(nf4_dir, tmp_path, monkeypatch, steps: int):
    """The train stage itself (qerl.train main, MLflow in sqlite under tmp) on the demo task; a random tiny model
    never answers right, so a reward on the text by import path gives the groups' advantages their variance."""
    from qerl.data import make_demo_task
    from qerl.train import main

    task = tmp_path / "task"
    make_demo_task(task, seed=0)
    (task / "nf4_toy_rewards.py").write_text(TOY_REWARD)
    monkeypatch.syspath_prepend(str(task))
    cfg = {"mode": "qlora_nf4", "data": {"source": str(task / "train.jsonl"), "answer_kind": "numeric",
                                         "template": "answer_line", "limit": 8},
           "rewards": ["nf4_toy_rewards:distinct_characters"],
           "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "max_steps": steps, "learning_rate": 5e-2,
           "max_prompt_length": 128, "max_completion_length": 4, "lora": {"lora_r": 2, "lora_alpha": 4},
           "aqn": None, "dtype": "float32", "save_steps": steps}
    out = tmp_path / "adapter"
    main(["--experiment", "nf4", "--model", str(nf4_dir), "--out", str(out), "--checkpoint-dir",
          str(tmp_path / "ck"), "--config-json", json.dumps(cfg), "--results-dir", str(tmp_path / "res")])
    return load_file(str(out / "adapter_model.safetensors"))


def test_train_stage_runs_qlora_nf4_on_cpu(nf4_dir, tmp_path, monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the CPU run; test_grpo_step_trains_qlora_nf4_on_gpu covers CUDA")
    adapter = _train(nf4_dir, tmp_path, monkeypatch, steps=2)
    b = [v for k, v in adapter.items() if "lora_B" in k]
    assert len(b) == 14 and any(v.abs().max() > 0 for v in b)  # B starts at zero: the updates moved it


def grpo_step(nf4_dir, tmp_path, device: str, dtype: torch.dtype) -> dict:
    """One GRPO step of the trainer itself (rollout on the torch engine, then the update); returns its metrics
    after checking that LoRA moved."""
    from bench.e2e_workers import _random_reward
    from qerl.config import TrainConfig
    from qerl.policy import LoraSpec, load_policy
    from qerl.trainer import GRPOTrainer

    model, tok = load_policy(nf4_dir, mode="qlora_nf4", dtype=dtype, device=device, lora=LoraSpec(r=2, alpha=4),
                             gradient_checkpointing=True)
    cfg = TrainConfig(mode="qlora_nf4", data={"source": "bench"}, rewards=["bench.e2e_workers:_random_reward"],
                      num_generations=4, batch_size=2, micro_batch_size=4, max_steps=1, max_completion_length=8,
                      learning_rate=5e-2, gradient_checkpointing=True, aqn=None, lora={"lora_r": 2, "lora_alpha": 4})
    prompts = [list(range(100, 116)), list(range(200, 212))]
    trainer = GRPOTrainer(cfg, model, tok, prompts, ["0", "0"], [("random", _random_reward, 1.0)],
                          checkpoint_dir=tmp_path)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    batch = trainer.rollout(0)
    metrics = trainer.update(batch, 0)
    assert batch.input_ids.shape[0] == 8 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    return metrics


@pytest.mark.gpu
def test_grpo_step_trains_qlora_nf4_on_gpu(nf4_dir, tmp_path):
    """On CUDA in bf16: the torch engine's CUDA graphs over bitsandbytes layers, then the update (the stage CLI
    around it needs MLflow, which the GPU image lacks)."""
    grpo_step(nf4_dir, tmp_path, "cuda", torch.bfloat16)


def test_nf4_errors_are_one_line(monkeypatch, tiny_model_dir, nvfp4_dir):
    from qerl.policy import LoraSpec, load_policy
    from qerl.quant import nf4

    cases = [("mps", "runs on cuda or cpu")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "no CUDA GPU is visible"))
    for device, match in cases:
        with pytest.raises(QerlError, match=match) as err:
            nf4.require_nf4(device, "mode qlora_nf4")
        assert "\n" not in str(err.value)
    monkeypatch.setattr(nf4, "_cpu_backend_error", lambda: "NotImplementedError: no kernel")
    with pytest.raises(QerlError, match=r"no working CPU NF4 backend \(NotImplementedError: no kernel\)"):
        load_policy(tiny_model_dir, mode="qlora_nf4", lora=LoraSpec(r=2, alpha=4), device="cpu")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    with pytest.raises(QerlError, match="scheme nf4: NF4 needs bitsandbytes, which is not installed"):
        from qerl.quant.compress import quantize_checkpoint
        quantize_checkpoint(tiny_model_dir, tiny_model_dir.parent / "never", "nf4")
    monkeypatch.undo()
    with pytest.raises(QerlError, match="quantized, but not with bitsandbytes NF4"):
        load_policy(nvfp4_dir, mode="qlora_nf4", lora=LoraSpec(r=2, alpha=4), device=DEVICE)
