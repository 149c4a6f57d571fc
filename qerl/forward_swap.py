"""Instance-level forward swaps that can be undone (used by qerl.tiled_mlp and qerl.fused_elementwise).

    swap_forward(module, "_my_marker", new_forward)   # module.forward = new_forward; the old one kept under the marker
    restore_forward(module, "_my_marker")             # back to what it was: an instance forward, or the class's
    with class_forwards(modules): ...                  # swapped modules run their class's forward meanwhile

The swaps made here are training paths that call the original forward whenever autograd is off.
"""
from __future__ import annotations

import contextlib

from torch import nn

_MARKERS: set[str] = set()  # every marker a swap used (its modules hold (original forward, was an instance forward))


def swap_forward(module: nn.Module, marker: str, forward) -> None:
    _MARKERS.add(marker)
    setattr(module, marker, (module.forward, "forward" in vars(module)))
    module.forward = forward


def restore_forward(module: nn.Module, marker: str) -> None:
    original, instance_forward = getattr(module, marker)
    delattr(module, marker)
    if instance_forward:
        module.forward = original
    else:
        del module.forward


@contextlib.contextmanager
def class_forwards(modules):
    """Modules whose swapped forwards sit on top of their class's forward run that forward for the duration.
    For code without autograd (a rollout's decode step) the result is the same, and torch.compile guards on each
    instance's own forward object: compiled decoder layers would otherwise recompile once per layer."""
    hidden = []
    for m in modules:
        chain = [vars(m)[k] for k in _MARKERS if k in vars(m)]
        if "forward" in vars(m) and chain and any(not was_instance for _, was_instance in chain):
            hidden.append((m, vars(m)["forward"]))
            del m.forward
    try:
        yield
    finally:
        for m, forward in hidden:
            m.forward = forward
