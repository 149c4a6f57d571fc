"""Quantized checkpoints of the tiny model, made once per session with the real llmcompressor path."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def nvfp4_dir(tmp_path_factory, tiny_model_dir):
    from qerl.quant.compress import quantize_checkpoint

    out = tmp_path_factory.mktemp("tiny_nvfp4")
    report = quantize_checkpoint(tiny_model_dir, out, "nvfp4")
    out.joinpath("report.json").write_text(__import__("json").dumps(report))
    return out
