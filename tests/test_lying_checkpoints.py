"""Checkpoints that lie: a config.json whose sizes disagree with the safetensors headers is refused (one line
naming config.json and the key) before any model is built; quantized outputs never carry auto_map or .py code."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from qerl.errors import QerlError
from tests.stage_errors import stage_error_line


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


LIES = {  # config change -> what the line must say
    "layers_1e9_float": ({"num_hidden_layers": 1e9}, "num_hidden_layers is 1000000000.0, expected a positive integer"),
    "layers_1e9": ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, but the weights hold 2 decoder"),
    "hidden": ({"hidden_size": 128000}, "hidden_size is 128000, but model.embed_tokens.weight has shape"),
    "vocab": ({"vocab_size": 10**8}, "vocab_size is 100000000, but model.embed_tokens.weight has shape"),
    "intermediate": ({"intermediate_size": 10**7}, "intermediate_size 10000000, hidden_size 128 disagree with the "
                                                   "weights: model.layers.0.mlp.gate_proj.weight"),
    "heads": ({"num_attention_heads": 64, "head_dim": 64}, "num_attention_heads 64, head_dim 64, hidden_size 128 "
                                                           "disagree with the weights: model.layers.0.self_attn.q_proj"),
    "kv_heads": ({"num_key_value_heads": 2}, "num_key_value_heads 2, hidden_size 128 disagree"),
    "negative": ({"hidden_size": -1}, "hidden_size is -1, expected a positive integer"),
}


@pytest.mark.parametrize("case", list(LIES))
def test_quantize_refuses_a_config_that_disagrees_with_its_weights(case, tiny_model_dir, tmp_path, capsys,
                                                                   monkeypatch):
    from qerl.quantize import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    changes, words = LIES[case]
    model = _copy_with_config(tiny_model_dir, tmp_path / "m", **changes)
    line = stage_error_line(capsys, main, ["--experiment", "x", "--model", str(model), "--out", str(tmp_path / "q"),
                                           "--results-dir", str(tmp_path / "res"), "--config-json", "{}"])
    assert f"{model / 'config.json'}: " in line and words in line, line
    assert not (tmp_path / "q").exists() and not (tmp_path / "res").exists()


@pytest.mark.parametrize("changes,words", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, but the weights hold 2 decoder layers"),
    ({"intermediate_size": 512}, "intermediate_size 512, hidden_size 128 disagree with the weights: "
                                 "model.layers.0.mlp.gate_proj.weight_packed has shape [256, 64], expected [512, 64]"),
    ({"hidden_size": 256}, "hidden_size is 256, but model.embed_tokens.weight has shape"),
])
def test_quantized_loader_refuses_a_config_that_disagrees_with_its_packed_shapes(nvfp4_dir, tmp_path, changes, words):
    from qerl.quant.loader import load_quantized_model

    model = _copy_with_config(nvfp4_dir, tmp_path / "q", **changes)
    with pytest.raises(QerlError) as exc:
        load_quantized_model(model)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{model / 'config.json'}: ") and words in msg, msg


def test_train_and_evaluate_refuse_a_lying_config_too(tiny_model_dir, tmp_path):
    from qerl.evaluate import model_dir
    from qerl.policy import LoraSpec, load_policy

    model = _copy_with_config(tiny_model_dir, tmp_path / "m", num_hidden_layers=10**9)
    for call in (lambda: load_policy(model, mode="lora", lora=LoraSpec(r=2, alpha=4)), lambda: model_dir(model)):
        with pytest.raises(QerlError, match="num_hidden_layers is 1000000000, but the weights hold 2"):
            call()


def test_real_checkpoints_pass(tiny_model_dir, nvfp4_dir):
    from qerl.checkpoint_guard import check_config_matches_weights

    check_config_matches_weights(tiny_model_dir)
    check_config_matches_weights(nvfp4_dir)


def test_quantize_never_writes_auto_map_or_python_files(tiny_model_dir, tmp_path, caplog):
    from qerl.quant.compress import quantize_checkpoint

    model = _copy_with_config(tiny_model_dir, tmp_path / "m",
                              auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (model / "modeling_evil.py").write_text("import os\nos.system('echo pwned')\n")
    (model / "configuration_evil.py").write_text("raise SystemExit('ran remote code')\n")
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    out = tmp_path / "q"
    with caplog.at_level(logging.INFO, logger="qerl.checkpoint_guard"):
        quantize_checkpoint(model, out, "bf16")
    assert sorted(out.rglob("*.py")) == []
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in json.loads((out / name).read_text()), name
    assert "has custom code (configuration_evil.py, modeling_evil.py, config.json:auto_map" in caplog.text


def test_drop_remote_code_strips_what_a_save_copied(tmp_path):
    from qerl.checkpoint_guard import drop_remote_code

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "auto_map": {"AutoConfig": "x.Y"}}))
    (tmp_path / "x.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "y.py").write_text("")
    assert drop_remote_code(tmp_path) == ["sub/y.py", "x.py", "config.json:auto_map"]
    assert json.loads((tmp_path / "config.json").read_text()) == {"model_type": "qwen2"}
