#!/usr/bin/env bash
# Create .venv-triton36 (if missing or not as pinned): the GPU image's Triton compiler for the ahead-of-time check.
# The GPU image runs torch 2.11 / triton 3.6, CI and .venv torch 2.13 / triton 3.9; kernels must compile on both.
# This environment holds only what the AOT child process imports (tools/aot.py: the kernel modules, their
# aot_launches() scenarios on CPU tensors, Triton's compiler, ptxas and cuobjdump shipped in its wheel):
#   torch==2.13.0, CPU build (PyTorch's CPU wheel index, ~190 MB; if it cannot be reached in 10 s, the default
#   index, where a configured local wheel folder may serve it), triton==3.6.0, numpy.
# The package itself is not installed: the child process imports it from the checkout (PYTHONPATH).
# Use: GRPO_AOT_PYTHON=.venv-triton36/bin/python .venv/bin/python -m pytest tests/kernels/test_aot.py (docs/kernels.md).
# Idempotent: a second run only checks the two versions (~2 s). Knobs: AOT36_VENV; PYTHON, TORCH_CPU_INDEX
# (lib_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_venv.sh
VENV=${AOT36_VENV:-.venv-triton36}
TRITON_VERSION=3.6.0
check='import torch, triton, numpy, sys; v = (torch.__version__.split("+")[0], triton.__version__); print(*v); sys.exit(v != tuple(sys.argv[1:]))'
if venv_ready "$VENV" "$check" "$TORCH_VERSION" "$TRITON_VERSION"; then
    echo "$VENV ready: torch $TORCH_VERSION triton $TRITON_VERSION (cached)"
    exit 0
fi
torch_venv "$VENV" "$TORCH_VERSION"
# Why --no-deps for triton: its wheel needs nothing else here; a resolver pass could replace the CPU torch.
$PIP install -q --disable-pip-version-check --no-deps "triton==$TRITON_VERSION"
$PIP install -q --disable-pip-version-check numpy
"$VENV/bin/python" -c "$check" "$TORCH_VERSION" "$TRITON_VERSION" > /dev/null
echo "$VENV ready: torch $TORCH_VERSION triton $TRITON_VERSION"
