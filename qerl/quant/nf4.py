"""NF4 (bitsandbytes 4-bit NormalFloat): the base weights of the QLoRA baseline (paper Tables 1 and 3).

    from qerl.quant.nf4 import dequantized_nf4_state, load_nf4_model, nf4_config, require_nf4
    require_nf4("cuda", "train.mode qlora_nf4")      # one-line QerlError when NF4 cannot run on that device
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4_config(torch.bfloat16), ...)
    model = load_nf4_model("results/exp/quantized", torch.bfloat16, "cuda")   # the quantize stage's output
    state = dequantized_nf4_state("results/exp/quantized")                     # float32 weights, for the merge

QLoRA's recipe (Dettmers et al., 2023): NF4 codes in blocks of 64 weights, the blocks' absmax scales themselves
8-bit quantized in blocks of 256 (double quantization), matmuls computed in `dtype` after dequantizing. bitsandbytes
runs it on CUDA and, from 0.47 on, on CPU (slowly: tiny models and tests). Another device, a missing bitsandbytes or
one without a CPU backend is a one-line error naming the reason.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from qerl.errors import QerlError

MIN_CPU_VERSION = "0.47"  # the first bitsandbytes with NF4 on CPU (its torch-ops backend)
BLOCK_SIZE = 64  # NF4 weights per absmax scale (bitsandbytes' default)


def nf4_config(dtype: torch.dtype):
    """transformers' BitsAndBytesConfig of QLoRA: NF4, double quantization, compute in dtype."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=dtype)


@functools.lru_cache(maxsize=1)
def _cpu_backend_error() -> str | None:
    """None when bitsandbytes quantizes, dequantizes and multiplies NF4 on CPU, else why not (one line)."""
    import bitsandbytes as bnb

    try:
        w = torch.randn(64, 64)
        packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
        bnb.matmul_4bit(torch.randn(2, 64), packed.t(), quant_state=state)
    except Exception as exc:  # noqa: BLE001 - any failure means: no usable CPU backend
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


def require_nf4(device, what: str):
    """bitsandbytes, after checking that it runs NF4 on `device` (cuda or cpu); else a one-line QerlError."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise QerlError(f"{what}: NF4 needs bitsandbytes, which is not installed "
                        f"(pip install 'bitsandbytes>={MIN_CPU_VERSION}')") from None
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise QerlError(f"{what}: device {device!s} asked for but no CUDA GPU is visible")
        return bnb
    if kind != "cpu":
        raise QerlError(f"{what}: bitsandbytes NF4 runs on cuda or cpu, not on device {device!s}")
    error = _cpu_backend_error()
    if error:
        raise QerlError(f"{what}: bitsandbytes {bnb.__version__} has no working CPU NF4 backend ({error}); "
                        f"use a CUDA GPU or bitsandbytes>={MIN_CPU_VERSION}")
    return bnb


def is_nf4_checkpoint(qcfg: dict | None) -> bool:
    """A quantization_config that bitsandbytes wrote for 4-bit NF4 weights."""
    return bool(qcfg) and qcfg.get("quant_method") == "bitsandbytes" and bool(qcfg.get("load_in_4bit")) \
        and qcfg.get("bnb_4bit_quant_type", "fp4") == "nf4"


def prepare_nf4_layers(model: nn.Module, dtype: torch.dtype) -> int:
    """Every bitsandbytes 4-bit layer computes in dtype (a saved checkpoint's own compute dtype would win over
    from_pretrained's), and keeps bitsandbytes' training layout on CPU: on AVX512-BF16 CPUs an eval-mode call
    repacks the weight once for inference and later training forwards then fail (bitsandbytes 0.50: in-place bias
    add on a leaf); the trainer alternates rollouts and updates. Returns the number of layers."""
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.compute_dtype = dtype
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def quantize_linears_nf4(model: nn.Module, dtype: torch.dtype, targets: tuple[str, ...]) -> int:
    """Swap every plain nn.Linear named in targets (the decoder projections) for a bitsandbytes NF4 Linear4bit
    quantized from its weight on the weight's device, as from_pretrained(nf4_config) would; returns the count.
    For models already in memory (the benchmarks' random weights)."""
    bnb = require_nf4(next(model.parameters()).device, "NF4 quantization")
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name not in targets:
                continue
            weight = child.weight.detach()
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
            # Params4bit quantizes when moved to a device; the bf16 weight is freed with `child`
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True,
                                             blocksize=BLOCK_SIZE).to(weight.device)
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.detach(), requires_grad=False)
            setattr(parent, name, layer)
            swapped += 1
    prepare_nf4_layers(model, dtype)
    return swapped


# bitsandbytes' packed non-tensor state (shape, dtype, blocksize, ...) of one stored NF4 layer
NF4_STATE_SUFFIX = ".weight.quant_state.bitsandbytes__nf4"


def load_nf4_model(path, dtype: torch.dtype, device) -> nn.Module:
    """An NF4 checkpoint of the quantize stage (scheme nf4) as transformers + bitsandbytes load it: Linear4bit
    layers computing in dtype on device (cuda, or cpu with bitsandbytes >= 0.47)."""
    from transformers import AutoModelForCausalLM

    require_nf4(device, f"NF4 checkpoint {path}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, device_map={"": torch.device(device)})
    prepare_nf4_layers(model, dtype)
    return model


def dequantized_nf4_state(path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict of an NF4 checkpoint loaded on CPU with every NF4 weight replaced by bitsandbytes'
    dequantize_4bit(W) in dtype: the weights bitsandbytes' forward multiplies by when it computes in dtype."""
    import bitsandbytes as bnb

    model = load_nf4_model(path, dtype, "cpu")
    for layer in model.modules():
        if isinstance(layer, bnb.nn.Linear4bit):
            # bitsandbytes' matmul dequantizes in its input's dtype; dequantize_4bit would round to the stored one
            layer.weight.quant_state.dtype = dtype
    # transformers' dequantize is bitsandbytes' dequantize_4bit per layer, swapping Linear4bit for nn.Linear
    return model.dequantize(dtype=dtype).state_dict()


def stored_nf4_layers(names) -> list[str]:
    """The module names a checkpoint stores as NF4 (those with bitsandbytes' packed quant state)."""
    return sorted(n.removesuffix(NF4_STATE_SUFFIX) for n in names if n.endswith(NF4_STATE_SUFFIX))


def stored_nf4_shape(packed_state: torch.Tensor) -> tuple[int, int]:
    """(out_features, in_features) of a stored NF4 layer from its packed quant state tensor."""
    from bitsandbytes.utils import unpack_tensor_to_dict

    return tuple(unpack_tensor_to_dict(packed_state)["shape"])


def dequantize_stored_nf4(tensors, module: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W of one stored NF4 layer by bitsandbytes' dequantize_4bit in dtype (as its forward in dtype does), from a
    checkpoint's tensors (a mapping with keys() and [name])."""
    import bitsandbytes as bnb

    prefix = f"{module}.weight."
    state = {k.removeprefix(prefix): tensors[k] for k in tensors.keys() if k.startswith(prefix)}
    quant_state = bnb.functional.QuantState.from_dict(state, device=torch.device("cpu"))
    quant_state.dtype = dtype
    return bnb.functional.dequantize_4bit(tensors[f"{module}.weight"], quant_state)
