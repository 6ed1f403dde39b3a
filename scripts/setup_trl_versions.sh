#!/usr/bin/env bash
# Create the cached environments of the older TRL series patch_trl() serves: .venv-trl112, .venv-trl113,
# .venv-trl114, .venv-trl115 (if missing or not as pinned), for tests/trl_versions/ (docs/api.md "TRL", per version).
#   bash scripts/setup_trl_versions.sh [1.12|1.13|1.14|1.15|all]      (default: all)
# Each environment:
#   torch==2.13.0, CPU build (PyTorch's CPU wheel index; if it cannot be reached in 10 s, the default index, where a
#   configured local wheel folder may serve it): first, so that nothing asks for a bare `torch`, which would pull a
#   multi-GB CUDA build;
#   trl==X and its requirements (transformers, accelerate, datasets, pandas, jinja2, ...), requests and aiohttp (the
#   GRPO trainer module and the experimental AsyncGRPO one import them; TRL lists them under its vllm extra) and
#   pytest, pinned by scripts/trl-versions-constraints.txt (the set the tests ran with; one file for the four series:
#   TRL 1.12-1.15 all require transformers >= 4.56.2 and run with the main .venv's transformers 5.24.0);
#   triton==3.9.0 (--no-deps, as .venv: grpo_kernels' kernels and TRL 1.15's, under the interpreter in the tests);
#   TRL 1.14 only: liger-kernel==0.8.5 (--no-deps): TRL 1.14 refuses use_liger_kernel=True without it, and that flag
#   is what sends its GRPO / DPO / KTO trainers through `_ChunkedLogProbFunction`, the seam the 1.14 tests cover.
# The package itself is not installed: the tests run from the checkout (python -m pytest puts it first on sys.path).
# Use: .venv-trl114/bin/python -m pytest tests/trl_versions -q. Idempotent: a second run only checks the versions
# (~10 s an environment); the first run of one takes ~2 min on 2 cores with pip's cache warm, ~5 min cold.
# Knobs: PYTHON, TORCH_CPU_INDEX.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
TRITON_VERSION=3.9.0
LIGER_VERSION=0.8.5
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
CONSTRAINTS=scripts/trl-versions-constraints.txt
declare -A TRL_RELEASE=([1.12]=1.12.0 [1.13]=1.13.0 [1.14]=1.14.2 [1.15]=1.15.0)
check='import sys, torch, triton, trl, transformers, datasets, requests, aiohttp, pytest
v = (torch.__version__.split("+")[0], trl.__version__, triton.__version__)
if sys.argv[4] == "liger":
    import liger_kernel
print(*v, "transformers", transformers.__version__); sys.exit(v != tuple(sys.argv[1:4]))'

setup_one() {
    local series=$1 release=${TRL_RELEASE[$1]} venv=.venv-trl${1/./} extra=none
    [ "$series" = 1.14 ] && extra=liger
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -W ignore -c "$check" "$TORCH_VERSION" "$release" \
            "$TRITON_VERSION" "$extra" > /dev/null 2>&1; then
        echo "$venv ready: torch $TORCH_VERSION trl $release triton $TRITON_VERSION (cached)"
        return 0
    fi
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    local pip="$venv/bin/python -m pip"
    mkdir -p "$venv/logs"
    if ! $pip install -q --disable-pip-version-check --timeout 10 --retries 0 --index-url "$TORCH_CPU_INDEX" \
            "torch==$TORCH_VERSION" > "$venv/logs/torch-cpu-index.log" 2>&1; then
        echo "torch: $TORCH_CPU_INDEX not reachable ($venv/logs/torch-cpu-index.log); trying the default index"
        $pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
    fi
    $pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "trl==$release" transformers accelerate datasets \
        tokenizers numpy requests aiohttp pytest > "$venv/logs/trl.log" 2>&1 || { tail -20 "$venv/logs/trl.log"; exit 1; }
    $pip install -q --disable-pip-version-check --no-deps "triton==$TRITON_VERSION"
    [ "$extra" = liger ] && $pip install -q --disable-pip-version-check --no-deps "liger-kernel==$LIGER_VERSION"
    "$venv/bin/python" -W ignore -c "$check" "$TORCH_VERSION" "$release" "$TRITON_VERSION" "$extra" > /dev/null
    echo "$venv ready: torch $TORCH_VERSION trl $release triton $TRITON_VERSION"
}

target=${1:-all}
case $target in
    all) for s in 1.12 1.13 1.14 1.15; do setup_one "$s"; done ;;
    1.12|1.13|1.14|1.15) setup_one "$target" ;;
    *) echo "usage: bash scripts/setup_trl_versions.sh [1.12|1.13|1.14|1.15|all]" >&2; exit 2 ;;
esac
