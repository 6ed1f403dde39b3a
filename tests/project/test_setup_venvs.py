"""scripts/setup_aot36.sh and scripts/setup_verl.sh (the AOT check's and the verl tests' own environments) without
network: a fake ``$PYTHON`` makes a fake venv whose interpreter records every pip call (and can fail like an
unreachable CPU index) and whose version check passes once something was installed."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or os.name != "posix", reason="the setup scripts are bash (Linux, macOS)")

# script -> (its venv knob, the lines it prints when ready, the pip calls of a first run after torch)
SCRIPTS = {
    "setup_aot36.sh": ("AOT36_VENV", "ready: torch 2.13.0 triton 3.6.0", [
        "install -q --disable-pip-version-check --no-deps triton==3.6.0",
        "install -q --disable-pip-version-check numpy"]),
    "setup_verl.sh": ("VERL_VENV", "ready: torch 2.13.0 verl 0.9.1 triton 3.9.0", [
        "install -q --disable-pip-version-check --no-deps verl==0.9.1",
        "install -q --disable-pip-version-check -c scripts/verl-constraints.txt ray tensordict transformers hydra-core "
        "accelerate dill codetiming numpy packaging pytest megatron-core",
        "install -q --disable-pip-version-check --no-deps triton==3.9.0"]),
}
CPU_INDEX = ("install -q --disable-pip-version-check --timeout 10 --retries 0 --index-url "
             "https://download.pytorch.org/whl/cpu torch==2.13.0")


def _fake_python3(tmp_path, cpu_index_reachable: bool) -> pathlib.Path:
    """``$PYTHON -m venv DIR`` makes DIR/bin/python: ``-m pip ...`` appends its arguments to pip_calls.txt (failing on
    the CPU index when it is unreachable); any other call (the scripts' version check) succeeds once pip ran."""
    calls = tmp_path / "pip_calls.txt"
    venv_python = ("#!/bin/sh\n"
                   f'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$*" >> {calls}\n'
                   + ("" if cpu_index_reachable else
                      '  case "$*" in *download.pytorch.org*) echo "ConnectTimeoutError" >&2; exit 1;; esac\n')
                   + f"  exit 0\nfi\n[ -s {calls} ]\n")
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\n"
                    '[ "$1" = -m ] && [ "$2" = venv ] || exit 2\n'
                    'mkdir -p "$3/bin"\n'
                    f"cat > \"$3/bin/python\" <<'EOF'\n{venv_python}EOF\n"
                    'chmod +x "$3/bin/python"\n')
    fake.chmod(0o755)
    return fake


def _run(tmp_path, script, cpu_index_reachable=True):
    knob = SCRIPTS[script][0]
    venv = tmp_path / "venv"
    env = dict(os.environ, PATH="/usr/bin:/bin", PYTHON=str(_fake_python3(tmp_path, cpu_index_reachable)),
               **{knob: str(venv)})
    out = subprocess.run([BASH, str(ROOT / "scripts" / script)], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = tmp_path / "pip_calls.txt"
    return out.stdout.splitlines(), calls.read_text().splitlines() if calls.exists() else [], venv


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_first_run_makes_the_venv_from_the_cpu_index_then_is_cached(tmp_path, script):
    _, ready, rest = SCRIPTS[script]
    lines, calls, venv = _run(tmp_path, script)
    assert calls == [CPU_INDEX] + rest, calls
    assert lines == [f"{venv} {ready}"], lines
    assert (venv / "logs" / "torch-cpu-index.log").exists()
    lines, again, _ = _run(tmp_path, script)
    assert again == calls, again  # the second run only checks the versions
    assert lines == [f"{venv} {ready} (cached)"], lines


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_unreachable_cpu_index_falls_back_to_the_default_index(tmp_path, script):
    _, ready, rest = SCRIPTS[script]
    lines, calls, venv = _run(tmp_path, script, cpu_index_reachable=False)
    assert calls == [CPU_INDEX, "install -q --disable-pip-version-check torch==2.13.0"] + rest, calls
    assert lines == [f"torch: https://download.pytorch.org/whl/cpu not reachable ({venv}/logs/torch-cpu-index.log); "
                     "trying the default index", f"{venv} {ready}"], lines
    assert "ConnectTimeoutError" in (venv / "logs" / "torch-cpu-index.log").read_text()  # pip's output: in the log
