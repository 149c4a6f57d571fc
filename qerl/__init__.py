"""qerl: reinforcement learning of LLM reasoning on NVFP4 weights (after QeRL, arXiv 2510.11696)."""

__version__ = "0.1.0"
