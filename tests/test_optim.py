"""The optimizer of a run: torch or 8-bit AdamW with the configured betas, no decay on norms and biases, and a
one-line error naming train.optim when bitsandbytes is missing."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from qerl import config as qcfg
from qerl.errors import QerlError
from qerl.optim import build_optimizer, param_groups

REPO = Path(__file__).resolve().parents[1]


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.input_layernorm = torch.nn.Parameter(torch.ones(4))
        self.lora_A = torch.nn.Parameter(torch.randn(2, 4))


def train_cfg(**kw):
    return qcfg.parse_section("train", {"data": {"source": "x"}, "learning_rate": 1e-2, "weight_decay": 0.1, **kw})


def test_norm_scales_and_biases_get_no_weight_decay():
    model = Tiny()
    groups = param_groups(model, list(model.parameters()), 0.1)
    decayed, plain = ({id(p) for p in g["params"]} for g in groups)
    assert decayed == {id(model.proj.weight), id(model.lora_A)}
    assert plain == {id(model.proj.bias), id(model.input_layernorm)}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


def test_torch_adamw_takes_the_configured_betas():
    model = Tiny()
    opt = build_optimizer(model, list(model.parameters()), train_cfg(adam_beta2=0.99))
    assert isinstance(opt, torch.optim.AdamW)
    assert all(g["betas"] == (0.9, 0.99) and g["lr"] == 1e-2 for g in opt.param_groups)


def test_8bit_adamw_steps_on_cpu():
    pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(4096, 8)  # bitsandbytes keeps small tensors (< 4096 elements) in 32 bit
    opt = build_optimizer(model, list(model.parameters()), train_cfg(optim="adamw_8bit", adam_beta2=0.99))
    assert type(opt).__name__ == "AdamW8bit" and opt.param_groups[0]["betas"] == (0.9, 0.99)
    model(torch.randn(2, 4096)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight) and opt.state[model.weight]["state1"].dtype == torch.uint8


def test_missing_bitsandbytes_is_one_line_naming_the_key(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    model = Tiny()
    with pytest.raises(QerlError, match=r"^train\.optim: adamw_8bit needs bitsandbytes"):
        build_optimizer(model, list(model.parameters()), train_cfg(optim="adamw_8bit"))
    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    cfg["experiments"]["demo"]["train"]["optim"] = "adamw_8bit"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match=r"^error: .*: experiments\.demo\.train\.optim: adamw_8bit needs bitsandbytes"):
        qcfg.main(["check", str(path)])


def test_the_shipped_config_checks_here():
    proc = subprocess.run([sys.executable, "-m", "qerl.config", "check", "config/config.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if importlib.util.find_spec("bitsandbytes") is None:
        assert proc.returncode != 0 and proc.stderr.count("\n") == 1 and "train.optim" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
