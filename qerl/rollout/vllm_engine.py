"""vLLM rollout engine: the serving engine samples, the trainer's LoRA adapter and AQN noise are pushed to it each step.

vLLM keeps its own copy of the base weights (the compressed-tensors NVFP4 checkpoint on GPU; a bf16/fp32 one on CPU,
where vLLM has no FP4 kernel), so two things must be synchronised before every rollout:

    engine = VLLMEngine(model, tokenizer, model_path="results/demo/quantized")
    engine.update_policy(model, noise)   # new adapter id per step + noise written into vLLM's OWN RMSNorm weights
    out = engine.generate(prompt_ids, n=8, sampling=SamplingParams(temperature=1.0, max_tokens=256))
    engine.sleep(); ...train...; engine.wake_up()   # colocated on one GPU (no-ops on CPU)

The noise is applied inside vLLM's worker processes, to the parameters of vLLM's model classes found by their
checkpoint names (`model.layers.0.input_layernorm.weight`), through a worker extension, and clean copies are kept
there so `clear_noise()` restores them bit for bit. (Checking for transformers' RMSNorm class, as the original
QeRL code does, never matches vLLM's layers, so its noise never lands.) `norm_weights()` reads them back for tests.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, i.e. log_softmax(logits / T) at the sampled token,
raw logits under greedy decoding, as the RolloutOutput contract says. With top_k/top_p active vLLM renormalises over
the kept tokens (the true behaviour distribution), which differs from the torch engine by log(kept mass).
vLLM pins another compressed-tensors than llmcompressor: it lives in its own environment (.ci/vllm.sh, docs/vllm.md).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

from qerl.errors import QerlError
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, check_prompts

log = logging.getLogger("qerl.rollout.vllm")

WORKER_EXTENSION = "qerl.rollout.vllm_engine.QerlWorkerExtension"


class QerlWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): runs where vLLM's model lives, in every worker.

    Methods are called by name through `LLM.collective_rpc`, so only tensors and plain data cross processes.
    """

    def _qerl_params(self) -> dict:
        model = self.model_runner.get_model()
        return dict(model.named_parameters())

    def qerl_set_norm_noise(self, noise: dict | None) -> dict:
        """Restore clean RMSNorm weights, then add `noise` (name -> float32 vector) cast to the weights' dtype.

        The noise is rounded to the parameter dtype before the add, as qerl.aqn.RMSNormNoise does, so both engines
        perturb a bf16 weight identically. Returns the names applied/missing and the applied RMS in the weights'
        dtype (what vLLM actually sees).
        """
        import torch

        params = self._qerl_params()
        clean = self.__dict__.setdefault("_qerl_clean", {})
        applied, missing, sq, changed, count = [], [], 0.0, 0, 0
        with torch.no_grad():
            for name, value in clean.items():
                params[name].data.copy_(value)
            for name, vec in (noise or {}).items():
                vec = torch.as_tensor(vec, dtype=torch.float32)  # arrives as a list: float32 -> float -> float32 is exact
                param = params.get(name)
                if param is None:
                    missing.append(name)
                    continue
                if tuple(param.shape) != tuple(vec.shape):
                    raise ValueError(f"AQN noise {name}: shape {tuple(vec.shape)}, vLLM weight {tuple(param.shape)}")
                if name not in clean:
                    clean[name] = param.detach().clone()
                param.data.add_(vec.to(device=param.device, dtype=param.dtype))
                delta = param.detach().float() - clean[name].float()
                sq += float(delta.pow(2).sum())
                changed += int((delta != 0).sum())
                count += param.numel()
                applied.append(name)
        return {"applied": applied, "missing": missing, "sq": sq, "changed": changed, "count": count}

    def qerl_norm_weights(self, names: list | None = None) -> dict:
        """CPU copies of the named weights (default: every RMSNorm weight touched so far) for checks in tests."""
        params = self._qerl_params()
        names = list(self.__dict__.get("_qerl_clean", {})) if names is None else names
        return {n: params[n].detach().cpu().tolist() for n in names if n in params}


def _default_model_path(model) -> str | None:
    """The checkpoint the training model was loaded from (peft keeps it on the base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    path = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    return str(path) if path else None


def _vllm_sampling(sampling: SamplingParams, n: int, seed: int | None, ignore_eos: bool):
    from vllm import SamplingParams as VSampling

    return VSampling(n=n, ignore_eos=ignore_eos, temperature=sampling.temperature, top_p=sampling.top_p,
                     top_k=sampling.top_k if sampling.top_k > 0 else -1, max_tokens=sampling.max_tokens,
                     stop=list(sampling.stop) or None, seed=seed, logprobs=0)


class VLLMEngine(RolloutEngine):
    """Rollouts with vLLM (colocated with the trainer); see the module docstring for the per-step protocol.

    model_path: the checkpoint vLLM loads (default: where `model` was loaded from). dtype: vLLM's dtype
    ("auto" = the checkpoint's). ignore_eos: sample exactly max_tokens (benchmarks, like TorchEngine's
    eos_token_ids=()). llm_kwargs go to `vllm.LLM` (e.g. max_model_len, enforce_eager, seed).
    enable_sleep_mode is honoured only on CUDA (vLLM has no sleep mode on CPU).
    """

    def __init__(self, model, tokenizer, *, model_path: str | os.PathLike | None = None,
                 gpu_memory_utilization: float = 0.35, enable_sleep_mode: bool = True, max_lora_rank: int = 64,
                 dtype: str | None = None, ignore_eos: bool = False, **llm_kwargs):
        import torch
        from vllm import LLM

        model_path = str(model_path) if model_path is not None else (
            _default_model_path(model) if model is not None else None)
        if not model_path or not Path(model_path, "config.json").exists():
            raise QerlError(f"VLLMEngine.model_path: expected a checkpoint directory with config.json, got "
                            f"{model_path!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise QerlError(f"VLLMEngine.gpu_memory_utilization: expected a number in (0, 1], got "
                            f"{gpu_memory_utilization!r}")
        self.tokenizer, self.model_path, self.ignore_eos = tokenizer, model_path, bool(ignore_eos)
        self.sleep_enabled = bool(enable_sleep_mode) and torch.cuda.is_available()
        self.lora_enabled = model is not None and hasattr(model, "peft_config")
        kw = dict(model=model_path, tokenizer=model_path, dtype=dtype or "auto",
                  gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_enabled,
                  logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION)
        if self.lora_enabled:
            kw.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        kw.update(llm_kwargs)
        self.llm = LLM(**kw)
        self.max_lora_rank = max_lora_rank
        self._lora = None  # the LoRARequest of the current step
        self._lora_id = 0
        self._lora_root = Path(tempfile.mkdtemp(prefix="qerl-vllm-lora-", dir=_tmp_dir()))
        self._sleeping = False
        self.noise_stats: dict[str, float] = {"aqn/applied_rms": 0.0, "aqn/changed_fraction": 0.0}

    # ------------------------------------------------------------------------------- policy sync
    def policy_rollout(self, model, prompt_ids, n, sampling, sigma=0.0, generator=None):
        """vLLM holds its own weights: push the model's adapter and this rollout's noise vector (drawn as the
        in-place engines draw it, qerl.aqn.sample_noise over rmsnorm_noise_targets), then generate."""
        from qerl.aqn import rmsnorm_noise_targets, sample_noise

        targets = rmsnorm_noise_targets(model) if sigma > 0 else []
        vecs = sample_noise({name: p.shape for name, p in targets}, sigma, generator) if sigma > 0 else None
        noise_stats = self.update_policy(model, vecs)
        return self.generate(prompt_ids, n=n, sampling=sampling), noise_stats

    def update_policy(self, model, noise: dict | None = None) -> dict[str, float]:
        """Push the training model's current LoRA adapter (new adapter id) and this rollout's AQN noise to vLLM.

        model: the peft model being trained, or None to sample from the bare base checkpoint. `noise` maps
        checkpoint names (qerl.aqn.rmsnorm_noise_targets) to vectors; None or {} clears it. Returns the applied
        noise's RMS and changed-channel fraction, measured on vLLM's own weights (in vLLM's dtype).
        """
        if model is None:
            self._drop_adapter()
        elif hasattr(model, "peft_config"):
            if not self.lora_enabled:
                raise QerlError("VLLMEngine.update_policy: got a peft model but the engine was built without one "
                                "(pass the peft model to VLLMEngine so vLLM starts with enable_lora=True)")
            self._push_adapter(model)
        elif any(p.requires_grad for p in model.parameters()):
            raise QerlError("VLLMEngine.update_policy: full fine-tuning (trainable base weights) is not synced to "
                            "vLLM; use a LoRA mode (train.mode qlora_fp4 | lora | qlora_nf4) or rollout.engine torch")
        return self.set_noise(noise)

    def _drop_adapter(self) -> None:
        if self._lora is not None:
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self._lora = None

    def _push_adapter(self, model) -> None:
        from vllm.lora.request import LoRARequest

        rank = max(getattr(c, "r", 0) for c in model.peft_config.values())
        if rank > self.max_lora_rank:
            raise QerlError(f"VLLMEngine.max_lora_rank: the adapter has rank {rank}, expected <= {self.max_lora_rank} "
                            "(raise max_lora_rank to >= lora_r)")
        self._lora_id += 1
        path = self._lora_root / f"step{self._lora_id}"
        model.save_pretrained(str(path))  # a PeftModel writes only the adapter (config + safetensors)
        previous, self._lora = self._lora, LoRARequest(f"qerl-{self._lora_id}", self._lora_id, str(path))
        if previous is not None:  # vLLM has read it into its LRU cache when the last generate ran
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def set_noise(self, noise: dict | None) -> dict[str, float]:
        """Write AQN noise into vLLM's RMSNorm weights (clean values restored first, so noise never accumulates)."""
        import torch

        noise = {k: torch.as_tensor(v, dtype=torch.float32).cpu() for k, v in (noise or {}).items()}
        # plain lists: vLLM's RPC path does not carry tensors through intact (they arrive as lists anyway)
        results = self.llm.collective_rpc("qerl_set_norm_noise", args=({k: v.tolist() for k, v in noise.items()},))
        missing = set(noise).difference(*[set(r["applied"]) for r in results]) if noise else set()
        if missing:
            raise QerlError(f"AQN noise: vLLM's model has no parameter {sorted(missing)[0]} "
                            f"({len(missing)} of {len(noise)} names missing; expected HF checkpoint names)")
        count = sum(r["count"] for r in results)
        self.noise_stats = {"aqn/applied_rms": math.sqrt(sum(r["sq"] for r in results) / count) if count else 0.0,
                            "aqn/changed_fraction": sum(r["changed"] for r in results) / count if count else 0.0}
        return dict(self.noise_stats)

    def clear_noise(self) -> None:
        """Restore the clean RMSNorm weights bit for bit."""
        self.set_noise(None)

    def norm_weights(self, names: list[str] | None = None) -> dict:
        """vLLM's current values (float32 CPU tensors) of the named weights in the first worker, default the ones
        noise has touched; values survive the trip exactly (fp32/bf16 -> Python float -> fp32)."""
        import torch

        got = self.llm.collective_rpc("qerl_norm_weights", args=(names,))[0]
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in got.items()}

    # ------------------------------------------------------------------------------- generation
    def generate(self, prompt_ids, n: int = 1, sampling: SamplingParams | None = None) -> RolloutOutput:
        """Prompt i gets seed + first_row + i*n, and vLLM gives its j-th sample that + j: row r draws from
        seed + first_row + r.

        Greedy decoding is deterministic and vLLM refuses n > 1 for it: one sample per prompt is copied n times.
        """
        sampling = sampling or SamplingParams()
        prompts = check_prompts(prompt_ids, n)
        if self._sleeping:
            self.wake_up()
        per_prompt = 1 if sampling.greedy else n
        params = [_vllm_sampling(sampling, per_prompt, None if sampling.seed is None
                                 else sampling.seed + sampling.first_row + i * n,
                                 self.ignore_eos)
                  for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                 lora_request=self._lora)
        rows = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "finish_reasons": []}
        for prompt, req in zip(prompts, outs):
            comps = sorted(req.outputs, key=lambda c: c.index) * (n // per_prompt)
            for comp in comps:
                ids = list(comp.token_ids)
                rows["prompt_ids"].append(prompt)
                rows["completion_ids"].append(ids)
                rows["logprobs"].append([step[t].logprob for t, step in zip(ids, comp.logprobs or [])])
                rows["finish_reasons"].append("stop" if comp.finish_reason in ("stop", "abort") else "length")
        return RolloutOutput(**rows, stats={"engine": "vllm", "lora_id": self._lora_id})

    # ------------------------------------------------------------------------------- memory
    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for the update (weights offloaded to CPU at level 1). No-op without sleep mode."""
        if self.sleep_enabled and not self._sleeping:
            self.llm.sleep(level=level)
            self._sleeping = True

    def wake_up(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        if getattr(self, "_lora_root", None) is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)


def _tmp_dir() -> str | None:
    """Adapters go through RAM when /dev/shm exists (they are rewritten every step)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
