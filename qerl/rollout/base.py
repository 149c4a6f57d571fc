"""The rollout contract shared by every engine: sampling knobs in, token ids + log-probs out.

The trainer only ever talks to `RolloutEngine.policy_rollout` (the current policy under a rollout's AQN noise,
then `generate`) and `sleep`, so the torch and paged engines (the very modules being trained, CPU or GPU) and the
vLLM engine (its own copy of the weights) are interchangeable via `make_engine`:

    engine = make_engine("torch", model, tokenizer)
    out = engine.generate(prompt_ids, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256))
    out.completion_ids[i * 8 + j]   # sample j of prompt i (prompt-major rows)
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from qerl.errors import QerlError

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-named sampling knobs. temperature == 0 means greedy; top_k == 0 and top_p == 1 disable filtering.

    `seed` makes a call reproducible: row r of a call draws from its own generator seeded from (seed, r),
    so a sequence does not change when other prompts are added to or removed from the batch. `first_row`
    numbers the call's rows from there (row r draws as row first_row + r): a data-parallel rank generating rows
    [k, k + n) of a step draws exactly what one process generating all of them would.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    first_row: int = 0

    def __post_init__(self):
        if isinstance(self.stop, str):  # a lone string would otherwise be read as a tuple of characters
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise QerlError(f"SamplingParams.temperature: expected a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise QerlError(f"SamplingParams.top_p: expected a number in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise QerlError(f"SamplingParams.top_k: expected an int >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise QerlError(f"SamplingParams.max_tokens: expected an int >= 1, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise QerlError(f"SamplingParams.stop: expected non-empty strings, got {self.stop!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and self.seed >= 0):
            raise QerlError(f"SamplingParams.seed: expected None or an int >= 0, got {self.seed!r}")
        if not (isinstance(self.first_row, int) and self.first_row >= 0):
            raise QerlError(f"SamplingParams.first_row: expected an int >= 0, got {self.first_row!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutOutput:
    """len(prompts) * n rows, prompt-major: row i*n + j is sample j of prompt i.

    completion_ids include the token that ended the sequence (EOS, or the token completing a stop
    string), because the policy must learn to emit it. logprobs[r][t] = log_softmax(logits / T) at
    completion_ids[r][t] (raw logits when T == 0), the behaviour log-probs used for importance weights.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    stats: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        rows = len(self.prompt_ids)
        if not (len(self.completion_ids) == len(self.logprobs) == len(self.finish_reasons) == rows):
            raise QerlError(
                f"RolloutOutput: expected {rows} rows in completion_ids/logprobs/finish_reasons, got "
                f"{len(self.completion_ids)}/{len(self.logprobs)}/{len(self.finish_reasons)}")
        for r, (ids, lps) in enumerate(zip(self.completion_ids, self.logprobs)):
            if len(ids) != len(lps):
                raise QerlError(f"RolloutOutput row {r}: {len(ids)} completion ids but {len(lps)} logprobs")

    @property
    def num_tokens(self) -> int:
        """Generated tokens over all rows (what tokens/s is measured in)."""
        return sum(len(ids) for ids in self.completion_ids)

    def texts(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Decoded completions, one per row, for the reward functions."""
        return tokenizer.batch_decode(self.completion_ids, skip_special_tokens=skip_special_tokens)


class RolloutEngine(ABC):
    """Anything that turns prompts into n sampled completions each, with the sampled tokens' log-probs."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int = 1,
                 sampling: SamplingParams | None = None) -> RolloutOutput:
        """Sample n completions per prompt; see RolloutOutput for the row layout."""

    def policy_rollout(self, model, prompt_ids: list[list[int]], n: int, sampling: SamplingParams | None,
                       sigma: float = 0.0, generator=None) -> tuple[RolloutOutput, dict[str, float]]:
        """generate() from `model`'s current weights with this rollout's AQN noise (sigma, drawn from `generator`:
        the same vector whichever engine applies it); returns the output and the noise actually applied
        (aqn/applied_rms, aqn/changed_fraction). This default is for engines that run the very modules being
        trained: the noise goes onto the RMSNorm scales in place and the clean values come back after. An engine
        holding its own copy of the weights overrides it to push the adapter and the noise first."""
        from qerl.aqn import aqn_noise

        with aqn_noise(model, sigma, generator) as noise:
            out = self.generate(prompt_ids, n=n, sampling=sampling)
        return out, {"aqn/applied_rms": noise.applied_rms, "aqn/changed_fraction": noise.changed_fraction}

    def sleep(self) -> None:
        """Give memory the update needs back after a rollout (a KV pool, vLLM's weights); generate() takes it again.
        No-op by default."""

    def close(self) -> None:
        """Free engine resources (caches, compiled graphs, worker processes). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_prompts(prompt_ids, n: int) -> list[list[int]]:
    """Validate the generate() arguments every engine receives; returns the prompts as lists of ints."""
    if not isinstance(n, int) or n < 1:
        raise QerlError(f"generate: n must be an int >= 1, got {n!r}")
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise QerlError("generate: prompt_ids must be a non-empty list of token-id lists")
    out = []
    for i, ids in enumerate(prompt_ids):
        ids = [int(t) for t in ids]
        if not ids:
            raise QerlError(f"generate: prompt_ids[{i}] is empty; every prompt needs at least one token")
        out.append(ids)
    return out
