"""Token-tiled decoder MLPs (qerl.tiled_mlp): the untiled outputs and gradients, less memory held in backward."""
from __future__ import annotations

import weakref

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, Qwen2Config

from qerl.tiled_mlp import decoder_mlps, tile_mlps

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(ids).logits.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("chunks,tokens", [(3, 10), (4, 16), (8, 5)])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(tiny_model_dir, chunks, tokens):
    torch.manual_seed(0)
    model = _lora_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32))
    ids = torch.randint(0, 1000, (2, tokens))
    ref_loss, ref_grads = _loss_and_grads(model, ids)
    assert tile_mlps(model, chunks) == 2
    calls = []
    mlp = decoder_mlps(model)[0]
    handle = mlp.down_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2]))
    loss, grads = _loss_and_grads(model, ids)
    handle.remove()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7)
    assert max(calls) < tokens, f"the MLP saw whole sequences ({calls})"  # it really ran in slices
    with torch.no_grad():  # inference: one call over all tokens
        calls.clear()
        handle = mlp.down_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2]))
        model(ids)
        handle.remove()
    assert calls == [tokens]
    assert tile_mlps(model, 1) == 2 and "forward" not in vars(mlp)  # back to the class's forward


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of CPU tensor storages created inside the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def _free(self, key):
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


def test_tiled_mlp_lowers_the_peak_of_a_checkpointed_update():
    """A wide MLP (intermediate 16 x hidden): its (tokens, intermediate) tensors dominate the backward peak, and
    four slices hold a quarter of them."""
    cfg = Qwen2Config(hidden_size=64, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024)
    ids = torch.randint(0, 256, (1, 512))
    peaks = {}
    for chunks in (1, 4):
        torch.manual_seed(0)
        model = _lora_model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))
        tile_mlps(model, chunks)
        model.train()
        with _LiveBytes() as mode:
            model(ids).logits.float().square().mean().backward()
        peaks[chunks] = mode.peak
    one_tensor = 512 * 1024 * 4  # one (tokens, intermediate) fp32 tensor: 2 MiB
    assert peaks[4] < peaks[1] - 2 * one_tensor, peaks


def test_untiling_puts_back_an_instance_forward(tiny_model_dir):
    """A forward set on the instance before tiling (as accelerate's hooks do) is what untiling restores."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    mlp = decoder_mlps(model)[0]
    seen = []

    def hooked(x, _inner=mlp.forward):
        seen.append(x.shape)
        return _inner(x)

    mlp.forward = hooked
    tile_mlps(model, 2)
    tile_mlps(model, 3)  # re-tiling keeps the hook underneath
    x = torch.randn(1, 6, model.config.hidden_size, requires_grad=True)
    mlp(x).sum().backward()
    assert seen and max(s[-2] for s in seen) == 2  # the hook ran on 3 slices of 2 tokens
    tile_mlps(model, 1)
    assert vars(mlp)["forward"] is hooked
