"""load_policy: what trains in each mode, checked by one real optimizer step."""
from __future__ import annotations

import pytest
import torch

from qerl.errors import QerlError
from qerl.policy import LoraSpec, load_policy, trainable_parameter_names
from qerl.quant.linear import FP4Linear

IDS = torch.tensor([[5, 77, 1000, 31, 2, 640, 9, 12], [8, 1, 300, 4000, 12, 6, 90, 3]])


def _step_and_diff(model) -> set[str]:
    """Names of parameters AND buffers whose values changed after one AdamW step on a toy loss."""
    before = {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    loss = model(input_ids=IDS).logits.float().log_softmax(-1)[..., 0].mean()
    loss.backward()
    opt.step()
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    return {n for n, t in before.items() if not torch.equal(t, after[n].detach())}


@pytest.mark.parametrize("train_norms", [False, True])
def test_qlora_fp4_step_changes_only_lora_and_norms(nvfp4_dir, train_norms):
    torch.manual_seed(0)
    model, tok = load_policy(nvfp4_dir, mode="qlora_fp4", lora=LoraSpec(r=4, alpha=8), train_norms=train_norms)
    assert tok.pad_token is not None and model.training
    assert sum(isinstance(m, FP4Linear) for m in model.modules()) == 14
    names = trainable_parameter_names(model)
    lora = {n for n in names if "lora_" in n}
    norms = {n for n in names if "norm" in n}
    assert len(lora) == 28 and set(names) == lora | norms
    assert len(norms) == (5 if train_norms else 0)  # 2 per layer + final norm
    changed = _step_and_diff(model)
    # LoRA B starts at zero, so step 1 moves every B (A's gradient is B^T(...) = 0)
    assert {n for n in lora if "lora_B" in n} <= changed
    assert changed <= lora | norms
    assert (norms <= changed) if train_norms else not (changed & norms)


def test_lora_mode_on_dense_base_and_full_mode(tiny_model_dir):
    model, _ = load_policy(tiny_model_dir, mode="lora", lora=LoraSpec(r=2, alpha=4, target_modules=("q_proj",)))
    changed = _step_and_diff(model)
    assert changed and all("lora_B" in n for n in changed)

    model, _ = load_policy(tiny_model_dir, mode="full")
    names = trainable_parameter_names(model)
    assert names == [n for n, _ in model.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in _step_and_diff(model)


def test_gradient_checkpointing_gives_the_same_gradients(nvfp4_dir):
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        model, _ = load_policy(nvfp4_dir, mode="qlora_fp4", lora=LoraSpec(r=4, alpha=8), train_norms=True,
                               gradient_checkpointing=ckpt)
        assert model.base_model.model.is_gradient_checkpointing == ckpt
        model(input_ids=IDS).logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7)


def test_mode_and_checkpoint_mismatches_are_one_line_errors(tiny_model_dir, nvfp4_dir):
    spec = LoraSpec(r=2, alpha=4)
    cases = [
        (dict(model_path=tiny_model_dir, mode="qlora_fp4", lora=spec), "no quantization_config"),
        (dict(model_path=nvfp4_dir, mode="lora", lora=spec), "is a quantized checkpoint"),
        (dict(model_path=tiny_model_dir, mode="dora", lora=spec), "mode: 'dora'"),
        (dict(model_path=tiny_model_dir, mode="lora"), "needs a LoraSpec"),
        (dict(model_path=tiny_model_dir, mode="full", lora=spec), "leave lora unset"),
    ]
    for kwargs, match in cases:
        path = kwargs.pop("model_path")
        with pytest.raises(QerlError, match=match) as err:
            load_policy(path, **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(QerlError, match="lora.r"):
        LoraSpec(r=0, alpha=1)
