#!/usr/bin/env bash
# Create .venv (if missing) and install grpo-kernels with its train, test and bench extras.
# torch is installed first and pinned (constraints.txt), so a CPU machine gets the CPU build and never the
# multi-GB CUDA one. Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[train,test,bench]"
.venv/bin/python -c "import torch, triton, trl, liger_kernel, grpo_kernels; print('grpo-kernels ready: torch', torch.__version__, 'triton', triton.__version__, 'trl', trl.__version__)"
