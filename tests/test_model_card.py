"""The adapter's model card (qerl.model_card): the facts of the run, a header the Hub reads, the right loader."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qerl.config import load_config
from qerl.model_card import adapter_card
from qerl.paths import Layout

CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


@pytest.fixture(scope="module")
def experiments():
    return load_config(CONFIG).experiments


def header(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_card_names_base_method_data_steps_and_where_accuracy_lands(experiments, tmp_path):
    cfg = experiments["qwen7b"].train
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-7B-Instruct"}))
    history = [{"step": 1, "reward": 0.25}, {"step": 2, "reward": 0.5, "aqn/sigma": 0.004}]
    card = adapter_card(cfg, base=tmp_path, experiment="qwen7b", history=history,
                        eval_json=Layout("results").eval_json("qwen7b"))
    meta = header(card)
    assert meta["base_model"] == "Qwen/Qwen2.5-7B-Instruct" and meta["library_name"] == "peft"
    assert cfg.mode == "qlora_fp4" and {"nvfp4", "aqn", "grpo"} <= set(meta["tags"])
    assert f"LoRA r {cfg.lora.lora_r}, alpha {cfg.lora.lora_alpha}" in card and "2 steps of" in card
    assert f"`{cfg.data.source}`" in card and "reward 0.5" in card and "aqn/sigma 0.004" in card
    assert "results/qwen7b/eval.json" in card and "load_quantized_model" in card


def test_card_of_a_16_bit_lora_run_without_noise_or_source(experiments, tmp_path):
    name = next(n for n, e in experiments.items() if e.train.mode == "lora")
    cfg = experiments[name].train.model_copy(update={"aqn": None})
    card = adapter_card(cfg, base=tmp_path / "absent", experiment=name, history=[])
    meta = header(card)
    assert "base_model" not in meta and "nvfp4" not in meta["tags"] and "aqn" not in meta["tags"]
    assert "no quantization noise" in card and "AutoModelForCausalLM" in card and "load_quantized_model" not in card
    assert "0 steps of" in card and "| last step | - |" in card
