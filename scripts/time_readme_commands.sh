#!/usr/bin/env bash
# README's two commands as a newcomer meets them, timed on a fresh clone of this checkout's HEAD (issue "house in
# order": README's times come from this script, not from estimates). In order, each in the clone's root:
#   1. bash scripts/setup.sh                      (first run: creates .venv)
#   2. .venv/bin/python -m grpo.train             (the main job after setup)
#   3. the main command again, whole              (setup's check + a second run: must work twice, a new runs/version_N)
#   4. README's test command, whole               (setup's check, the fast tests on -n 2, the quick benchmarks)
# Writes benchmarks/results/readme_commands_cpu.md in this checkout: date, commit, cores, load before and after each,
# each command's wall time and exit status, the tests' and benchmarks' summary lines and the main job's accuracy line.
# Usage: bash scripts/time_readme_commands.sh [CLONE_DIR]   (default /tmp/grpo-kernels-fresh; removed first)
#        bash scripts/time_readme_commands.sh --report CLONE_DIR   (only the report, from a run's logs in CLONE_DIR)
# Run it on an idle machine: the figures are wall times. About 25-30 min on 2 cores.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${README_TIMES_OUT:-$ROOT/benchmarks/results/readme_commands_cpu.md}"  # a test writes elsewhere
MAIN='bash scripts/setup.sh && .venv/bin/python -m grpo.train'
TESTS=$(sed -n "s/^README_TEST_COMMAND='\(.*\)'$/\1/p" "$ROOT/.ci/run")  # the one CI runs, README's (a test checks)

run_all() {
    local dir=$1
    rm -rf "$dir" && git clone -q "$ROOT" "$dir" || { echo "time_readme_commands: cannot clone into $dir" >&2; exit 1; }
    cd "$dir" || exit 1
    : > times.txt
    step() {  # name, command
        local t0 rc load0
        load0=$(cut -d' ' -f1 /proc/loadavg); t0=$(date +%s)
        bash -c "$2" > "log-$1.txt" 2>&1; rc=$?
        echo "$1 $rc $(( $(date +%s) - t0 )) $load0 $(cut -d' ' -f1 /proc/loadavg)" >> times.txt
    }
    step setup 'bash scripts/setup.sh'
    step train '.venv/bin/python -m grpo.train'
    step main-again "$MAIN"
    step tests "$TESTS"
    git rev-parse --short HEAD > commit.txt
}

report() {
    local dir=$1
    {
        echo "# README's two commands on a fresh clone ($(date +%F), commit $(cat "$dir/commit.txt"))"
        echo
        echo "Written by \`bash scripts/time_readme_commands.sh\` on a $(nproc)-core CPU machine (no GPU); wall times;"
        echo "load: the 1-minute load average before / after each command."
        echo
        echo "| command | exit | wall time | load before / after |"
        echo "|---|---:|---:|---|"
        while read -r name rc secs l0 l1; do
            printf '| %s | %s | %d min %02d s | %s / %s |\n' "$name" "$rc" $((secs / 60)) $((secs % 60)) "$l0" "$l1"
        done < "$dir/times.txt"
        echo
        echo "- setup: \`bash scripts/setup.sh\`; train: \`.venv/bin/python -m grpo.train\`; main-again: \`$MAIN\`;"
        echo "  tests: \`$TESTS\`"
        echo "- main job, first run: $(grep -h 'output folder' "$dir/log-train.txt" | head -1)"
        echo "  $(grep -h -i 'held-out' "$dir/log-train.txt" | tail -1)"
        echo "- main command again: $(grep -h 'output folder' "$dir/log-main-again.txt" | head -1)"
        echo "- tests and benchmarks (pytest's summary lines):"
        grep -h -E '^[0-9]+ (passed|failed)|[0-9]+ passed' "$dir/log-tests.txt" | sed 's/^/  - /'
    } > "$OUT"
    echo "time_readme_commands: wrote $OUT"
}

if [ "${1:-}" = "--report" ]; then
    report "${2:?--report needs the clone folder}"
else
    DIR=${1:-/tmp/grpo-kernels-fresh}
    run_all "$DIR"
    report "$DIR"
fi
