"""Rollout engines behind one interface: `make_engine(name, model, tokenizer).generate(prompts, n, sampling)`.

make_engine lives here, above the engines it imports, so the contract in base.py imports no engine.
"""
from qerl.errors import QerlError
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_engine"]


def make_engine(name: str, model, tokenizer, **kw) -> RolloutEngine:
    """Build the engine named by config `rollout.engine` ("torch", "paged" or "vllm")."""
    if name == "torch":
        from qerl.rollout.torch_engine import TorchEngine

        return TorchEngine(model, tokenizer, **kw)
    if name == "paged":
        from qerl.rollout.paged_engine import PagedEngine

        return PagedEngine(model, tokenizer, **kw)
    if name == "vllm":
        try:  # vLLM lives in its own environment; it may be imported by the module or lazily inside it
            from qerl.rollout.vllm_engine import VLLMEngine

            return VLLMEngine(model, tokenizer, **kw)
        except ImportError as e:
            raise QerlError(f"rollout.engine 'vllm' needs vLLM in this environment: pip install 'qerl[vllm]' ({e})") from e
    raise QerlError(f"rollout.engine: expected 'torch', 'paged' or 'vllm', got {name!r}")
