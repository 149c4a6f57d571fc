"""LoRA weights used in another dtype during a rollout call than the one they train in (fp32 adapters, bf16 rollout).

Shared by the static and the paged engine: the copies persist, so a captured CUDA graph keeps reading one address.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def lora_in_dtype(model, dtype: torch.dtype | None, shadows: dict):
    """Swap every LoRA Linear weight that is not in `dtype` for a same-shape copy in it (refreshed from the
    trained weight now), and put the trained weights back afterwards (dtype None: nothing). The copies persist in
    `shadows` (id(weight) -> copy) across calls, so a captured decode graph keeps reading the same addresses."""
    swapped = []
    if dtype is not None:
        for module in model.modules():
            if not (hasattr(module, "lora_A") and hasattr(module, "lora_B")):
                continue
            for linear in (*module.lora_A.values(), *module.lora_B.values()):
                weight = linear.weight
                if weight.dtype == dtype or not weight.is_floating_point():
                    continue
                shadow = shadows.get(id(weight))
                if shadow is None or shadow.shape != weight.shape or shadow.device != weight.device:
                    shadow = torch.nn.Parameter(torch.empty(weight.shape, dtype=dtype, device=weight.device),
                                                requires_grad=False)
                    shadows[id(weight)] = shadow
                with torch.no_grad():
                    shadow.copy_(weight)
                linear.weight = shadow
                swapped.append((linear, weight))
    try:
        yield
    finally:
        for linear, weight in swapped:
            linear.weight = weight
