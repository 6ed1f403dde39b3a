#!/usr/bin/env bash
# The test command (README): install, run the test suite on the CPU (Triton kernels under the interpreter),
# then the benchmark suite in its quick CPU form so it never rots.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest tests -q "$@"
.venv/bin/python -m pytest benchmarks/ --benchmark-only -q
