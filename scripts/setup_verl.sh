#!/usr/bin/env bash
# Create .venv-verl (if missing or not as pinned): verl 0.9.1, for the tests of grpo_kernels.verl (tests/verl/).
# verl 0.9.1 pins transformers >=5.5.3,<5.11 (the main .venv has a newer one) and `import verl` imports Ray, so it
# gets its own environment:
#   torch==2.13.0, CPU build (PyTorch's CPU wheel index, ~190 MB; if it cannot be reached in 10 s, the default index,
#   where a configured local wheel folder may serve it): first, so that nothing asks for a bare `torch`, which would
#   pull a multi-GB CUDA build;
#   verl==0.9.1 (--no-deps) and the part of its requirements that `import verl`, its kernel, torch functional and
#   transformers model modules import (ray without [default], tensordict, transformers, hydra-core, accelerate, dill,
#   codetiming, numpy, packaging), with pytest and megatron-core (verl's "cpu" extra has it: its Megatron fused forward
#   imports on CPU), pinned by scripts/verl-constraints.txt (the set the tests were run with: transformers 5.10.4,
#   ray 2.60.0, tensordict 0.10.0, megatron-core 0.16.1, ...). Left out, as nothing of verl's that the tests
#   reach imports them: wandb, tensorboard, datasets, pyarrow, pandas, peft, torchdata, pylatexenc, pybind11 and
#   Ray's [default] extra (its dashboard and metrics agents): about half the download of a full `pip install verl`;
#   triton==3.9.0 (as .venv; --no-deps: the Triton interpreter case; a resolver pass could replace the CPU torch).
# The package itself is not installed: the tests run from the checkout (python -m pytest puts it first on sys.path).
# Use: .venv-verl/bin/python -m pytest tests/verl -q (docs/verl.md). Idempotent: a second run only checks the
# versions (~10 s, mostly `import verl`; the first run 3-6 min on 2 cores). Knobs: VERL_VENV; PYTHON, TORCH_CPU_INDEX
# (lib_venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_venv.sh
VENV=${VERL_VENV:-.venv-verl}
VERL_VERSION=0.9.1
TRITON_VERSION=3.9.0
CONSTRAINTS=scripts/verl-constraints.txt
check='import sys, torch, triton, verl, transformers, pytest, megatron.core
v = (torch.__version__.split("+")[0], verl.__version__, triton.__version__)
print(*v, "transformers", transformers.__version__); sys.exit(v != tuple(sys.argv[1:]))'
if venv_ready "$VENV" "$check" "$TORCH_VERSION" "$VERL_VERSION" "$TRITON_VERSION"; then
    echo "$VENV ready: torch $TORCH_VERSION verl $VERL_VERSION triton $TRITON_VERSION (cached)"
    exit 0
fi
torch_venv "$VENV" "$TORCH_VERSION"
$PIP install -q --disable-pip-version-check --no-deps "verl==$VERL_VERSION"
$PIP install -q --disable-pip-version-check -c "$CONSTRAINTS" ray tensordict transformers hydra-core accelerate dill \
    codetiming numpy packaging pytest megatron-core > "$VENV/logs/verl.log" 2>&1 \
    || { tail -20 "$VENV/logs/verl.log"; exit 1; }
$PIP install -q --disable-pip-version-check --no-deps "triton==$TRITON_VERSION"
"$VENV/bin/python" -W ignore -c "$check" "$TORCH_VERSION" "$VERL_VERSION" "$TRITON_VERSION" > /dev/null
echo "$VENV ready: torch $TORCH_VERSION verl $VERL_VERSION triton $TRITON_VERSION"
