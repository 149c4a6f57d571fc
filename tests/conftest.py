"""Shared fixtures: a randomly initialised Qwen2.5-shaped model with the real Qwen2.5 tokenizer."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# No model or dataset hub in tests: everything is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QERL_SHARED", REPO.parent / "shared"))
TOKENIZER_DIR = SHARED / "tokenizers" / "qwen2.5"
DATA_DIR = SHARED / "data"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    if not TOKENIZER_DIR.exists():
        pytest.skip(f"the Qwen2.5 tokenizer is not at {TOKENIZER_DIR} (set QERL_SHARED to the folder holding "
                    "tokenizers/qwen2.5)")
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.exists():  # a plain clone: the real datasets sit beside the repository (QERL_SHARED moves them)
        pytest.skip(f"the real datasets are not at {DATA_DIR} (set QERL_SHARED to the folder holding data/)")
    return DATA_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A saved tiny Qwen2 model (2 layers, hidden 128, head_dim 64) + the real tokenizer, float32."""
    from qerl.resources import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_qwen")
    build_tiny_model(out, tokenizer_dir, seed=0)
    return out


@pytest.fixture(scope="session")
def nvfp4_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model quantized to NVFP4 once per session with the real llmcompressor path (+ its report)."""
    import json

    pytest.importorskip("llmcompressor")  # absent on the GPU image: its tests skip there instead of erroring

    from qerl.quant.compress import quantize_checkpoint

    out = tmp_path_factory.mktemp("tiny_nvfp4")
    report = quantize_checkpoint(tiny_model_dir, out, "nvfp4")
    out.joinpath("report.json").write_text(json.dumps(report))
    return out


@pytest.fixture
def float64_norms(monkeypatch):
    """Qwen2's RMSNorm computes in float32 even in a float64 model: here in float64, so that two exact ways to the
    same value agree to float64 rounding (with float32 norms they differ by ~1e-7 wherever attention sums in
    another order, e.g. a prompt's keys read through a mask against the plain causal rows)."""
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, hidden):
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)
