"""The scripts that make the tests' own environments, without network: scripts/setup_aot36.sh, setup_verl.sh and
setup_openrlhf.sh (a venv each), setup_trl_versions.sh (overlay folders over .venv) and trl_version.sh (a command
under one of them). A fake ``$PYTHON`` makes a fake venv whose interpreter records every pip call (and can fail like
an unreachable CPU index), answers ``sysconfig``'s site-packages query with its venv's ``site`` folder, records the
commands it runs (``-m pytest ...``) with their PYTHONPATH, and whose version checks pass once something was
installed (the overlay checks: once the overlay folder they are given exists)."""
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
    "setup_openrlhf.sh": ("OPENRLHF_VENV", "ready: torch 2.13.0 openrlhf 0.11.2 triton 3.9.0", [
        "install -q --disable-pip-version-check --no-deps openrlhf==0.11.2",
        "install -q --disable-pip-version-check -c scripts/openrlhf-constraints.txt transformers deepspeed peft "
        "accelerate einops sympy pylatexenc torchdata ray aiohttp pillow numpy packaging pytest",
        "install -q --disable-pip-version-check --no-deps triton==3.9.0"]),
}
CPU_INDEX = ("install -q --disable-pip-version-check --timeout 10 --retries 0 --index-url "
             "https://download.pytorch.org/whl/cpu torch==2.13.0")
TRL_RELEASES = {"1.12": "1.12.0", "1.13": "1.13.0", "1.14": "1.14.2", "1.15": "1.15.0"}
# The version check of the venv scripts (and of .venv for the TRL overlays); an overlay's check is given its folder
# as first argument ($5 after -W ignore -c CODE).
CHECK_AFTER_PIP = '[ -s "$CALLS" ]'
CHECK_OVERLAY = '[ -z "$5" ] || [ -d "$5" ]'


def _fake_python3(tmp_path, cpu_index_reachable: bool = True, check: str = CHECK_AFTER_PIP) -> pathlib.Path:
    """``$PYTHON -m venv DIR`` makes DIR/bin/python: ``-m pip ...`` appends its arguments to pip_calls.txt (failing on
    the CPU index when it is unreachable); ``-m pytest ...`` appends PYTHONPATH, GRPO_KERNELS_TEST_TRL_SERIES and its
    arguments to runs.txt; code that reads ``sysconfig`` gets DIR/site; any other call (a version check) exits as
    the shell test ``check``."""
    calls, runs = tmp_path / "pip_calls.txt", tmp_path / "runs.txt"
    venv_python = ("#!/bin/sh\n"
                   f"CALLS={calls}\n"
                   'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$*" >> "$CALLS"\n'
                   + ("" if cpu_index_reachable else
                      '  case "$*" in *download.pytorch.org*) echo "ConnectTimeoutError" >&2; exit 1;; esac\n')
                   + "  exit 0\nfi\n"
                   'if [ "$1" = -m ] && [ "$2" = pytest ]; then\n'
                   f'  echo "PYTHONPATH=$PYTHONPATH SERIES=$GRPO_KERNELS_TEST_TRL_SERIES $*" >> {runs}; exit 0\n'
                   "fi\n"
                   'case "$*" in *sysconfig*) echo "$(cd "$(dirname "$0")/.." && pwd)/site"; exit 0;; esac\n'
                   f"{check}\n")
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\n"
                    '[ "$1" = -m ] && [ "$2" = venv ] || exit 2\n'
                    'mkdir -p "$3/bin"\n'
                    f"cat > \"$3/bin/python\" <<'EOF'\n{venv_python}EOF\n"
                    'chmod +x "$3/bin/python"\n')
    fake.chmod(0o755)
    return fake


def _script(tmp_path, script, env, *args):
    env = dict(os.environ, PATH="/usr/bin:/bin", **env)
    env.pop("PYTHONPATH", None)
    out = subprocess.run([BASH, str(ROOT / "scripts" / script), *args], env=env, capture_output=True, text=True,
                         timeout=60)
    calls = tmp_path / "pip_calls.txt"
    return out, calls.read_text().splitlines() if calls.exists() else []


def _run(tmp_path, script, cpu_index_reachable=True):
    venv = tmp_path / "venv"
    env = {"PYTHON": str(_fake_python3(tmp_path, cpu_index_reachable)), SCRIPTS[script][0]: str(venv)}
    out, calls = _script(tmp_path, script, env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines(), calls, venv


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


def test_openrlhf_tests_are_moved_out_of_site_packages(tmp_path):
    """OpenRLHF's wheel installs a top-level ``tests`` package: the script moves it beside a link to the installed
    openrlhf, with a pytest.ini of its own, so that it cannot shadow this repository's ``tests``."""
    site = tmp_path / "venv" / "site"
    (site / "tests").mkdir(parents=True)
    (site / "tests" / "test_actor_entropy_temperature.py").write_text("")
    (site / "openrlhf").mkdir()
    _run(tmp_path, "setup_openrlhf.sh")
    moved = tmp_path / "venv" / "openrlhf-tests"
    assert not (site / "tests").exists()
    assert (moved / "tests" / "test_actor_entropy_temperature.py").is_file()
    assert (moved / "openrlhf").is_symlink() and (moved / "openrlhf").resolve() == (site / "openrlhf").resolve()
    assert (moved / "pytest.ini").read_text() == "[pytest]\n"


def _trl_env(tmp_path, with_base=True):
    """The TRL scripts' knobs: a fake .venv (made by the fake $PYTHON, as setup.sh would make it) and the overlays'
    folder under tmp_path."""
    fake = _fake_python3(tmp_path, check=CHECK_OVERLAY)
    base, overlays = tmp_path / "base-venv", tmp_path / "overlays"
    if with_base:
        subprocess.run([str(fake), "-m", "venv", str(base)], check=True)
    return {"TRL_BASE_VENV": str(base), "TRL_OVERLAYS": str(overlays)}, overlays


def _common_pins():
    return [line for line in (ROOT / "scripts" / "trl-versions-constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]


def _overlay_call(folder, *pins):
    return (f"install -q --disable-pip-version-check --no-deps --target {folder}.partial "
            f"-c scripts/trl-versions-constraints.txt {' '.join(pins)}")


def test_trl_overlays_first_run_then_cached(tmp_path):
    """One pip call per overlay, --no-deps into a folder moved into place; .venv itself gets no pip call; the second
    run only checks."""
    env, overlays = _trl_env(tmp_path)
    out, calls = _script(tmp_path, "setup_trl_versions.sh", env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert calls == [_overlay_call(overlays / "common", *_common_pins())] + [
        _overlay_call(overlays / s, f"trl=={r}") for s, r in TRL_RELEASES.items()], calls
    assert out.stdout.splitlines() == [f"{overlays}/common ready: requests, aiohttp over {env['TRL_BASE_VENV']}"] + [
        f"{overlays}/{s} ready: trl {r} over {env['TRL_BASE_VENV']}" for s, r in TRL_RELEASES.items()]
    assert sorted(p.name for p in overlays.iterdir()) == ["1.12", "1.13", "1.14", "1.15", "common"]  # no .partial
    again, calls_again = _script(tmp_path, "setup_trl_versions.sh", env, "1.14")
    assert calls_again == calls, calls_again
    assert again.stdout.splitlines() == [f"{overlays}/{n} ready: {what} over {env['TRL_BASE_VENV']} (cached)"
                                         for n, what in (("common", "requests, aiohttp"), ("1.14", "trl 1.14.2"))]


def test_trl_overlays_need_the_main_venv(tmp_path):
    env, overlays = _trl_env(tmp_path, with_base=False)
    out, calls = _script(tmp_path, "setup_trl_versions.sh", env)
    assert out.returncode == 1 and calls == [] and not overlays.exists()
    assert "make it first with bash scripts/setup.sh" in out.stderr, out.stderr


@pytest.mark.parametrize("script, args, usage", [
    ("setup_trl_versions.sh", ["1.16"], "usage: bash scripts/setup_trl_versions.sh [1.12|1.13|1.14|1.15|all]"),
    ("trl_version.sh", ["1.16", "-V"], "usage: bash scripts/trl_version.sh 1.12|1.13|1.14|1.15 ARG..."),
    ("trl_version.sh", [], "usage: bash scripts/trl_version.sh 1.12|1.13|1.14|1.15 ARG..."),
])
def test_trl_scripts_refuse_another_series(tmp_path, script, args, usage):
    env, overlays = _trl_env(tmp_path)
    out, calls = _script(tmp_path, script, env, *args)
    assert out.returncode == 2 and calls == [] and usage in out.stderr, out.stderr
    assert not overlays.exists()


def test_trl_version_runs_the_main_venv_with_the_overlay_first(tmp_path):
    """scripts/trl_version.sh SERIES ARG...: the overlay made if missing (its lines on stderr), then .venv's Python
    with ARG..., the series' folder and the common one first on PYTHONPATH and the series named for the tests."""
    env, overlays = _trl_env(tmp_path)
    env["PYTHONPATH"] = "/callers/path"
    out = subprocess.run([BASH, str(ROOT / "scripts" / "trl_version.sh"), "1.13", "-m", "pytest", "tests/trl_versions",
                          "-q"], env=dict(os.environ, PATH="/usr/bin:/bin", **env), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout == "" and f"{overlays}/1.13 ready: trl 1.13.0" in out.stderr, out.stderr
    assert (tmp_path / "runs.txt").read_text().splitlines() == [
        f"PYTHONPATH={overlays}/1.13:{overlays}/common:/callers/path SERIES=1.13 -m pytest tests/trl_versions -q"]
