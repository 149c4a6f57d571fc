"""Adaptive Quantization Noise (QeRL, arXiv 2510.11696): a staged sigma schedule and the RMSNorm noise context.

The paper turns quantization noise into exploration: before each rollout a fresh N(0, sigma^2) vector per channel
is added to every decoder layer's RMSNorm scales (input_layernorm, post_attention_layernorm), which acts like a
row-wise multiplicative perturbation of the following linear layers' inputs. The update uses clean weights.

    sigma = aqn_sigma(step, total_steps, sigma_start=1e-2, sigma_end=5e-4, num_stages=10)
    with aqn_noise(model, sigma, generator) as noise:     # noise.noise: {checkpoint name: vector}
        out = engine.generate(...)                          # rollout sees the noisy scales
    # here the clean scales are back, bit for bit
"""
from __future__ import annotations

import math

import torch

from qerl.errors import QerlError

SCHEDULES = ("exponential", "linear", "cosine", "constant", "none")
NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
_PEFT_PREFIX = "base_model.model."


# ------------------------------------------------------------------------------------------- schedule
def aqn_stage(step: int, total_steps: int, num_stages: int) -> int:
    """Stage k in [0, K-1] of `step`: K equal stages over total_steps, i.e. floor(step * K / total_steps).

    Same partition as the original code's `step // (total_steps / K)`, computed in integers so a boundary never
    moves by float rounding; steps past the end stay in the last stage.
    """
    if total_steps < 1:
        raise QerlError(f"aqn total_steps must be >= 1, got {total_steps}")
    if num_stages < 2:
        raise QerlError(f"aqn num_stages must be >= 2 (stage 0 is noise-free), got {num_stages}")
    if step < 0:
        raise QerlError(f"aqn step must be >= 0, got {step}")
    return min(min(step, total_steps) * num_stages // total_steps, num_stages - 1)


def _stage_fraction(stage: int, num_stages: int) -> float:
    """Position of a noisy stage k in 1..K-1 along the schedule: (k-1)/(K-2); 0 when there is one noisy stage."""
    return 0.0 if num_stages == 2 else (stage - 1) / (num_stages - 2)


def aqn_sigma(step: int, total_steps: int, *, sigma_start: float, sigma_end: float, num_stages: int,
              schedule: str = "exponential") -> float:
    """Noise std at `step`. Stage 0 is always noise-free (the policy first learns the format unperturbed).

    exponential (paper): sigma_start * (sigma_end / sigma_start) ** ((k-1)/(K-2)) for stages k = 1..K-1;
    linear / cosine: the same end points, interpolated linearly / by half a cosine over stages 1..K-1;
    constant: sigma_start in every stage after stage 0 (keeps the paper's clean first stage, so the ablation
    differs from the paper's schedule only by the decay); none: 0 everywhere.
    """
    if schedule not in SCHEDULES:
        raise QerlError(f"aqn schedule must be one of {SCHEDULES}, got {schedule!r}")
    stage = aqn_stage(step, total_steps, num_stages)
    if schedule == "none":
        return 0.0
    if not (sigma_start > 0 and sigma_end > 0 and math.isfinite(sigma_start) and math.isfinite(sigma_end)):
        raise QerlError(f"aqn sigma_start and sigma_end must be finite and > 0, got {sigma_start}, {sigma_end}")
    if stage == 0:
        return 0.0
    frac = _stage_fraction(stage, num_stages)
    if schedule == "exponential":
        return sigma_start * (sigma_end / sigma_start) ** frac
    if schedule == "linear":
        return sigma_start + (sigma_end - sigma_start) * frac
    if schedule == "cosine":
        return sigma_end + (sigma_start - sigma_end) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return sigma_start


# ------------------------------------------------------------------------------------------------ noise
def rmsnorm_noise_targets(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """[(checkpoint name, weight)] of every decoder layer's input_layernorm and post_attention_layernorm.

    Names are the plain HF checkpoint keys (peft's `base_model.model.` prefix removed), e.g.
    `model.layers.0.input_layernorm.weight`, so an engine holding its own copy (vLLM) can match them. Through
    peft's modules_to_save wrapper, `.weight` is the active (trainable) copy, which is the one forward uses.
    """
    targets, seen = [], set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in NORM_NAMES:
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or id(weight) in seen:
            continue
        seen.add(id(weight))
        name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        targets.append((f"{name}.weight", weight))
    if not targets:
        raise QerlError(f"model {type(model).__name__}: no decoder-layer RMSNorm weights named {NORM_NAMES} "
                        "(expected a Qwen2/Llama-style transformers model) for AQN")
    return targets


def sample_noise(shapes: dict[str, tuple[int, ...] | torch.Size], sigma: float,
                 generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Fresh N(0, sigma^2) float32 CPU tensors, one per name, drawn in the given order from `generator`.

    Drawing on the CPU makes the vectors identical for a seed whatever device or engine applies them.
    """
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise QerlError(f"aqn sigma must be finite and >= 0, got {sigma}")
    return {name: torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * sigma
            for name, shape in shapes.items()}


class RMSNormNoise:
    """Context manager: add fresh noise to the RMSNorm scales on entry, restore the exact clean values on exit.

    Restoring copies back clones taken on entry (subtracting the noise again would not be bit-exact in bf16), so
    noise never accumulates across rollouts, also when the body raises. `noise` holds the sampled float32
    vectors; `applied_rms` the RMS of the change actually made, after rounding to the weights' dtype, and
    `changed_fraction` the share of channels that changed at all (bf16 rounds most perturbations much smaller
    than its spacing, 2^-8..2^-7 near 1.0, away: these show it). sigma 0 changes nothing.
    """

    def __init__(self, model: torch.nn.Module, sigma: float, generator: torch.Generator | None = None):
        self.model, self.sigma, self.generator = model, float(sigma), generator
        self.noise: dict[str, torch.Tensor] = {}
        self.applied_rms = 0.0
        self.changed_fraction = 0.0
        self._saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def __enter__(self) -> "RMSNormNoise":
        if self.sigma == 0:
            return self
        targets = rmsnorm_noise_targets(self.model)
        self.noise = sample_noise({n: p.shape for n, p in targets}, self.sigma, self.generator)
        sq, changed, count = 0.0, 0, 0
        with torch.no_grad():
            for name, param in targets:
                clean = param.detach().clone()
                self._saved.append((param, clean))
                param.add_(self.noise[name].to(device=param.device, dtype=param.dtype))
                delta = param.detach().float() - clean.float()
                sq += delta.pow(2).sum().item()
                changed += int((delta != 0).sum().item())
                count += param.numel()
        self.applied_rms, self.changed_fraction = math.sqrt(sq / count), changed / count
        return self

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for param, clean in self._saved:
                param.copy_(clean)
        self._saved = []


def aqn_noise(model: torch.nn.Module, sigma: float, generator: torch.Generator | None = None) -> RMSNormNoise:
    """`with aqn_noise(model, sigma, generator) as n:` — the rollout inside sees noisy RMSNorm scales."""
    return RMSNormNoise(model, sigma, generator)
