"""The inverse-CDF draw of the torch engine against one cumulative sum over the row and against its distribution."""
from __future__ import annotations

import pytest
import torch

from qerl.rollout.sampling import draw


def _reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, uniforms.double()[:, None] * cdf[:, -1:], right=True).squeeze(1)


@pytest.mark.parametrize("n", [50, 4096, 5000, 152064])  # one level, and two levels with a padded last block
def test_draw_picks_the_reference_index(n):
    g = torch.Generator().manual_seed(n)
    logits = 3 * torch.randn(64, n, generator=g, dtype=torch.float64)
    probs = torch.softmax(logits, -1)
    u = torch.rand(64, generator=g, dtype=torch.float64)
    for _ in range(20):
        assert torch.equal(draw(probs, u), _reference(probs, u))
        u = torch.rand(64, generator=g, dtype=torch.float64)


def test_zero_mass_entries_are_never_drawn_even_at_u_near_one():
    n = 152064
    probs = torch.zeros(4, n)
    probs[:, 17] = 0.25
    probs[:, 70000] = 0.5
    probs[:, 120001] = 0.25  # everything after it (the last 31 blocks) has no mass
    u = torch.tensor([0.0, 0.3, 0.9, 1 - 2.0**-24])
    assert draw(probs, u).tolist() == [17, 70000, 120001, 120001]


def test_frequencies_follow_the_probabilities():
    n, rows = 5000, 40_000  # two levels; 4 sigma of a frequency estimate is ~0.009
    g = torch.Generator().manual_seed(1)
    probs = torch.zeros(n)
    support = torch.tensor([3, 1500, 4095, 4096, 4999])
    probs[support] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    draws = draw(probs.expand(rows, n), torch.rand(rows, generator=g))
    freq = torch.bincount(draws, minlength=n)[support].double() / draws.numel()
    assert torch.allclose(freq, probs[support].double(), atol=1e-2)
    assert torch.bincount(draws, minlength=n).sum() == torch.bincount(draws, minlength=n)[support].sum()
