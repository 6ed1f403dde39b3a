#!/usr/bin/env bash
# One prepared GPU check for an H200 machine without network access (about 5-6 minutes in all):
#   install the peers from carried wheels -> GPU tests -> GPU benchmark set -> report, table printed last.
#
# The image has torch, triton, pytest, pytest-benchmark and transformers, but not trl / liger-kernel. Fetch their
# wheels once, at the repo root, on a machine with PyPI access (both are pure-Python wheels, ~1.9 MB together):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl trl==1.16.0 liger-kernel==0.8.5
#
# No other wheel is needed: liger-kernel needs only torch + triton, and of TRL the benchmarks use only
# trl.kernels (imports transformers only). TRL's chunked backward imports trl.trainer.utils (accelerate, datasets,
# pandas, pyarrow: ~60 MB of wheels) for one DeepSpeed ZeRO-3 helper; where that import fails,
# benchmarks/providers.py stubs that helper with the nullcontext TRL itself returns without ZeRO-3, and says so
# in the report. Test modules of tests/ that import trl's trainer cannot be collected on that image: step 2 ignores
# them (and says which); their dependencies (69 MB of wheels, pyarrow alone 53 MB) exceed the 64 MiB carry limit.
#
# Run on the device machine (the `run` tool), carrying the ignored wheel folder:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
# Results go to $OUT (or benchmarks/results/ when OUT is unset): gpu_bench.json (pytest-benchmark), gpu_bench.md
# (all tables), gpu_tests.log, gpu_bench.log. Render the plots afterwards where matplotlib is installed:
#   python -m benchmarks.report <OUT>/gpu_bench.json
#
# Knobs (environment): PY (python command, default python3), WHL_DIR (default .whl), TESTS_LIMIT_S (80),
# BENCH_BUDGET_S (180: no new benchmark starts after it), BENCH_LIMIT_S (235: hard stop, JSON still written),
# GRPO_BENCH_GRID=full (whole N x H x V grid: far longer than this script's budget), GRPO_BENCH_ROUNDS.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT_DIR=${OUT:-benchmarks/results}
WHL_DIR=${WHL_DIR:-.whl}
mkdir -p "$OUT_DIR"
T0=$SECONDS
log() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }

# 1. peers from the carried wheels; our package from the working tree (no build, no network)
if compgen -G "$WHL_DIR/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHL_DIR"/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    log "installed $(ls "$WHL_DIR"/*.whl | xargs -n1 basename | tr '\n' ' ')"
else
    log "no wheels in $WHL_DIR/: the Liger and TRL providers will be skipped (see the header for the download)"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version \
    --format=csv,noheader
$PY - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE (CPU run)")
for name in ("triton", "transformers", "pytest_benchmark", "trl", "liger_kernel", "matplotlib", "grpo_kernels"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}")
    except Exception as exc:
        print(f"  {name}: not importable ({type(exc).__name__}: {exc})")
EOF

# 2. GPU tests, time-boxed. A test module that cannot be imported here (e.g. one importing trl's trainer, whose
# dependencies are not on the image) would stop the whole -x run at collection: it is ignored, and listed.
IGNORES=$($PY -m pytest tests -m "not slow" --co -q -p no:cacheprovider 2>&1 \
    | sed -n 's/^ERROR \(tests\/[^ ]*\.py\).*/--ignore=\1/p' | sort -u | tr '\n' ' ')
[ -n "$IGNORES" ] && log "not importable here, ignored: $IGNORES"
log "compiled-kernel tests first: tests/test_gpu.py"
timeout -s INT -k 10 "${GPU_TESTS_LIMIT_S:-60}" $PY -m pytest tests/test_gpu.py -q -p no:cacheprovider \
    > "$OUT_DIR/gpu_kernel_tests.log" 2>&1
echo "tests/test_gpu.py exit code $?; last lines:"
tail -n 12 "$OUT_DIR/gpu_kernel_tests.log"
log "tests (limit ${TESTS_LIMIT_S:-80}s)"
timeout -s INT -k 10 "${TESTS_LIMIT_S:-80}" $PY -m pytest tests -m "not slow" -x -q -p no:cacheprovider $IGNORES \
    > "$OUT_DIR/gpu_tests.log" 2>&1
echo "tests exit code $? (124: time limit); last lines:"
tail -n 15 "$OUT_DIR/gpu_tests.log"

# 3. GPU benchmark set: no benchmark starts after BENCH_BUDGET_S; SIGINT at BENCH_LIMIT_S still writes the JSON
log "benchmarks (budget ${BENCH_BUDGET_S:-180}s, hard limit ${BENCH_LIMIT_S:-235}s)"
GRPO_BENCH_BUDGET_S=${BENCH_BUDGET_S:-180} timeout -s INT -k 15 "${BENCH_LIMIT_S:-235}" \
    $PY -m pytest benchmarks/ --benchmark-only -q -p no:cacheprovider --benchmark-sort=name \
    --benchmark-columns=min,median,rounds --benchmark-json "$OUT_DIR/gpu_bench.json" \
    > "$OUT_DIR/gpu_bench.log" 2>&1
echo "benchmarks exit code $? (124: hard limit); skips:"
grep -E "^SKIPPED|^FAILED|^ERROR" "$OUT_DIR/gpu_bench.log" \
    | sed -e 's/^SKIPPED \[\([0-9]*\)\] [^:]*:[0-9]*:/SKIPPED [\1]/' | sort | uniq | cut -c1-300
tail -n 1 "$OUT_DIR/gpu_bench.log"

# 4. report: all tables to $OUT_DIR/gpu_bench.md; forward+backward and no-grad tables printed last
log "done; report follows"
if [ -s "$OUT_DIR/gpu_bench.json" ]; then
    $PY -m benchmarks.report "$OUT_DIR/gpu_bench.json" --out "$OUT_DIR" --brief 2> "$OUT_DIR/report.log" \
        || cat "$OUT_DIR/report.log"
else
    echo "no $OUT_DIR/gpu_bench.json: see $OUT_DIR/gpu_bench.log"; tail -n 40 "$OUT_DIR/gpu_bench.log"
fi
