"""Build the local models the pipeline needs without a hub.

    python -m qerl.resources tiny --tokenizer ../shared/tokenizers/qwen2.5 --out resources/tiny
    python -m qerl.resources smollm2 --out resources/smollm2-135m-instruct
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def tiny_qwen2_config(vocab_size: int, **overrides):
    """A Qwen2.5-shaped config small enough for unit tests (head_dim 64, GQA 2:1, tied embeddings)."""
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1_000_000.0,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def build_tiny_model(out_dir: Path | str, tokenizer_dir: Path | str, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny Qwen2 model (float32) with the given tokenizer to out_dir."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    vocab = ((len(tok) + 63) // 64) * 64
    model = Qwen2ForCausalLM(tiny_qwen2_config(vocab, **overrides)).to(torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
