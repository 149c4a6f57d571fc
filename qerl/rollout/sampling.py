"""Token sampling and stopping for the torch engine, vectorised over rows (no per-row Python per token).

Sampling is inverse-CDF with one uniform per (row, step) drawn up front from a per-row generator: the
same (seed, row) gives the same sequence whatever else is in the batch, and the decode loop draws
nothing itself. The reported log-prob is always log_softmax(logits / T) over the full vocabulary at the
sampled token (raw logits when greedy), i.e. what the trainer recomputes; top-k / top-p only restrict
which tokens can be drawn.
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def sampling_key(sampling) -> tuple:
    """The sampling knobs a captured decode step bakes in (seeds and max_tokens live in buffers)."""
    return (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)


def row_seed(base_seed: int, row: int) -> int:
    """A well-mixed 64-bit seed for one row (splitmix64 finaliser of seed and row index)."""
    z = (base_seed * 0x9E3779B97F4A7C15 + (row + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_uniforms(base_seed: int, first_row: int, num_rows: int, steps: int, device) -> torch.Tensor:
    """(num_rows, steps) uniforms in [0, 1); row r uses the generator of row first_row + r."""
    out = torch.empty(num_rows, steps, dtype=torch.float32)
    for r in range(num_rows):
        gen = torch.Generator().manual_seed(row_seed(base_seed, first_row + r))
        out[r] = torch.rand(steps, generator=gen)
    return out.to(device)


def sample_tokens(logits: torch.Tensor, sampling, uniforms: torch.Tensor | None):
    """Next token per row and its log-prob. logits: (rows, vocab) float32; uniforms: (rows,) or None if greedy."""
    if sampling.greedy:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        tok = _inverse_cdf(logp, uniforms, sampling.top_k, sampling.top_p)
    return tok, logp.gather(-1, tok[:, None]).squeeze(1)


def _inverse_cdf(logp: torch.Tensor, uniforms: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Draw from softmax restricted to the top-k, then to the smallest top-p nucleus (as HF's warpers)."""
    probs, order = logp.exp(), None
    if 0 < top_k < probs.shape[-1]:
        probs, order = probs.topk(top_k, dim=-1)  # sorted, largest first
    elif top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
    if top_p < 1.0:
        cum = probs.cumsum(dim=-1)
        # keep a token while the mass strictly before it is below top_p (the first token always stays)
        probs = probs.masked_fill(cum - probs >= top_p * cum[:, -1:], 0.0)
    pick = draw(probs, uniforms)[:, None]
    return pick.squeeze(1) if order is None else order.gather(-1, pick).squeeze(1)


_BLOCK = 1024  # the two-level draw: block masses first, then one block's cumulative sum


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index whose cdf exceeds target (right=True): an entry of non-zero mass. The target is kept below the
    total so that rounding (u * total == total) cannot run past the last such entry."""
    target = torch.minimum(target, cdf[:, -1:] * (1 - 2.0**-20)).clamp_min(0)
    return torch.searchsorted(cdf, target, right=True).clamp_max(cdf.shape[-1] - 1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one index per row from unnormalised probs (rows, n) with uniforms (rows,) in [0, 1).

    Long rows (a vocabulary) go in two levels: cumulative sums within blocks of 1024, cumulative block masses pick
    the block, that block's cumulative sum picks the entry. The same index as one cumulative sum over the row (up
    to rounding at interval ends), at a fraction of the cost: torch's scan over 152k entries per row took 0.2 ms
    of each decode step."""
    rows, n = probs.shape
    if n <= 4 * _BLOCK:
        cdf = probs.cumsum(dim=-1)
        return _search(cdf, uniforms[:, None] * cdf[:, -1:]).squeeze(1)
    nb = -(-n // _BLOCK)
    # cumulative sums within blocks: many short scans run in parallel, and each row's numbers do not depend on
    # how many rows there are (a sum() reduction may split differently by shape), so draws stay per-row
    inner = torch.nn.functional.pad(probs, (0, nb * _BLOCK - n)).view(rows, nb, _BLOCK).cumsum(-1)
    mass = inner[:, :, -1]
    block_cdf = mass.cumsum(-1)
    target = uniforms[:, None] * block_cdf[:, -1:]
    blk = _search(block_cdf, target)
    before = block_cdf.gather(-1, blk) - mass.gather(-1, blk)
    inner = inner.gather(1, blk[:, :, None].expand(rows, 1, _BLOCK)).squeeze(1)
    return (blk * _BLOCK + _search(inner, target - before)).squeeze(1).clamp_max(n - 1)


class StopChecker:
    """Which rows ended with this step's token: an EOS id, or a stop string completed in the decoded tail.

    Only the last few tokens of each row are decoded (enough to hold the longest stop string), so the
    cost per step does not grow with the completion length.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], eos_ids, device):
        self.tokenizer, self.stop = tokenizer, stop
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=device)
        self.window = 2 * max((len(s) for s in stop), default=0) + 2

    def __call__(self, tok: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        done = torch.isin(tok, self.eos)
        if self.stop:
            tails = tokens[rows, max(0, step + 1 - self.window):step + 1].tolist()
            texts = self.tokenizer.batch_decode(tails, skip_special_tokens=False)
            hits = [any(s in text for s in self.stop) for text in texts]
            done |= torch.tensor(hits, dtype=torch.bool, device=done.device)
        return done
