"""Fixtures shared by the rollout-engine tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval(), tok
