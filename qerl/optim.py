"""The optimizer a training run steps: AdamW in torch or bitsandbytes' 8-bit AdamW, as train.optim names it.

    optimizer = build_optimizer(model, params, cfg)     # cfg: the train section (qerl.config.TrainConfig)

Knob names are Hugging Face's TrainingArguments' (optim, adam_beta1, adam_beta2, weight_decay), which the original
QeRL scripts pass (optim adamw_8bit, betas 0.9 / 0.99, weight decay 0.1). As the HF Trainer does, biases and norm
scales (trained with train.train_norms) get no weight decay: decaying an RMSNorm scale pulls it towards zero.
"""
from __future__ import annotations

import re

import torch

from qerl.config import optimizer_problem
from qerl.errors import QerlError

# the HF Trainer's get_decay_parameter_names: these names never decay
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def param_groups(model: torch.nn.Module, params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """params split into a decayed group and a group of biases and norm scales without decay (empty ones dropped)."""
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = [p for p in params if _NO_DECAY.search(names.get(id(p), "").lower())]
    skip = {id(p) for p in no_decay}
    groups = [{"params": [p for p in params if id(p) not in skip], "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, params: list[torch.nn.Parameter], cfg, **options) -> torch.optim.Optimizer:
    """torch AdamW (options: e.g. fused=True on CUDA) or bitsandbytes' AdamW8bit (options do not apply)."""
    groups = param_groups(model, params, cfg.weight_decay)
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optim == "adamw_8bit":
        problem = optimizer_problem(cfg.optim)
        if problem:
            raise QerlError(f"train.optim: {problem}")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=cfg.learning_rate, betas=betas)
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=betas, **options)
