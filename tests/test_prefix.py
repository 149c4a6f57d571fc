"""Shared-prefix log-probs equal the plain per-row computation (values and LoRA gradients)."""
from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from qerl.grpo import token_logprobs
from qerl.prefix import grouped_token_logprobs


def _batch(g: int, pad: int = 0):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 1000, (n,), generator=gen) for n in (5, 9)]
    comps = [torch.randint(10, 1000, (n,), generator=gen) for n in (4, 1, 3, 4, 2, 4)][: 2 * g]
    plen, clen = 9, 4
    p_ids = torch.full((2, plen), pad)
    p_mask = torch.zeros((2, plen), dtype=torch.long)
    for i, p in enumerate(prompts):
        p_ids[i, plen - len(p):], p_mask[i, plen - len(p):] = p, 1
    c_ids = torch.full((2 * g, clen), pad)
    c_mask = torch.zeros((2 * g, clen), dtype=torch.long)
    for i, c in enumerate(comps):
        c_ids[i, :len(c)], c_mask[i, :len(c)] = c, 1
    return p_ids, p_mask, c_ids, c_mask


def test_grouped_equals_plain_values_and_grads(tiny_model_dir):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False))
    g = 3
    p_ids, p_mask, c_ids, c_mask = _batch(g)
    full_ids = torch.cat([p_ids.repeat_interleave(g, 0), c_ids], 1)
    full_mask = torch.cat([p_mask.repeat_interleave(g, 0), c_mask], 1)

    lp_ref, ent_ref = token_logprobs(model, full_ids, full_mask, c_ids.shape[1], temperature=0.7, chunk_size=5)
    (lp_ref * c_mask).sum().backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    lp, ent = grouped_token_logprobs(model, p_ids, p_mask, c_ids, c_mask, g, temperature=0.7, chunk_size=5)
    (lp * c_mask).sum().backward()
    m = c_mask.bool()
    torch.testing.assert_close(lp[m], lp_ref[m], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[m], ent_ref[m], rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads_ref[n], rtol=1e-4, atol=1e-6)
    assert any(v.abs().sum() > 0 for v in grads_ref.values())
