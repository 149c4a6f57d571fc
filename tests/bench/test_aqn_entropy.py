"""AQN entropy bench: the entropy it reports equals a full-logits reference on the same sampled tokens."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.aqn_entropy import rollout_entropy
from qerl.rollout import SamplingParams
from qerl.rollout.torch_engine import TorchEngine


def test_rollout_entropy_matches_full_logits_reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok("What is 7 - 3?")["input_ids"], tok("Hi")["input_ids"]]
    got = rollout_entropy(model, tok, prompts, sigma=0.0, seed=3, n=2, temperature=0.9, max_tokens=5)

    out = TorchEngine(model, tok).generate(prompts, n=2, sampling=SamplingParams(temperature=0.9, max_tokens=5,
                                                                                 seed=3))
    ents = []
    with torch.no_grad():
        for p, c in zip(out.prompt_ids, out.completion_ids):
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1].double() / 0.9
            logp = logits.log_softmax(-1)
            ents.extend((-(logp.exp() * logp).sum(-1)).tolist())
    assert abs(got - sum(ents) / len(ents)) < 1e-4
    noisy = rollout_entropy(model, tok, prompts, sigma=0.5, seed=3, n=2, temperature=0.9, max_tokens=5)
    assert noisy != got
