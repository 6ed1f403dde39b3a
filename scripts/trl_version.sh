#!/usr/bin/env bash
# Run .venv's Python with TRL SERIES (1.12, 1.13, 1.14 or 1.15) in place of .venv's TRL 1.16:
#   bash scripts/trl_version.sh SERIES ARG...    e.g. bash scripts/trl_version.sh 1.12 -m pytest tests/trl_versions -q
# First makes the series' overlay if it is missing (scripts/setup_trl_versions.sh SERIES; a check of <1 s when it is
# there, its line on stderr), then runs `.venv/bin/python ARG...` with .trl-versions/SERIES and .trl-versions/common
# first on PYTHONPATH (absolute paths, before the caller's PYTHONPATH; child processes inherit it) and
# GRPO_KERNELS_TEST_TRL_SERIES=SERIES, which makes tests/trl_versions/ fail, not skip, if another TRL is imported
# (tests/support/trl_versions_env.py). Knobs:
# TRL_BASE_VENV, TRL_OVERLAYS (as setup_trl_versions.sh; relative to the repository root).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
case ${1:-} in
    1.12|1.13|1.14|1.15) series=$1; shift ;;
    *) echo "usage: bash scripts/trl_version.sh 1.12|1.13|1.14|1.15 ARG... (the arguments of python)" >&2; exit 2 ;;
esac
absolute() { case $1 in /*) echo "$1" ;; *) echo "$ROOT/$1" ;; esac; }
base=$(absolute "${TRL_BASE_VENV:-.venv}")
overlays=$(absolute "${TRL_OVERLAYS:-.trl-versions}")
bash "$ROOT/scripts/setup_trl_versions.sh" "$series" >&2
export GRPO_KERNELS_TEST_TRL_SERIES=$series
export PYTHONPATH="$overlays/$series:$overlays/common${PYTHONPATH:+:$PYTHONPATH}"
exec "$base/bin/python" "$@"
