"""Broken models, checkpoints and adapters end as one line naming the file and the problem, in every stage that
reads them, before any tensor is loaded."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.errors import QerlError
from stage_errors import stage_error_line as _stage_line

WEIGHTS = "model.safetensors"


def _head(file, extra: int) -> bytes:
    """The first bytes of a safetensors file: its header plus `extra` bytes of tensor data."""
    data = file.read_bytes()
    return data[:8 + struct.unpack("<Q", data[:8])[0] + extra]


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps({**cfg, **changes}))


# case -> (break the copy, the file the line must name, what it must say)
CHECKPOINT_CASES = {
    "no_weights": (lambda d: (d / WEIGHTS).unlink(), "", "has no weights (no *.safetensors file)"),
    "pickle_only": (lambda d: ((d / WEIGHTS).unlink(), (d / "pytorch_model.bin").write_bytes(b"\x80\x02")),
                    "", "pytorch_model.bin are pickles, which are not loaded"),
    "truncated": (lambda d: (d / WEIGHTS).write_bytes(_head(d / WEIGHTS, 1024)), WEIGHTS, "truncated"),
    "truncated_header": (lambda d: (d / WEIGHTS).write_bytes(_head(d / WEIGHTS, 0)[:200]), WEIGHTS,
                         "truncated (200 bytes, its header alone needs"),
    "garbage": (lambda d: (d / WEIGHTS).write_bytes(bytes(range(256)) * 16), WEIGHTS,
                "not a safetensors file (no valid header"),
    "garbage_header": (lambda d: (d / WEIGHTS).write_bytes(struct.pack("<Q", 12) + b"not a header"), WEIGHTS,
                       "header is not safetensors JSON"),
    "index_names_missing_shard": (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})), "model.safetensors.index.json",
        "names model-00002-of-00002.safetensors, which is missing"),
    "config_not_json": (lambda d: ((d / "config.json").unlink(), (d / "config.json").write_text('{"model_type": ')),
                        "config.json", "not valid JSON"),
    "unknown_model_type": (lambda d: _edit_config(d, model_type="qwen9"), "config.json",
                           "model_type 'qwen9' is not known to transformers"),
    "custom_code": (lambda d: _edit_config(d, model_type="my_lm", auto_map={"AutoModelForCausalLM": "m.MyLM"}),
                    "config.json", "its custom code (auto_map) is not run"),
}


@pytest.fixture(params=sorted(CHECKPOINT_CASES))
def broken_checkpoint(request, tiny_model_dir, tmp_path):
    """A copy of the tiny model (files linked, the broken one rewritten), the path the error names, the words."""
    brk, file, words = CHECKPOINT_CASES[request.param]
    d = tmp_path / "model"
    d.mkdir()
    for f in tiny_model_dir.iterdir():
        (d / f.name).symlink_to(f)
    if (d / WEIGHTS).is_symlink() and request.param.startswith(("truncated", "garbage")):
        data = _head(tiny_model_dir / WEIGHTS, 1 << 20)  # replace the link before writing through it
        (d / WEIGHTS).unlink()
        (d / WEIGHTS).write_bytes(data)
    brk(d)
    return d, str(d / file) if file else str(d), words


def _cli_argv(stage: str, model, tmp_path, data_dir) -> tuple:
    out = str(tmp_path / "out")
    if stage == "quantize":
        from qerl.quantize import main
        return main, ["--model", str(model), "--out", out, "--config-json", "{}"]
    if stage == "merge":
        from qerl.merge import main
        return main, ["--base", str(model), "--adapter", str(tmp_path), "--out", out, "--config-json", "{}"]
    from qerl.evaluate import main
    cfg = {"benchmarks": [{"name": "gsm8k"}], "variants": ["trained"], "limit": 1}
    return main, ["--trained", str(model), "--data-dir", str(data_dir), "--out", out + ".json",
                  "--config-json", json.dumps(cfg)]


@pytest.mark.parametrize("stage", ["quantize", "merge", "evaluate"])
def test_stage_cli_names_the_broken_file(stage, broken_checkpoint, tmp_path, data_dir, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model, culprit, words = broken_checkpoint
    main, argv = _cli_argv(stage, model, tmp_path, data_dir)
    line = _stage_line(capsys, main, ["--experiment", "x", "--results-dir", str(tmp_path / "res"), *argv])
    assert culprit in line and words in line, line


def test_policy_load_names_the_broken_file(broken_checkpoint):
    from qerl.policy import LoraSpec, load_policy

    model, culprit, words = broken_checkpoint
    with pytest.raises(QerlError) as err:
        load_policy(model, mode="lora", lora=LoraSpec(r=2, alpha=2))
    assert culprit in str(err.value) and words in str(err.value) and "\n" not in str(err.value)


# ---- adapters at merge ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    from qerl.policy import LoraSpec, load_policy

    model, _ = load_policy(tiny_model_dir, mode="lora", lora=LoraSpec(r=2, alpha=4, target_modules=("v_proj",)))
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(str(out))
    return out


def _edit_adapter_config(d, drop=(), **changes):
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg = {k: v for k, v in {**cfg, **changes}.items() if k not in drop}
    (d / "adapter_config.json").write_text(json.dumps(cfg))


def _rewrite_adapter(d, fn):
    """Apply fn(name, tensor) -> (name, tensor) to every tensor of the adapter file."""
    tensors = load_file(str(d / "adapter_model.safetensors"))
    save_file(dict(fn(k, v) for k, v in tensors.items()), str(d / "adapter_model.safetensors"))


ADAPTER_CASES = {
    "config_not_json": (lambda d: (d / "adapter_config.json").write_text("{r: 2"), "adapter_config.json",
                        "not valid JSON"),
    "config_missing_keys": (lambda d: _edit_adapter_config(d, drop=("r", "lora_alpha")), "adapter_config.json",
                            "missing r, lora_alpha (expected a PEFT LoRA adapter config)"),
    "config_not_lora": (lambda d: _edit_adapter_config(d, peft_type="IA3"), "adapter_config.json",
                        "peft_type is 'IA3', expected 'LORA'"),
    "weights_missing": (lambda d: (d / "adapter_model.safetensors").unlink(), "",
                        "no adapter_model.safetensors"),
    "weights_truncated": (lambda d: (d / "adapter_model.safetensors").write_bytes(
        _head(d / "adapter_model.safetensors", 16)), "adapter_model.safetensors", "truncated"),
    # v_proj maps 128 -> 64 features in the tiny model; this adapter was trained on a model with 64 -> 64
    "other_base_shape": (lambda d: _rewrite_adapter(d, lambda k, v: (k, v[:, :64].contiguous() if "lora_A" in k
                                                                      else v)), "adapter_model.safetensors",
                         "LoRA maps 64 -> 64 features but the base"),
    "other_base_targets": (lambda d: (_edit_adapter_config(d, target_modules=["c_attn"]), _rewrite_adapter(
        d, lambda k, v: (k.replace("self_attn.v_proj", "attn.c_attn"), v))), "adapter_config.json",
        "target_modules ['c_attn'] are not layers of the base"),
    "other_base_depth": (lambda d: _rewrite_adapter(d, lambda k, v: (k.replace("layers.1.", "layers.7."), v)),
                         "adapter_model.safetensors", "model.layers.7.self_attn.v_proj is not in the base"),
}


@pytest.mark.parametrize("case", sorted(ADAPTER_CASES))
def test_merge_names_the_broken_adapter(case, adapter_dir, tiny_model_dir, tmp_path):
    from qerl.merging import merge_adapter

    brk, file, words = ADAPTER_CASES[case]
    d = shutil.copytree(adapter_dir, tmp_path / "adapter")
    brk(d)
    with pytest.raises(QerlError) as err:
        merge_adapter(tiny_model_dir, d, tmp_path / "merged", dtype=torch.float32)
    line = str(err.value)
    assert str(d / file) in line and words in line and "\n" not in line, line
    assert not (tmp_path / "merged").exists()  # checked before any work


def test_merge_cli_adapter_for_another_base_is_one_line(adapter_dir, tiny_model_dir, tmp_path, capsys, monkeypatch):
    from qerl.merge import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    d = shutil.copytree(adapter_dir, tmp_path / "adapter")
    ADAPTER_CASES["other_base_shape"][0](d)
    line = _stage_line(capsys, main, ["--experiment", "x", "--base", str(tiny_model_dir), "--adapter", str(d),
                                      "--out", str(tmp_path / "m"), "--config-json", "{}", "--results-dir",
                                      str(tmp_path / "res")])
    assert "adapter_model.safetensors: layer model.layers.0.self_attn.v_proj LoRA maps 64 -> 64" in line


# ---- quantize: NVFP4/MXFP4 group sizes ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def odd_width_model(tmp_path_factory, tokenizer_dir):
    """A tiny Qwen2 whose MLP width (72) is not a multiple of 16: down_proj has in_features 72."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from qerl.resources import tiny_qwen2_config

    out = tmp_path_factory.mktemp("odd")
    Qwen2ForCausalLM(tiny_qwen2_config(256, intermediate_size=72)).save_pretrained(out)  # small vocab: fast
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("scheme, group", [("nvfp4", 16), ("mxfp4", 32)])
def test_quantize_names_the_layer_whose_width_breaks_the_groups(odd_width_model, tmp_path, scheme, group):
    from qerl.quant.compress import quantize_checkpoint

    with pytest.raises(QerlError) as err:
        quantize_checkpoint(odd_width_model, tmp_path / "q", scheme)
    line = str(err.value)
    assert line == (f"{odd_width_model}: layer model.layers.0.mlp.down_proj has in_features 72, not a multiple of "
                    f"{group}: scheme {scheme} scales each group of {group} input weights together")
