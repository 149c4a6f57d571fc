#!/usr/bin/env bash
# Create .venv and install qerl with everything the CPU pipeline and the tests need.
# torch is pinned (constraints.txt) to the CPU build this machine has on disk; an unpinned torch would pull a
# multi-GB CUDA build. On a GPU machine: TORCH_SPEC="torch" bash .ci/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
"$VENV/bin/python" -m pip install -q -c .ci/constraints.txt -e ".[test]"
"$VENV/bin/python" -c "import torch, transformers, peft, llmcompressor, mlflow, snakemake; print('installed: torch', torch.__version__, 'transformers', transformers.__version__)"
