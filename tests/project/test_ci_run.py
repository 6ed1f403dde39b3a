""".ci/run itself: its exit status is non-zero whenever one of its steps fails, README's test command first.

Each case copies .ci/run into a scratch repository whose scripts and interpreters are stubs: every stub records its
command line and fails (exit 3) when that line contains the text a case names, so a case can fail one step and see
that the script stops there with a non-zero status and never reports success. (Bash's `set -e` ignores a failure
inside an `a && b && c` list unless it is the list's last command: a command line that ran README's test command
as such a list let CI go on to its second step and exit 0 after a red first step.)"""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or shutil.which("timeout") is None,
                                reason=".ci/run is a bash script that uses coreutils' timeout (Linux CI)")

STUB = """#!/bin/sh
echo "$0 $*" >> "$CI_CALLS"
if [ -n "$CI_FAIL" ] && printf '%s' "$0 $*" | grep -qF -- "$CI_FAIL"; then exit 3; fi
exit 0
"""
FAST_SUITE = '-m pytest tests -q -m not slow'
BENCHMARKS = "-m pytest benchmarks/ --benchmark-only"
SLOW_SUITE = "-m pytest tests -q -m slow"
OPENRLHF_TESTS = ".venv-openrlhf/bin/python -m pytest tests/openrlhf"
TRL_SERIES = [f"trl_version.sh {s} -m pytest tests/trl_versions" for s in ("1.12", "1.13", "1.14", "1.15")]
TRL_115_HF = "tests/trl_versions tests/hf/test_hf_trl.py tests/hf/test_trl_outputs.py -q -m not slow"
NUMERICS = "tests/api/test_loss_numerics.py"


def _stub(path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STUB)
    path.chmod(0o755)


def _run_ci(tmp_path, fail: str):
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", repo / ".ci" / "run")
    for script in ("setup.sh", "setup_aot36.sh", "setup_verl.sh", "setup_openrlhf.sh", "setup_trl_versions.sh",
                   "trl_version.sh"):
        _stub(repo / "scripts" / script)
    for venv in (".venv", ".venv-triton36", ".venv-verl", ".venv-openrlhf"):
        _stub(repo / venv / "bin" / "python")
    calls = tmp_path / "calls.log"
    calls.touch()
    env = {**os.environ, "CI_CALLS": str(calls), "CI_FAIL": fail, "SLOW_TESTS_LIMIT_S": "60"}
    proc = subprocess.run([BASH, str(repo / ".ci" / "run")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, calls.read_text().splitlines()


def test_every_step_runs_when_all_pass(tmp_path):
    proc, calls = _run_ci(tmp_path, fail="")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    joined = "\n".join(calls)
    steps = ["setup.sh", FAST_SUITE, BENCHMARKS, SLOW_SUITE, "setup_aot36.sh", "tests/kernels/test_aot.py",
             "setup_verl.sh", ".venv-verl/bin/python -m pytest tests/verl", "setup_openrlhf.sh", OPENRLHF_TESTS,
             "setup_trl_versions.sh all", *TRL_SERIES, NUMERICS]
    at = [next((i for i, c in enumerate(calls) if step in c), None) for step in steps]
    assert None not in at, f"{steps[at.index(None)]!r} never ran:\n{joined}"
    assert at == sorted(at), f"the steps ran out of order:\n{joined}"  # each setup before its tests
    assert TRL_115_HF in joined, joined  # 1.15 also runs 1.16's TRL trainer tests, the fast ones


@pytest.mark.parametrize("failing, not_reached", [
    ("setup.sh", FAST_SUITE),                    # README's install step
    (FAST_SUITE, BENCHMARKS),                    # README's test suite: the failure CI once swallowed
    (BENCHMARKS, SLOW_SUITE),                    # README's benchmark suite
    (SLOW_SUITE, "setup_aot36.sh"),              # the second step's first command
    ("setup_verl.sh", "tests/verl"),             # a command followed by another on the second step
    ("tests/verl", "setup_openrlhf.sh"),
    ("setup_openrlhf.sh", OPENRLHF_TESTS),
    (OPENRLHF_TESTS, "setup_trl_versions.sh"),
    ("setup_trl_versions.sh", TRL_SERIES[0]),
    (TRL_SERIES[0], TRL_SERIES[1]),
    (TRL_SERIES[1], TRL_SERIES[2]),
    (TRL_SERIES[2], TRL_SERIES[3]),
    (TRL_SERIES[3], NUMERICS),                   # the one-thread numerics pass comes after
])
def test_a_failing_step_fails_the_run(tmp_path, failing, not_reached):
    proc, calls = _run_ci(tmp_path, fail=failing)
    assert proc.returncode != 0, f"{failing!r} failed and .ci/run exited 0:\n{proc.stdout}{proc.stderr}"
    ran = [c for c in calls if failing in c]
    assert ran, f"the case's failing step {failing!r} never ran: {calls}"
    after = calls[calls.index(ran[0]) + 1:]
    assert not any(not_reached in c for c in after), f"{not_reached!r} ran after {failing!r} failed: {after}"


def test_readme_test_command_failure_is_named(tmp_path):
    proc, _ = _run_ci(tmp_path, fail=FAST_SUITE)
    assert "[ci] README's test command failed (exit 3)" in proc.stderr, proc.stderr
