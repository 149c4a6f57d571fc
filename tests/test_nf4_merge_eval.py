"""The QLoRA (NF4) rows end to end: the merge of an adapter trained over a bitsandbytes NF4 base into a plain 16-bit
checkpoint (its weights against a float64 reference, its logits against peft's forward over the NF4 base), the
merge and evaluate stage CLIs on an NF4 experiment, and their one-line errors. CPU, bitsandbytes >= 0.47."""
from __future__ import annotations

import copy
import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.errors import QerlError
from qerl.stage import run_main
from stage_errors import stage_error_line

bnb = pytest.importorskip("bitsandbytes")
IDS = torch.tensor([[5, 77, 1000, 31, 2, 640, 9, 12]])  # several tokens: bitsandbytes' dequantize-then-matmul path
R, ALPHA = 4, 8
SCALING = ALPHA / R  # peft's LoRA scaling without rslora
EVAL_CFG = {"benchmarks": [{"name": "gsm8k"}], "variants": ["trained", "base", "quantized_base"], "greedy": True,
            "sampled": False, "max_new_tokens": 4, "limit": 2, "dtype": "float32", "engine": "torch"}


@pytest.fixture(scope="module")
def nf4_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model through the quantize stage's scheme nf4, or a skip naming why NF4 cannot run on this CPU."""
    from qerl.quant.compress import quantize_checkpoint
    from qerl.quant.nf4 import require_nf4

    try:
        require_nf4("cpu", "test")
    except QerlError as err:
        pytest.skip(str(err))
    out = tmp_path_factory.mktemp("tiny_nf4")
    quantize_checkpoint(tiny_model_dir, out, "nf4")
    return out


@pytest.fixture(scope="module")
def trained(nf4_dir, tmp_path_factory):
    """A QLoRA policy with non-trivial LoRA and RMSNorm values (as after training), saved as the train stage saves
    it; returns its adapter dir, its float32 logits with and without the adapter, and the float64 reference
    weights deq(W) + SCALING * B @ A per adapted layer, from the policy's own bitsandbytes layers."""
    from qerl.policy import LoraSpec, load_policy
    from tests.test_merging import as_if_trained

    torch.manual_seed(0)
    model, _ = load_policy(nf4_dir, mode="qlora_nf4", dtype=torch.float32, device="cpu",
                           lora=LoraSpec(r=R, alpha=ALPHA), train_norms=True)
    out = tmp_path_factory.mktemp("nf4_adapter")
    as_if_trained(model, out)
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        with model.disable_adapter():
            base_logits = model(input_ids=IDS).logits
    reference, deltas = {}, {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "base_layer", None), bnb.nn.Linear4bit):
            w = module.base_layer.weight
            state = copy.copy(w.quant_state)
            state.dtype = torch.float32  # bitsandbytes' float32 forward dequantizes in float32 (not the stored bf16)
            deq = bnb.functional.dequantize_4bit(w.data, state).double()
            b, a = module.lora_B["default"].weight.detach(), module.lora_A["default"].weight.detach()
            delta = SCALING * b.double() @ a.double()
            key = name.removeprefix("base_model.model.") + ".weight"
            reference[key], deltas[key] = deq + delta, delta
    assert len(reference) == 14
    return out, logits, base_logits, reference, deltas


def _max_rel_diff(saved: dict, reference: dict) -> float:
    scale = max(float(r.abs().max()) for r in reference.values())
    return max(float((saved[k].double() - r).abs().max()) for k, r in reference.items()) / scale


def test_float32_merge_is_deq_plus_scaled_lora_and_computes_the_qlora_policy(nf4_dir, trained, tmp_path,
                                                                             monkeypatch):
    from transformers import AutoModelForCausalLM

    from qerl.merging import merge_adapter

    adapter_dir, policy_logits, base_logits, reference, deltas = trained
    report = merge_adapter(nf4_dir, adapter_dir, tmp_path, dtype=torch.float32)
    assert report["merged_layers"] == 14 and report["trained_norms_copied"] == 5
    assert report["merged_from"]["base_format"] == "nf4" and report["merged_from"]["lora_scaling"] == SCALING
    assert report["merged_from"]["base_quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    assert report["max_abs_diff"] < 1e-6 * report["max_abs_weight"]

    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in cfg
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert not any(k.endswith((".absmax", ".quant_map")) or "quant_state" in k or "lora" in k for k in saved)
    # deq(W) is exact in float32 (bf16 codes x scales); B @ A (r terms) and the add round a few float32 ulps
    assert _max_rel_diff(saved, reference) < 1e-6
    # the bound is tight enough to see the adapter: leaving it out, or scaling it by 1 instead of alpha/r, fails
    assert min(float(d.abs().max()) for d in deltas.values()) > 1e3 * 1e-6 * max(
        float(r.abs().max()) for r in reference.values())

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # the merged checkpoint loads without it
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    with torch.no_grad():
        merged_logits = merged(IDS).logits
    # float32 both ways over the same weights: only the summation order differs (x A^T B^T vs x (W + s B A)^T),
    # ~1e-6 relative per layer; 1e-4 has margin, and the adapter moves the logits by far more than that
    assert float((policy_logits - base_logits).abs().max()) > 100 * 1e-4
    torch.testing.assert_close(merged_logits, policy_logits, rtol=1e-4, atol=1e-4)


def test_peft_merge_into_linear4bit_would_requantize(nf4_dir, trained):
    """Why the merge dequantizes first: peft's own merge into a bitsandbytes layer rounds deq(W) + s B A back to
    NF4, losing most of the adapter's delta; a bf16 merge keeps it to half a bf16 ulp."""
    from peft import PeftModel

    from qerl.quant.nf4 import load_nf4_model

    adapter_dir, _, _, reference, deltas = trained
    base = load_nf4_model(nf4_dir, torch.float32, "cpu")
    nf4_merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    layer = nf4_merged.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(layer, bnb.nn.Linear4bit)
    requantized = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).double()
    key = "model.layers.0.self_attn.q_proj.weight"
    lost = float((requantized - reference[key]).abs().max())
    assert lost > 0.1 * float(deltas[key].abs().max())  # re-rounding to NF4 erases a good part of the delta
    assert reference[key].abs().max() * 2 ** -8 < 0.1 * lost  # the bf16 merge's bound is an order finer


def test_merge_and_evaluate_stages_run_an_nf4_experiment(nf4_dir, trained, tiny_model_dir, data_dir, tmp_path,
                                                         monkeypatch):
    import mlflow

    from qerl import evaluate
    from qerl.merge import main as merge_main
    from qerl.quant import nf4
    from qerl.tracking import find_stage_runs

    adapter_dir, _, _, reference, _ = trained
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = ["--experiment", "qlora", "--results-dir", str(tmp_path), "--tracking-uri", store]
    merged = tmp_path / "merged"
    run_main(merge_main, ["--base", str(nf4_dir), "--adapter", str(adapter_dir), "--out", str(merged),
                          "--config-json", "{}", *common])
    report = json.loads((merged / "merge.json").read_text())
    assert report["dtype"] == "bfloat16" and report["merged_from"]["base_format"] == "nf4"
    saved = load_file(str(merged / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    # one bf16 rounding of the float32 merge: at most half a bf16 ulp (2^-8 relative) of the largest weight
    assert 0 < report["max_abs_diff"] <= report["max_abs_weight"] * 2 ** -8
    assert _max_rel_diff(saved, reference) <= 2 ** -8

    loaded = []  # the quantized_base variant must run on bitsandbytes' NF4 layers, not on a dense copy
    real = nf4.load_nf4_model
    monkeypatch.setattr(nf4, "load_nf4_model", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    out = tmp_path / "eval.json"
    run_main(evaluate.main, ["--trained", str(merged), "--base", str(tiny_model_dir), "--quantized", str(nf4_dir),
                             "--data-dir", str(data_dir), "--out", str(out), "--config-json", json.dumps(EVAL_CFG),
                             *common])
    assert len(loaded) == 1 and sum(isinstance(m, bnb.nn.Linear4bit) for m in loaded[0].modules()) == 14
    results = json.loads(out.read_text())["benchmarks"]
    paths = {key: entry["model_path"] for key, entry in results.items()}
    assert paths == {"gsm8k/trained/greedy": str(merged), "gsm8k/base/greedy": str(tiny_model_dir),
                     "gsm8k/quantized_base/greedy": str(nf4_dir)}
    assert all(entry["n_problems"] == 2 for entry in results.values())
    runs = {r["stage"]: r for r in find_stage_runs("qlora", tmp_path, uri=store)}
    assert runs["merge"]["status"] == runs["evaluate"]["status"] == "FINISHED"
    assert runs["merge"]["metrics"]["max_abs_diff"] == report["max_abs_diff"]
    client = mlflow.MlflowClient(tracking_uri=store)
    notes = {stage: client.get_run(r["run_id"]).data.tags["mlflow.note.content"] for stage, r in runs.items()}
    assert f"merged `{adapter_dir}` into `{nf4_dir}` -> `{merged}`" in notes["merge"]
    for key, entry in results.items():  # the evaluate run's description is the accuracy table
        benchmark, variant, mode = key.split("/")
        assert f"| {benchmark} | {variant} | {mode} | **{100 * entry['accuracy']:.1f}** |" in notes["evaluate"]


def test_nf4_merge_and_eval_errors_are_one_line_before_any_model_loads(nf4_dir, trained, data_dir, tmp_path, capsys,
                                                                      monkeypatch):
    from qerl.evaluate import main as eval_main
    from qerl.merge import main as merge_main

    adapter_dir = trained[0]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    common = ["--experiment", "x", "--results-dir", str(tmp_path), "--config-json"]
    # an adapter for another model: the NF4 layer's shape comes from its quant state, not its packed bytes
    other = tmp_path / "other_adapter"
    shutil.copytree(adapter_dir, other)
    tensors = load_file(str(other / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("layers.0.self_attn.q_proj.lora_A.weight"))
    tensors[key] = torch.zeros(R, 96)
    save_file(tensors, str(other / "adapter_model.safetensors"))
    line = stage_error_line(capsys, merge_main, ["--base", str(nf4_dir), "--adapter", str(other), "--out",
                                                 str(tmp_path / "m"), *common, "{}"])
    assert "model.layers.0.self_attn.q_proj LoRA maps 96 -> 128 features" in line and "is 128 -> 128" in line

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    line = stage_error_line(capsys, merge_main, ["--base", str(nf4_dir), "--adapter", str(adapter_dir), "--out",
                                                 str(tmp_path / "m"), *common, "{}"])
    assert f"base {nf4_dir} (bitsandbytes NF4): NF4 needs bitsandbytes, which is not installed" in line
    cfg = dict(EVAL_CFG, variants=["quantized_base"])
    line = stage_error_line(capsys, eval_main, ["--trained", str(tmp_path), "--quantized", str(nf4_dir), "--data-dir",
                                                str(data_dir), "--out", str(tmp_path / "e.json"), *common,
                                                json.dumps(cfg)])
    assert f"--quantized {nf4_dir} (bitsandbytes NF4): NF4 needs bitsandbytes" in line
    assert not (tmp_path / "m").exists() and not (tmp_path / "e.json").exists()
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was opened
