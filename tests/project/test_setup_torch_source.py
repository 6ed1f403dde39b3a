"""scripts/torch_source.sh (where setup.sh gets torch from) and scripts/setup.sh's use of it, without network: a fake
``nvidia-smi`` on PATH stands for the driver, a fake interpreter for the installed torch, a fake pip records what
would be installed (and can fail like an unreachable index). setup.sh's last step, scripts/setup_liger_tests.sh
(tested itself in test_setup_venvs.py), is a stand-in here that records its call and exits as told."""
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None or os.name != "posix", reason="the setup scripts are bash (Linux, macOS)")


def _fake_bin(tmp_path, driver: str | None) -> pathlib.Path:
    """A folder for PATH with `nvidia-smi`: "ok" (a GPU with its driver), "broken" (the tool without a loaded driver,
    it exits 9 as nvidia-smi does), None (no such command)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    smi = fake / "nvidia-smi"
    if driver is not None:
        smi.write_text("#!/bin/sh\n" + ("echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\nexit 0\n" if driver == "ok" else
                                         "echo 'NVIDIA-SMI has failed because it could not communicate with the "
                                         "NVIDIA driver.'\nexit 9\n"))
        smi.chmod(0o755)
    return fake


def _fake_python(path: pathlib.Path, torch: str | None) -> pathlib.Path:
    """An interpreter whose `import torch` gives "<version> <cuda or none>" (torch=None: no torch installed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f'echo "{torch}"\nexit 0\n' if torch else "echo 'ModuleNotFoundError: torch' >&2\nexit 1\n"
    path.write_text("#!/bin/sh\n" + 'case "$*" in *torch.version.cuda*) ' + body.replace("\n", "; ") + ";; esac\n"
                    "echo \"fake python $*\"\n")
    path.chmod(0o755)
    return path


def _decide(tmp_path, driver, torch):
    env = dict(os.environ, PATH=f"{_fake_bin(tmp_path, driver)}:/usr/bin:/bin")
    py = _fake_python(tmp_path / "py" / "python", torch)
    out = subprocess.run([BASH, str(ROOT / "scripts" / "torch_source.sh"), str(py), "2.13.0"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert len(out.stdout.splitlines()) == 1
    return out.stdout.split()[0], out.stdout.strip()


@pytest.mark.parametrize("driver, torch, action", [
    (None, None, "cpu"),                    # a fresh CPU machine: the CPU index
    ("broken", None, "cpu"),                # nvidia-smi without a driver is no GPU
    (None, "2.12.0+cpu none", "cpu"),       # another version: the pinned one from the CPU index
    (None, "2.13.0+cpu none", "keep"),      # already there: nothing downloaded
    (None, "2.13.0 12.8", "keep"),          # the pinned version, whatever its build
    ("ok", "2.11.0+cu126 12.6", "keep-cuda"),  # GPU machine with its own CUDA build: left alone
    ("ok", "2.13.0+cpu none", "default"),   # GPU machine with a CPU build: the CUDA build from the default index
    ("ok", None, "default"),
])
def test_decision(tmp_path, driver, torch, action):
    got, line = _decide(tmp_path, driver, torch)
    assert got == action, line
    if action == "cpu":
        assert "PyTorch's CPU wheel index" in line


# setup_liger_tests.sh's stand-in: its call (with the pip command setup.sh hands it) and its line; it exits as
# $LIGER_STATUS (3: PyPI not reachable, its one line on stderr)
LIGER_STANDIN = ('#!/usr/bin/env bash\necho "setup_liger_tests.sh LIGER_TESTS_PIP=$LIGER_TESTS_PIP" >> "$CALLS"\n'
                 'case ${LIGER_STATUS:-0} in 0) echo ".liger-upstream/0.8.5 ready";; 3) echo "liger tests: PyPI not '
                 'reachable" >&2;; esac\nexit "${LIGER_STATUS:-0}"\n')


def _liger_call(tmp_path):
    return f"setup_liger_tests.sh LIGER_TESTS_PIP={tmp_path / 'pip'}"


def _run_setup(tmp_path, driver, torch, cpu_index_reachable=True, liger_status=0, status=0):
    """Run scripts/setup.sh in a copy of the repo files it needs, with a fake .venv interpreter, a fake pip
    that logs its arguments (one line per call) and fails on the CPU index when it is "unreachable", and
    setup_liger_tests.sh's stand-in (exiting ``liger_status``); setup.sh must exit ``status``. Returns the
    CompletedProcess and the calls."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "lib_venv.sh", "torch_source.sh"):
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    (repo / "scripts" / "setup_liger_tests.sh").write_text(LIGER_STANDIN)
    shutil.copy(ROOT / "constraints.txt", repo / "constraints.txt")
    _fake_python(repo / ".venv" / "bin" / "python", torch)
    calls = tmp_path / "pip_calls.txt"
    pip = tmp_path / "pip"
    pip.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n"
                   # keep a copy of the constraints file it is given (setup.sh may pass a temporary one)
                   f'prev=; for a in "$@"; do [ "$prev" = -c ] && cp "$a" {tmp_path / "constraints_seen.txt"}; '
                   'prev=$a; done\n' + ("" if cpu_index_reachable else
                   'case "$*" in *download.pytorch.org*) echo "ConnectTimeoutError" >&2; exit 1;; esac\n') + "exit 0\n")
    pip.chmod(0o755)
    env = dict(os.environ, PATH=f"{_fake_bin(tmp_path, driver)}:/usr/bin:/bin", SETUP_PIP=str(pip), CALLS=str(calls),
               LIGER_STATUS=str(liger_status))
    out = subprocess.run([BASH, str(repo / "scripts" / "setup.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == status, out.stdout + out.stderr
    return out, calls.read_text().splitlines()


def _setup(tmp_path, driver, torch, cpu_index_reachable=True):
    """setup.sh's stdout and calls, where it succeeds."""
    out, calls = _run_setup(tmp_path, driver, torch, cpu_index_reachable)
    return out.stdout, calls


def test_setup_cpu_machine_uses_the_cpu_index(tmp_path):
    out, calls = _setup(tmp_path, None, None)
    assert calls[0].startswith("install -q --disable-pip-version-check --timeout 10 --retries 0 --index-url "
                               "https://download.pytorch.org/whl/cpu torch==2.13.0"), calls
    assert len(calls) == 3 and "-c constraints.txt -e .[train,test,bench]" in calls[1]
    assert calls[2] == _liger_call(tmp_path)  # Liger's tests fetched after the install, with setup.sh's pip
    assert out.splitlines()[0] == "torch: no NVIDIA driver: torch==2.13.0 from PyTorch's CPU wheel index"
    assert out.splitlines()[-1] == ".liger-upstream/0.8.5 ready"


def test_setup_falls_back_to_the_default_index_in_one_line(tmp_path):
    out, calls = _setup(tmp_path, None, None, cpu_index_reachable=False)
    assert "--index-url https://download.pytorch.org/whl/cpu" in calls[0]
    assert calls[1] == "install -q --disable-pip-version-check torch==2.13.0"  # the default (configured) index
    lines = out.splitlines()
    assert lines[1].startswith("torch: https://download.pytorch.org/whl/cpu not reachable") and len(lines) == 4
    assert "ConnectTimeoutError" not in out  # pip's output goes to the log, not the terminal


def test_setup_leaves_a_cuda_build_alone(tmp_path):
    out, calls = _setup(tmp_path, "ok", "2.11.0+cu126 12.6")
    assert len(calls) == 2 and "torch==" not in calls[0]  # no torch install; constraints without torch / triton
    assert calls[0].split(" -c ")[1].split()[0] != "constraints.txt"
    seen = (tmp_path / "constraints_seen.txt").read_text().splitlines()
    assert not [line for line in seen if line.startswith(("torch==", "triton=="))] and "trl==1.16.0" in seen
    assert "torch: NVIDIA driver found; torch 2.11.0+cu126 (CUDA 12.6) already installed, left alone" in out


def test_setup_keeps_an_installed_pinned_torch(tmp_path):
    out, calls = _setup(tmp_path, None, "2.13.0+cpu none")
    assert calls == [calls[0], _liger_call(tmp_path)] and "-c constraints.txt" in calls[0]


def test_setup_goes_on_where_pypi_cannot_serve_ligers_tests(tmp_path):
    """setup_liger_tests.sh's exit 3 (the archive not downloaded): its one line, and setup succeeds (the tests that
    need Liger's files skip, naming the script)."""
    out, calls = _run_setup(tmp_path, None, "2.13.0+cpu none", liger_status=3)
    assert calls[-1] == _liger_call(tmp_path)
    assert out.stderr.splitlines() == ["liger tests: PyPI not reachable"], out.stderr
    assert ".liger-upstream" not in out.stdout


@pytest.mark.parametrize("liger_status", [1, 2])
def test_setup_fails_where_ligers_tests_fail_otherwise(tmp_path, liger_status):
    """Any other failure (a digest that is not Liger's, no .venv) fails setup with the script's status."""
    out, calls = _run_setup(tmp_path, None, "2.13.0+cpu none", liger_status=liger_status, status=liger_status)
    assert calls[-1] == _liger_call(tmp_path)
