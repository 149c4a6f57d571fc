"""Fixtures shared by the rollout-engine tests."""
from __future__ import annotations

import copy

import pytest
import torch

TEXTS = ["Hello there, how are you today?", "2+2=", "The quick brown fox jumps over the lazy dog, twice."]


def random_fp4_lora():
    """A fresh random Qwen2.5-shaped FP4 model with LoRA r 8 (2 layers), the real tokenizer and TEXTS' prompts: the
    GPU tests' model (each test gets its own, since some change its adapter)."""
    from transformers import AutoTokenizer

    from bench.random_models import attach_lora, build_random_model, qwen25_config
    from tests.conftest import SHARED

    tok = AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "qwen2.5")
    config = qwen25_config("tiny", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    model = attach_lora(build_random_model(config, fp4=True, seed=0), r=8, alpha=16, fp4=True,
                        gradient_checkpointing=False)
    return model, tok, [tok(t)["input_ids"] for t in TEXTS]


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
