"""GPU benchmarks of qerl, kept beside the package and never installed with it: run them from the repository root.

    python -m bench.suite --tokenizer ../shared/tokenizers/qwen2.5   # (a)-(d) of BENCHMARKS.md and its targets

suite (one call: every part, the GPU shared through gpu_lock) runs kernels (NVFP4 matmuls vs bf16 per shape),
wired (the engine's stacked decode layer on the CUDA kernel) and e2e (rollout, GRPO step, peak memory; workers in
e2e_workers, tables in e2e_report, models from random_models); suite_report turns the figures into the targets.
On their own: anatomy (where the few-row kernel's time goes), attention (decode attention kernel), rollout (torch
engine vs generate on a real checkpoint), aqn_entropy (does AQN raise the policy's entropy).
"""
