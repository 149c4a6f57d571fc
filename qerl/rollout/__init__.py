"""Rollout engines behind one interface: `make_engine(name, model, tokenizer).generate(prompts, n, sampling)`."""
from qerl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams, make_engine

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "make_engine"]
