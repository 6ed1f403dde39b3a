#!/usr/bin/env bash
# Create .venv (if missing) and install grpo-kernels with its train, test and bench extras.
# torch first, from where scripts/torch_source.sh decides (docs/install.md):
#   - no NVIDIA driver: the CPU build from PyTorch's CPU wheel index ($TORCH_CPU_INDEX, ~190 MB); if that index
#     cannot be reached (10 s timeout, no retries) the default index, where a configured local wheel folder may
#     serve it;
#   - an NVIDIA driver: a CUDA build of torch already installed is left alone (and torch / triton are then not
#     pinned by constraints.txt); otherwise torch==2.13.0 from the default index (the CUDA build on Linux);
#   - the pinned torch already installed: nothing.
# Then `pip install -e ".[train,test,bench]"` pinned by constraints.txt, then scripts/setup_liger_tests.sh (Liger-Kernel
# 0.8.5's own JSD tests from its source archive on PyPI, for tests/hf/test_liger_jsd.py): where PyPI cannot be reached,
# its one line says so and setup goes on (those tests skip, naming that script); any other failure of it (a digest
# that is not Liger's) fails setup. Idempotent: a second run only checks.
# Knobs: PYTHON (python3, for the venv), TORCH_CPU_INDEX (both read by lib_venv.sh), SETUP_PIP (the pip command;
# tests replace it).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_venv.sh
make_venv .venv
PIP=${SETUP_PIP:-.venv/bin/python -m pip}
read -r action reason < <(bash scripts/torch_source.sh .venv/bin/python "$TORCH_VERSION")
echo "torch: $reason"
constraints=constraints.txt
case $action in
    keep) ;;
    keep-cuda)
        constraints=$(mktemp)
        trap 'rm -f "$constraints"' EXIT
        grep -vE '^(torch|triton)==' constraints.txt > "$constraints" ;;
    cpu) install_cpu_torch .venv/logs "$TORCH_VERSION" ;;
    default) $PIP install -q --disable-pip-version-check "torch==$TORCH_VERSION" ;;
    *) echo "scripts/torch_source.sh: unexpected answer '$action $reason'" >&2; exit 1 ;;
esac
$PIP install -q --disable-pip-version-check -c "$constraints" -e ".[train,test,bench]"
.venv/bin/python -c "import torch, triton, trl, liger_kernel, grpo_kernels; print('grpo-kernels ready: torch', torch.__version__, 'triton', triton.__version__, 'trl', trl.__version__)"
liger_status=0
LIGER_TESTS_PIP="$PIP" bash scripts/setup_liger_tests.sh || liger_status=$?
[ "$liger_status" -eq 0 ] || [ "$liger_status" -eq 3 ] || exit "$liger_status"  # 3: PyPI not reachable
