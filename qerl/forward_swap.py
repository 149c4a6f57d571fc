"""Instance-level forward swaps that can be undone (used by qerl.tiled_mlp and qerl.fused_elementwise).

    swap_forward(module, "_my_marker", new_forward)   # module.forward = new_forward; the old one kept under the marker
    restore_forward(module, "_my_marker")             # back to what it was: an instance forward, or the class's
"""
from __future__ import annotations

from torch import nn


def swap_forward(module: nn.Module, marker: str, forward) -> None:
    setattr(module, marker, (module.forward, "forward" in vars(module)))
    module.forward = forward


def restore_forward(module: nn.Module, marker: str) -> None:
    original, instance_forward = getattr(module, marker)
    delattr(module, marker)
    if instance_forward:
        module.forward = original
    else:
        del module.forward
