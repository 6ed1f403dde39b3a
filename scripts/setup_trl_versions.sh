#!/usr/bin/env bash
# Make the TRL releases of the older series patch_trl() serves, 1.12, 1.13, 1.14 and 1.15, runnable over the main
# .venv (if missing or not as pinned), for tests/trl_versions/ (docs/api.md "Older TRL (1.12-1.15)"):
#   bash scripts/setup_trl_versions.sh [1.12|1.13|1.14|1.15|all]      (default: all)
# TRL is pure Python and the four series run with .venv's own requirements (TRL 1.12-1.15 all require
# transformers >= 4.56.2; .venv has constraints.txt's transformers 5.24.0, accelerate, datasets, torch 2.13 CPU,
# triton 3.9, liger-kernel 0.8.5, pytest), so each series is one overlay folder instead of a venv of its own:
#   .trl-versions/SERIES: trl==X alone (pip --target, --no-deps; X: 1.12.0, 1.13.0, 1.14.2, 1.15.0);
#   .trl-versions/common: requests and aiohttp with what they need that .venv lacks (the GRPO trainer module and the
#   experimental AsyncGRPO one import them; TRL lists them under its vllm extra), pinned by
#   scripts/trl-versions-constraints.txt; shared by the four.
# scripts/trl_version.sh SERIES ARG... runs .venv's Python with both first on PYTHONPATH, so that `import trl`,
# importlib.metadata.version("trl") and transformers' availability checks all find the overlay's TRL, not .venv's
# 1.16. liger-kernel is .venv's for every series: TRL 1.14 refuses use_liger_kernel=True without it (that flag sends its
# GRPO / DPO / KTO trainers through `_ChunkedLogProbFunction`, the seam the 1.14 tests cover); 1.12 and 1.13 import
# Liger's GRPO loss at load when it is there and use it only under use_liger_kernel=True, which their tests leave off.
# .venv itself is never changed: make it first with scripts/setup.sh (CI's first step does).
# The package itself is not installed: the tests run from the checkout (python -m pytest puts it first on sys.path).
# Idempotent: a second run only checks the overlays' metadata (~0.5 s for all four). A first run downloads ~7.5 MB
# (the four TRL wheels, ~1 MB each; aiohttp, requests and theirs): ~23 s with pip's cache empty (docs/contributing.md
# "CI"). Knobs: TRL_BASE_VENV (.venv), TRL_OVERLAYS (.trl-versions).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib_venv.sh
BASE=${TRL_BASE_VENV:-.venv}
OVERLAYS=${TRL_OVERLAYS:-.trl-versions}
CONSTRAINTS=scripts/trl-versions-constraints.txt
declare -A TRL_RELEASE=([1.12]=1.12.0 [1.13]=1.13.0 [1.14]=1.14.2 [1.15]=1.15.0)
# What .venv must hold (setup.sh installs it): the four series' requirements, the tests' and 1.14's liger-kernel.
base_check='import importlib.metadata as md
for name in ("torch", "triton", "transformers", "accelerate", "datasets", "liger-kernel", "pytest"):
    md.version(name)'
# The overlay folder argv[1] holds each NAME==VERSION of argv[2:] (its *.dist-info, names compared normalized).
overlay_check='import sys, re, importlib.metadata as md
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
found = {norm(d.metadata["Name"]): d.version for d in md.distributions(path=[sys.argv[1]])}
sys.exit(any(found.get(norm(n)) != v for n, v in (a.split("==") for a in sys.argv[2:])))'

# overlay DIR WHAT ARG...: DIR ready (cached) when it holds the pins ARG..., else made with them (install_overlay).
overlay() {
    local dir=$1 what=$2
    shift 2
    if venv_ready "$BASE" "$overlay_check" "$dir" "$@"; then
        echo "$dir ready: $what over $BASE (cached)"
        return 0
    fi
    install_overlay "$dir" -c "$CONSTRAINTS" "$@"
    if ! venv_ready "$BASE" "$overlay_check" "$dir" "$@"; then
        echo "$dir: not as pinned after its install ($*)" >&2
        exit 1
    fi
    echo "$dir ready: $what over $BASE"
}

target=${1:-all}
case $target in
    all) series=(1.12 1.13 1.14 1.15) ;;
    1.12|1.13|1.14|1.15) series=("$target") ;;
    *) echo "usage: bash scripts/setup_trl_versions.sh [1.12|1.13|1.14|1.15|all]" >&2; exit 2 ;;
esac
if ! venv_ready "$BASE" "$base_check"; then
    echo "$BASE is missing or lacks torch, triton, transformers, accelerate, datasets, liger-kernel or pytest:" \
         "make it first with bash scripts/setup.sh" >&2
    exit 1
fi
PIP="$BASE/bin/python -m pip"
mapfile -t pins < <(grep -E '^[A-Za-z0-9]' "$CONSTRAINTS")
overlay "$OVERLAYS/common" "requests, aiohttp" "${pins[@]}"
for s in "${series[@]}"; do
    overlay "$OVERLAYS/$s" "trl ${TRL_RELEASE[$s]}" "trl==${TRL_RELEASE[$s]}"
done
