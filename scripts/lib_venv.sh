# Sourced (never run) by scripts/setup.sh, setup_aot36.sh and setup_verl.sh, from the repository root: how each makes
# its venv and gets the CPU build of torch, written once. Defines functions; runs nothing. Reads PYTHON (the
# interpreter a venv is made with), PIP (the pip command of the venv being filled) and TORCH_CPU_INDEX.

# venv_ready VENV CHECK ARG...: VENV has an interpreter and the python code CHECK, given ARG... (the pinned versions),
# exits 0 in it (warnings and output discarded).
venv_ready() {
    local venv=$1 check=$2
    shift 2
    [ -x "$venv/bin/python" ] && "$venv/bin/python" -W ignore -c "$check" "$@" > /dev/null 2>&1
}

# make_venv VENV: a venv made with $PYTHON, unless VENV already has an interpreter.
make_venv() {
    [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
}

# install_cpu_torch LOGS VERSION: torch==VERSION with $PIP from PyTorch's CPU wheel index ($TORCH_CPU_INDEX, ~190 MB,
# not the multi-GB CUDA build; 10 s timeout, no retries, pip's output in LOGS/torch-cpu-index.log); where that index
# cannot be reached, from the default index (where a configured local wheel folder may serve it).
install_cpu_torch() {
    local logs=$1 version=$2
    mkdir -p "$logs"
    if ! $PIP install -q --disable-pip-version-check --timeout 10 --retries 0 --index-url "$TORCH_CPU_INDEX" \
            "torch==$version" > "$logs/torch-cpu-index.log" 2>&1; then
        echo "torch: $TORCH_CPU_INDEX not reachable ($logs/torch-cpu-index.log); trying the default index"
        $PIP install -q --disable-pip-version-check "torch==$version"
    fi
}
