"""Random-weight Qwen2.5 models of the real shapes, built directly on the target device, for speed/memory benches.

    from bench.random_models import build_random_model, attach_lora
    model = build_random_model("7B", fp4=True, device="cuda", dtype=torch.bfloat16)   # no bf16 copy ever exists
    model = attach_lora(model, r=32, alpha=64, fp4=True, gradient_checkpointing=True)

Speed and memory do not depend on the weight values, so nothing is downloaded or quantized: FP4 models are
built on the meta device with FP4Linear swapped in (the quantized loader's own skeleton), then every tensor is
allocated on the device and filled with random packed bytes and plausible FP8 group scales (dequantized weights
of std ~0.02, like HF's init), so sampling never sees NaN/inf logits. Embeddings, norms and lm_head stay dense
(lm_head is in the NVFP4 recipe's ignore list).
"""
from __future__ import annotations

import torch
from torch import nn

from qerl.errors import QerlError
from qerl.quant.linear import FP4Linear

# Public Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab); "tiny" is for CPU smoke tests.
QWEN25_SHAPES = {
    "7B": (3584, 18944, 28, 28, 4, 152064),
    "14B": (5120, 13824, 48, 40, 8, 152064),
    "32B": (5120, 27648, 64, 40, 8, 152064),
    "tiny": (128, 256, 2, 2, 1, 152064),
}
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INIT_STD = 0.02
_E2M1_RMS = 2.93  # rms of E2M1 values over uniformly random codes
_SCALE_RANGE = (128.0, 256.0)  # FP8 group scales drawn uniformly here (exactly representable range)


def qwen25_config(size: str, **overrides):
    """A transformers Qwen2Config with the public shapes of Qwen2.5-`size` (untied embeddings for 7B+)."""
    from transformers import Qwen2Config

    if size not in QWEN25_SHAPES:
        raise QerlError(f"size: expected one of {list(QWEN25_SHAPES)}, got {size!r}")
    hidden, inter, layers, heads, kv, vocab = QWEN25_SHAPES[size]
    kw = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
              num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=32768, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
              pad_token_id=151643, attn_implementation="sdpa")
    kw.update(overrides)
    return Qwen2Config(**kw)


def _fill_fp4(layer: FP4Linear, gen: torch.Generator) -> None:
    """Random codes, FP8 scales in _SCALE_RANGE and a global scale giving dequantized std ~_INIT_STD."""
    layer.weight_packed.random_(0, 256, generator=gen)
    lo, hi = _SCALE_RANGE
    scale = torch.empty(layer.weight_scale.shape, device=layer.weight_scale.device)
    layer.weight_scale.copy_(scale.uniform_(lo, hi, generator=gen).to(torch.float8_e4m3fn))
    layer.weight_global_scale.fill_(_E2M1_RMS * (lo + hi) / 2 / _INIT_STD)
    if layer.bias is not None:
        layer.bias.data.normal_(0.0, _INIT_STD, generator=gen)


def _fill_dense(module: nn.Module, gen: torch.Generator) -> None:
    """Norm scales = 1, every other dense parameter ~ N(0, 0.02) (HF's Qwen2 init)."""
    for name, p in module.named_parameters(recurse=False):
        if "norm" in type(module).__name__.lower():
            p.data.fill_(1.0)
        elif name == "bias":
            p.data.zero_()
        else:
            p.data.normal_(0.0, _INIT_STD, generator=gen)


def _recompute_buffers(model: nn.Module) -> None:
    """Rotary inv_freq and other computed, non-persistent buffers: let transformers' init recompute them."""
    for name, _ in list(model.named_non_persistent_buffers()):
        owner_name = name.rpartition(".")[0]
        model._init_weights(model.get_submodule(owner_name) if owner_name else model)


def _fp4_skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model on meta with every decoder Linear an FP4Linear (the quantized loader's own skeleton)."""
    from qerl.quant.loader import _build_skeleton

    qcfg = {"config_groups": {"group_0": {"weights": {"num_bits": 4}, "targets": ["Linear"]}},
            "ignore": ["lm_head"]}
    model, _ = _build_skeleton(config, qcfg, "nvfp4", dtype)
    return model


def build_random_model(size_or_config, *, fp4: bool, device="cuda", dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0) -> nn.Module:
    """A random Qwen2.5-shaped causal LM on `device`: FP4Linear decoder weights (fp4=True) or all dense."""
    from transformers import AutoModelForCausalLM

    config = qwen25_config(size_or_config) if isinstance(size_or_config, str) else size_or_config
    gen = torch.Generator(device=device).manual_seed(seed)
    if fp4:
        model = _fp4_skeleton(config, dtype).to_empty(device=device)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FP4Linear):
                _fill_fp4(module, gen)
            else:
                _fill_dense(module, gen)
        _recompute_buffers(model)
    model.requires_grad_(False)
    return model.eval()


def attach_lora(model: nn.Module, *, r: int = 32, alpha: int = 64, fp4: bool,
                gradient_checkpointing: bool = True, fused: bool = True) -> nn.Module:
    """peft LoRA on every decoder Linear (the trainer's default targets), as qerl.policy.load_policy does
    (fused: qerl.fused_lora's training path, False: peft's own ops)."""
    from peft import LoraConfig, get_peft_model

    from qerl.fused_lora import register_fused_lora, set_fused
    from qerl.quant.lora import register_fp4_lora

    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(LINEAR_TARGETS),
                        bias="none", task_type="CAUSAL_LM")
    if fp4:
        register_fp4_lora(config)
    register_fused_lora(config)
    model = get_peft_model(model, config).train()
    set_fused(model, fused)
    return model


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes one decode step must read from weights: every parameter and FP4 buffer except the input
    embedding (a decode step reads only the rows of the tokens it feeds)."""
    embed = model.get_input_embeddings()
    skip = {id(t) for t in embed.parameters()}
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    for module in model.modules():
        if isinstance(module, FP4Linear):
            total += sum(b.numel() * b.element_size() for b in
                         (module.weight_packed, module.weight_scale, module.weight_global_scale))
    return total


def kv_bytes_per_step(config, rows: int, cache_len: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """KV-cache bytes one decode step reads when attention spans `cache_len` positions of every row."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return rows * cache_len * per_token * torch.empty(0, dtype=dtype).element_size()


def paged_attention_case(rows, heads, kv_heads, head_dim, block_size, lengths, dtype, device, seed=0):
    """Paged decode attention inputs (q, k_cache, v_cache, block_table, context_lens): a shuffled pool (blocks of a
    row are scattered, block 0 unused) and rows of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(need) + 3
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, width = [], max(need) + 1  # one spare column: the kernel must stop at the length, not the width
    for n in need:
        tables.append(perm[:n] + [0] * (width - n))
        perm = perm[n:]
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(device, dtype)
    table = torch.tensor(tables, dtype=torch.int32, device=device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return q, k, v, table, lens
