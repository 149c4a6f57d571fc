"""Fixtures shared by the rollout-engine tests."""
from __future__ import annotations

import copy

import pytest
import torch

TEXTS = ["Hello there, how are you today?", "2+2=", "The quick brown fox jumps over the lazy dog, twice."]


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def model64(model_and_tok):
    """The tiny model in float64: sampled comparisons between engines do not hinge on float32 rounding."""
    return copy.deepcopy(model_and_tok[0]).double()


@pytest.fixture(scope="module")
def prompts(model_and_tok):
    return [model_and_tok[1](t)["input_ids"] for t in TEXTS]  # 8, 4 and 12 tokens
