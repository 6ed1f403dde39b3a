# Sourced (never run) by scripts/setup.sh, setup_aot36.sh, setup_verl.sh, setup_openrlhf.sh and setup_trl_versions.sh,
# from the repository root: the torch every environment pins, how each script makes its venv and gets the CPU build of
# torch, and how a folder of packages over a venv (an overlay, put first on PYTHONPATH) is made, written once. Sets
# the knobs' defaults below and defines functions; runs nothing. The functions read PYTHON, TORCH_CPU_INDEX and PIP
# (the pip command of the venv being filled; torch_venv sets it).
PYTHON=${PYTHON:-python3}  # the interpreter a venv is made with
TORCH_VERSION=2.13.0  # as constraints.txt pins it
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

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

# torch_venv VENV VERSION: the venv (make_venv) with PIP set to its pip and the CPU build of torch==VERSION in it
# (install_cpu_torch, logs in VENV/logs): what an environment of the tests' own starts from.
torch_venv() {
    make_venv "$1"
    PIP="$1/bin/python -m pip"
    install_cpu_torch "$1/logs" "$2"
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

# install_overlay DIR ARG...: `$PIP install --no-deps --target` of ARG... (requirement specifiers, pip options) into
# the folder DIR, an overlay: packages put first on PYTHONPATH over an existing venv (pip's --target sees nothing
# installed, hence --no-deps: what the overlay needs is named). Built in DIR.partial and moved into place, so a failed
# or interrupted run leaves no half-filled DIR and a rebuild replaces an outdated one whole.
install_overlay() {
    local dir=$1
    shift
    rm -rf "$dir.partial"
    mkdir -p "$dir.partial"
    $PIP install -q --disable-pip-version-check --no-deps --target "$dir.partial" "$@"
    rm -rf "$dir"
    mv "$dir.partial" "$dir"
}
