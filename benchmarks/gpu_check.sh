#!/usr/bin/env bash
# The check for a GPU machine without network access: at most 6 minutes of wall time, installs included.
#   1. install the peers (TRL, Liger-Kernel and what TRL's trainer imports) from a wheel folder, offline;
#   2. the whole test suite (slow-marked variants excepted), one pytest per test file, several at a time, no -x:
#      every failure is listed;
#   3. the benchmark set (pytest benchmarks/ --benchmark-only), headline cases first (the distillation case,
#      benchmarks/test_distill.py, fourth: ours against TRL, Liger fused / chunked, eager, torch.compile);
#   3b. the logits kernel's rows in flight: the L2-sized grid against one row per SM (benchmarks/l2_grid_check.py,
#      45 s at most);
#   4. the end-to-end GRPO step (benchmarks/e2e_step.py: TRL's GRPOTrainer stock, with patch_trl(), and
#      grpo.train on a random Qwen2.5-0.5B-shaped model), in the last E2E_S seconds (90 s; 0 skips it);
#      With PACK_S > 0 (default 0: it does not fit the 6 minutes), then grpo.train's step on a long-tailed batch,
#      padded vs packed (benchmarks/packing_step.py on the Qwen2.5-0.5B shape), in PACK_S seconds taken before
#      the end-to-end step: PACK_S=240 TOTAL_S=600 bash benchmarks/gpu_check.sh;
#   5. the report: all tables into the output folder (with the trainer and end-to-end tables); the summary table
#      printed last, after one line saying whether the fp32-output GEMM path of the fused head was taken.
#
# The wheel folder, .whl/ at the repo root, is filled once on a machine with network access (pure-Python wheels,
# about 2.7 MB; versions as in constraints.txt):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl \
#       trl==1.16.0 liger-kernel==0.8.5 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#
# The GPU machine is expected to have torch, triton, pytest, pytest-benchmark, transformers, pandas, pyarrow and
# accelerate already; nothing is downloaded. Everything goes into one folder: $OUT if set, else
# bench-out/gpu-check-<UTC time>/ (git-ignored): env.txt, tests/<file>.log, tests_summary.md, bench.json,
# bench.log, bench.md (every table), summary.md. Plots, where matplotlib is installed:
#   python -m benchmarks.report <folder>/bench.json --out <folder>
#
# Time limits per section, taken from what is left of TOTAL_S (345 s: the 6 minutes less a margin for starting
# Python and copying results): installs 30 s; tests TESTS_LIMIT_S (150 s) at most, stopped with SIGINT so pytest
# still reports what ran; benchmarks get the rest less 25 s for the report: no benchmark starts in its last 45 s
# (the budget), a warm-up (a peer's torch.compile, autotuning) is stopped after WARMUP_LIMIT_S (60 s) and reported
# as timed out, and SIGINT at the hard limit still writes the JSON of the finished benchmarks. Without CUDA the
# same steps run on the CPU (the CPU benchmark set; Triton tests under the interpreter).
#
# Knobs (environment): PY (python3), WHL_DIR (.whl), TOTAL_S, TESTS_LIMIT_S, E2E_S, PACK_S (0), TEST_JOBS (6
# parallel test files), TEST_FILES (default: every tests/*/test_*.py), TEST_MARKERS ("not slow"; "" runs the slow
# variants too), WARMUP_LIMIT_S, GRPO_BENCH_GRID=full (far longer than this budget), GRPO_BENCH_ROUNDS,
# BENCH_PATHS (benchmarks/: what pytest benchmarks; the distillation case alone, with the distillation tests:
#   BENCH_PATHS=benchmarks/test_distill.py TEST_FILES="$(ls tests/distill/test_*.py)" E2E_S=0 \
#   bash benchmarks/gpu_check.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHL_DIR=${WHL_DIR:-.whl}
TOTAL_S=${TOTAL_S:-345}
OUT_DIR=${OUT:-bench-out/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT_DIR/tests"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
T0=$SECONDS
left() { echo $((TOTAL_S - (SECONDS - T0))); }
log() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

# 1. peers from the wheel folder; our package from the working tree (no build, no network)
if compgen -G "$WHL_DIR/*.whl" > /dev/null; then
    SITE=$(mktemp -d)
    timeout 30 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        "$WHL_DIR"/*.whl > "$OUT_DIR/install.log" 2>&1 && export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    log "install of $(ls "$WHL_DIR"/*.whl | xargs -n1 basename | tr '\n' ' '): exit $? (install.log)"
else
    log "no wheels in $WHL_DIR/: unless already installed, the Liger and TRL providers and the TRL tests are skipped"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version \
        --format=csv,noheader
    timeout 30 $PY - <<'PYEOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE (CPU run)")
for name in ("triton", "transformers", "pytest_benchmark", "trl", "liger_kernel", "datasets", "accelerate",
             "pandas", "matplotlib", "grpo_kernels"):
    try:
        m = importlib.import_module(name)
        print(f"  {name} {getattr(m, '__version__', '?')}")
    except Exception as exc:
        print(f"  {name}: not importable ({type(exc).__name__}: {exc})")
PYEOF
} 2>&1 | tee "$OUT_DIR/env.txt"

# 2. the test suite: one pytest per file, TEST_JOBS at a time, biggest files first; no -x
ROOM=$(($(left) - 150))  # leave 150 s for the benchmarks and the report
[ "$ROOM" -lt 30 ] && ROOM=30
TESTS_S=$(min "${TESTS_LIMIT_S:-150}" "$ROOM")
# the GPU-only files first (compiled kernels, CUDA-graph capture, the Gemma vocabulary), then the rest by size
FILES=${TEST_FILES:-$(ls tests/*/test_gpu_*.py; ls -S tests/*/test_*.py | grep -v '/test_gpu_')}
log "tests: $(echo $FILES | wc -w) files, ${TEST_JOBS:-6} at a time, markers '${TEST_MARKERS-not slow}', limit ${TESTS_S}s"
export TESTS_DEADLINE=$(($(date +%s) + TESTS_S)) OUT_DIR PY TEST_MARKERS=${TEST_MARKERS-not slow}
printf '%s\n' $FILES | xargs -P "${TEST_JOBS:-6}" -I{} sh -c '
    log="$OUT_DIR/tests/$(basename {} .py).log"
    rem=$((TESTS_DEADLINE - $(date +%s)))
    if [ "$rem" -lt 5 ]; then
        printf "not started: the section time limit was reached\nexit notrun\n" > "$log"; exit 0
    fi
    timeout -s INT -k 5 "$rem" $PY -m pytest {} -q -rfE -p no:cacheprovider ${TEST_MARKERS:+-m "$TEST_MARKERS"} \
        > "$log" 2>&1
    echo "exit $?" >> "$log"'
$PY - "$OUT_DIR" <<'PYEOF' | tee "$OUT_DIR/tests_summary.md"
import pathlib, re, sys
out = pathlib.Path(sys.argv[1])
totals, failed, stopped = {}, [], []
for log in sorted((out / "tests").glob("*.log")):
    text = log.read_text(errors="replace")
    lines = text.strip().splitlines()
    code = lines[-1].split()[-1] if lines and lines[-1].startswith("exit ") else "?"
    result = next((l for l in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error|deselected)", l)), "")
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", result):
        totals[what.rstrip("s") if what.startswith("error") else what] = \
            totals.get(what.rstrip("s") if what.startswith("error") else what, 0) + int(n)
    failed += [l for l in lines if l.startswith(("FAILED ", "ERROR "))]
    if code == "notrun":
        stopped.append(f"{log.stem}.py (not started: the section time limit was reached)")
    elif code in ("124", "130", "137") or "KeyboardInterrupt" in text:
        stopped.append(f"{log.stem}.py (stopped at the time limit; counts above include what ran)")
    elif code not in ("0", "1", "5"):
        stopped.append(f"{log.stem}.py (exit {code}: see tests/{log.name})")
order = ("passed", "failed", "error", "skipped", "deselected", "xfailed", "xpassed")
print("Tests: " + ", ".join(f"{totals[k]} {k}" for k in order if totals.get(k)))
for line in failed:
    print("  " + line[:300])
for line in stopped:
    print("  not finished: " + line)
PYEOF

# 3. benchmarks: budget, warm-up limit and hard limit from what is left (25 s kept for the report, E2E_S and PACK_S
#    for step 4)
E2E_S=${E2E_S:-90}
PACK_S=${PACK_S:-0}
BENCH_HARD_S=$(($(left) - 25 - E2E_S - PACK_S))
BENCH_BUDGET_S=$((BENCH_HARD_S - 45))
if [ "$BENCH_HARD_S" -lt 30 ]; then
    log "benchmarks not run: only $(left)s left of ${TOTAL_S}s"
else
    log "benchmarks: no start after ${BENCH_BUDGET_S}s, warm-up limit ${WARMUP_LIMIT_S:-60}s, hard limit ${BENCH_HARD_S}s"
    GRPO_BENCH_BUDGET_S=$BENCH_BUDGET_S GRPO_BENCH_WARMUP_LIMIT_S=${WARMUP_LIMIT_S:-60} \
        timeout -s INT -k 5 "$BENCH_HARD_S" $PY -m pytest ${BENCH_PATHS:-benchmarks/} --benchmark-only -q -rfE \
        -p no:cacheprovider \
        --benchmark-columns=min,median,rounds --benchmark-json "$OUT_DIR/bench.json" > "$OUT_DIR/bench.log" 2>&1
    log "benchmarks exit code $? (124: stopped at the hard limit); failures:"
    grep -E "^(FAILED|ERROR)" "$OUT_DIR/bench.log" | cut -c1-300
    tail -n 1 "$OUT_DIR/bench.log"
fi

# 3b. the persistent logits kernel's L2-sized grid against one row per SM (Gemma bf16, Qwen fp32 and bf16)
timeout -k 5 45 $PY -m benchmarks.l2_grid_check > "$OUT_DIR/l2_grid.md" 2>&1
log "L2 grid check exit code $? (l2_grid.md)"

# 4. packed vs padded grpo.train step on a long-tailed batch (PACK_S > 0), then the end-to-end GRPO step: three
#    variants, one child process each, a third of what is left each
if [ "$PACK_S" -gt 0 ]; then
    log "packing step: ${PACK_S}s (packing_step.md)"
    timeout -k 5 "$PACK_S" $PY -m benchmarks.packing_step --out "$OUT_DIR" --device cuda --shape qwen2.5-0.5b \
        --prompts 8 --max-len 512 --steps 5 --timeout-s $((PACK_S / 2)) > "$OUT_DIR/packing_step.log" 2>&1
    log "packing step exit code $? (packing_step.md, packing_step.log)"
fi
E2E_LEFT=$(($(left) - 20))
if [ "$E2E_S" -gt 0 ] && [ "$E2E_LEFT" -ge 30 ]; then
    log "end-to-end step: ${E2E_LEFT}s for three variants"
    timeout -k 5 "$E2E_LEFT" $PY -m benchmarks.e2e_step --out "$OUT_DIR" --timeout-s $((E2E_LEFT / 3)) --completion-length 256 \
        > "$OUT_DIR/e2e_step.log" 2>&1
    log "end-to-end step exit code $? (e2e_step.md, e2e_step.log)"
else
    log "end-to-end step not run (E2E_S=$E2E_S, $(left)s left)"
fi

# 5. report: every table into bench.md; the tests line and the benchmark summary table printed last
log "done in $((SECONDS - T0))s; results in $OUT_DIR"
echo
echo "## Summary"
echo
grep '^Tests:' "$OUT_DIR/tests_summary.md"
echo
# Whether the fused head's logits GEMM wrote fp32 directly (mm with out_dtype=float32) or took the fallback
# (bf16-rounded logits, slower blocks): decided once per device on a small real CUDA call, so a fresh process
# reaches the same decision as the benchmark run did.
timeout 60 $PY -m benchmarks.fp32_gemm_check 2>&1 | tee "$OUT_DIR/fp32_gemm.txt"
echo
if [ -s "$OUT_DIR/bench.json" ]; then
    # also prints the trainer-vs-TRL and end-to-end tables (e2e_step.json of step 4 is read from the same folder)
    timeout 15 $PY -m benchmarks.report "$OUT_DIR/bench.json" --out "$OUT_DIR" --no-plots --print summary \
        2> "$OUT_DIR/report.log" | tee "$OUT_DIR/summary.md" || cat "$OUT_DIR/report.log"
else
    echo "no $OUT_DIR/bench.json: see $OUT_DIR/bench.log"; tail -n 40 "$OUT_DIR/bench.log"
    [ -s "$OUT_DIR/e2e_step.md" ] && { echo; cat "$OUT_DIR/e2e_step.md"; }
    [ -s "$OUT_DIR/l2_grid.md" ] && { echo; cat "$OUT_DIR/l2_grid.md"; }
fi
[ -s "$OUT_DIR/packing_step.md" ] && { echo; echo "grpo.train step, padded vs packed:"; cat "$OUT_DIR/packing_step.md"; }
