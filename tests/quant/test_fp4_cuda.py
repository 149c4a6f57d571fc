"""On the GPU: FP4Linear through the Triton dispatch, the loader onto CUDA, a LoRA step (needs only torch,
transformers, peft and triton: the checkpoint is written with qerl's own bit-exact NVFP4 reference)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qerl.quant import dispatch
from qerl.quant.format import quantize_nvfp4
from qerl.quant.linear import FP4Linear

pytestmark = pytest.mark.gpu

QCFG = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                      "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                  "group_size": 16, "symmetric": True, "dynamic": False}}}}


def _write_checkpoint(path, **cfg):
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, num_hidden_layers=2, tie_word_embeddings=True, **cfg)
    model = Qwen2ForCausalLM(config)
    tensors = {}
    for name, t in model.state_dict().items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and isinstance(model.get_submodule(module), torch.nn.Linear) \
                and module != "lm_head":
            tensors[f"{module}.weight_packed"], tensors[f"{module}.weight_scale"], \
                tensors[f"{module}.weight_global_scale"] = quantize_nvfp4(t)
        elif name != "lm_head.weight":
            tensors[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": QCFG}))
    return path


@pytest.mark.parametrize("m", [1, 7, 300])
def test_fp4linear_cuda_uses_triton_and_matches_reference(m):
    assert dispatch._triton() is not None
    dense = torch.nn.Linear(1024, 512).cuda()
    layer = FP4Linear.from_linear(dense).to(torch.bfloat16)  # scales stay FP8/FP32 (FP4Linear._apply)
    w = layer.dequantize_weight(torch.float32)
    x = torch.randn(2, m, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    ref = F.linear(x.detach().float(), w, layer.bias.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad.float(), g.float() @ w, rtol=2e-2, atol=5e-2)


def test_cuda_load_never_holds_dense_weights_and_lora_step(tmp_path):
    from peft import get_peft_model

    from qerl.quant.loader import load_quantized_model
    from qerl.quant.lora import fp4_lora_config

    path = _write_checkpoint(tmp_path / "big", hidden_size=1024, intermediate_size=8192, num_attention_heads=16,
                             num_key_value_heads=4)
    linear_weights = 2 * (1024 * 1024 * 2 + 256 * 1024 * 2 + 3 * 8192 * 1024)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_quantized_model(path, dtype=torch.bfloat16, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    print(f"cuda load peak {peak} bytes vs dense bf16 linears {2 * linear_weights}")
    assert peak < 0.35 * 2 * linear_weights, (peak, 2 * linear_weights)  # packed+scales ~0.28 of bf16

    cpu = load_quantized_model(path, dtype=torch.float32)
    ids = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        a = model(ids.cuda()).logits.float().cpu()
        b = cpu(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()

    peft_model = get_peft_model(model, fp4_lora_config(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]))
    before = {n: t.clone() for n, t in peft_model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    peft_model(ids.cuda()).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    changed = {n for n, t in peft_model.state_dict().items() if not torch.equal(t, before[n])}
    assert changed and all("lora_B" in n for n in changed)
