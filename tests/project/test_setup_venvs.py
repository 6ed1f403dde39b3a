"""The scripts that make the tests' own environments, without network: scripts/setup_aot36.sh, setup_verl.sh and
setup_openrlhf.sh (a venv each), setup_trl_versions.sh (overlay folders over .venv), trl_version.sh (a command
under one of them) and setup_liger_tests.sh (Liger's own JSD tests from its source archive; the last section). A fake
``$PYTHON`` makes a fake venv whose interpreter records every pip call (and can fail like an unreachable CPU index),
answers ``sysconfig``'s site-packages query with its venv's ``site`` folder, records the commands it runs
(``-m pytest ...``) with their PYTHONPATH, and whose version checks pass once something was installed (the overlay
checks: once the overlay folder they are given exists)."""
import hashlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

from tests.support import liger_upstream as up

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


# ------------------------------------------------------------------------------- scripts/setup_liger_tests.sh
# In a copy of what it needs (itself and its helper, tests/support/liger_upstream.py) with a .venv whose Python is this
# one (the digests and the extraction are real) and a fake pip: its `download` copies an archive into the folder of
# `-d`, or fails as without network.

LIGER_DOWNLOAD = ("download -q --disable-pip-version-check --no-deps --no-binary liger-kernel --timeout 10 --retries 0 "
                  "-d .liger-upstream liger-kernel==0.8.5")
LIGER_READY = ".liger-upstream/0.8.5 ready: Liger-Kernel 0.8.5's JSD tests"
LIGERS_ARCHIVE = up.CACHE / up.ARCHIVE_NAME  # kept there by a run of the script in this checkout


def _liger_repo(tmp_path, with_venv=True) -> pathlib.Path:
    repo = tmp_path / "repo"
    for rel in ("scripts/setup_liger_tests.sh", "tests/__init__.py", "tests/support/__init__.py",
                "tests/support/liger_upstream.py"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, repo / rel)
    if with_venv:
        python = repo / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        python.chmod(0o755)
    return repo


def _setup_liger(tmp_path, repo, archive: pathlib.Path | None):
    """setup_liger_tests.sh run in ``repo`` with a fake pip whose download gives ``archive`` (None: no network);
    the CompletedProcess and pip's calls so far."""
    calls = tmp_path / "pip_calls.txt"
    pip = tmp_path / "pip"
    give = (f'prev=; for a in "$@"; do [ "$prev" = -d ] && cp "{archive}" "$a/{up.ARCHIVE_NAME}"; prev=$a; done\n'
            if archive else 'echo "ConnectTimeoutError" >&2; exit 1\n')
    pip.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n{give}')
    pip.chmod(0o755)
    env = dict(os.environ, PATH="/usr/bin:/bin", LIGER_TESTS_PIP=str(pip))
    env.pop("PYTHONPATH", None)
    out = subprocess.run([BASH, str(repo / "scripts" / "setup_liger_tests.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    return out, calls.read_text().splitlines() if calls.exists() else []


def _tarball(path: pathlib.Path, members: dict) -> str:
    """A .tar.gz at ``path`` holding ``members`` (name under liger_kernel-0.8.5/ -> bytes); its sha256."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"{up.ARCHIVE_TOP}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return up.sha256(path)


def _files(folder: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.mark.skipif(not LIGERS_ARCHIVE.is_file(), reason=f"needs Liger's source archive in .liger-upstream/: "
                    f"{up.SETUP_COMMAND} (scripts/setup.sh runs it) keeps it there")
def test_liger_tests_first_run_then_cached_then_repaired(tmp_path):
    """A first run downloads the archive (a damaged one in the cache is replaced) and extracts only the recorded
    files, each Liger's, with our pytest.ini; the second run only checks; a changed file is extracted again from
    the kept archive, without pip."""
    repo = _liger_repo(tmp_path)
    (repo / ".liger-upstream").mkdir()
    (repo / ".liger-upstream" / up.ARCHIVE_NAME).write_bytes(b"not Liger's archive")
    out, calls = _setup_liger(tmp_path, repo, LIGERS_ARCHIVE)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert calls == [LIGER_DOWNLOAD] and out.stdout.splitlines() == [LIGER_READY]
    folder = repo / ".liger-upstream" / "0.8.5"
    assert _files(folder) == sorted([*up.SHA256, "pytest.ini"])
    assert up.file_digests(folder) == up.SHA256 and (folder / "pytest.ini").read_text() == up.PYTEST_INI
    assert sorted(p.name for p in folder.parent.iterdir()) == ["0.8.5", up.ARCHIVE_NAME, "logs"]  # no .partial
    again, calls = _setup_liger(tmp_path, repo, LIGERS_ARCHIVE)
    assert calls == [LIGER_DOWNLOAD] and again.stdout.splitlines() == [LIGER_READY + " (cached)"]
    (folder / up.FUSED).write_text("# edited\n")
    repaired, calls = _setup_liger(tmp_path, repo, None)  # no network needed
    assert repaired.returncode == 0 and calls == [LIGER_DOWNLOAD], repaired.stderr
    assert repaired.stdout.splitlines() == [LIGER_READY] and up.file_digests(folder) == up.SHA256


def test_liger_tests_without_network_say_so_in_one_line(tmp_path):
    """Exit 3 (setup.sh goes on): one line naming pip's log and the script to rerun; nothing extracted."""
    repo = _liger_repo(tmp_path)
    out, calls = _setup_liger(tmp_path, repo, None)
    assert out.returncode == 3 and out.stdout == "" and calls == [LIGER_DOWNLOAD], out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        "liger tests: liger-kernel 0.8.5's source archive not downloaded, PyPI not reachable? "
        "(.liger-upstream/logs/pip-download.log); tests/hf/test_liger_jsd.py's runs of Liger's own tests skip until "
        "bash scripts/setup_liger_tests.sh succeeds"]
    assert "ConnectTimeoutError" in (repo / ".liger-upstream" / "logs" / "pip-download.log").read_text()
    assert not (repo / ".liger-upstream" / "0.8.5").exists()


def test_liger_tests_refuse_an_archive_that_is_not_ligers(tmp_path):
    """A download with another sha256: exit 1, one line naming both digests; the archive removed, nothing
    extracted."""
    repo = _liger_repo(tmp_path)
    other = tmp_path / "other.tar.gz"
    digest = _tarball(other, {name: b"" for name in up.SHA256})
    out, calls = _setup_liger(tmp_path, repo, other)
    assert out.returncode == 1 and out.stdout == "" and calls == [LIGER_DOWNLOAD], out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        f"liger tests: .liger-upstream/{up.ARCHIVE_NAME}: sha256 {digest}, not Liger-Kernel 0.8.5's source archive "
        f"({up.ARCHIVE_SHA256})"]
    assert sorted(p.name for p in (repo / ".liger-upstream").iterdir()) == ["logs"]


def test_liger_tests_need_the_main_venv(tmp_path):
    out, calls = _setup_liger(tmp_path, _liger_repo(tmp_path, with_venv=False), None)
    assert out.returncode == 1 and calls == []
    assert out.stderr.splitlines() == ["liger tests: .venv is missing: make it first with bash scripts/setup.sh"]


def test_liger_extraction_checks_every_file(tmp_path):
    """The extraction takes the recorded members alone and checks each: a file that differs, or one the archive
    lacks, fails in one line naming it and leaves no folder, not even a half-filled one."""
    archive = tmp_path / "a.tar.gz"
    members = {"test/a.py": b"a = 1\n", "LICENSE": b"BSD\n", "test/unused.py": b""}
    digest = _tarball(archive, members)
    recorded = {n: hashlib.sha256(members[n]).hexdigest() for n in ("test/a.py", "LICENSE")}
    folder = tmp_path / "cache" / "0.8.5"
    up.extract(archive, folder, want=digest, files=recorded)
    assert _files(folder) == ["LICENSE", "pytest.ini", "test/a.py"]
    shutil.rmtree(folder)
    for files, says in (({**recorded, "LICENSE": "0" * 64}, "LICENSE not as recorded"),
                        ({**recorded, "test/b.py": "0" * 64}, f"no plain file {up.ARCHIVE_TOP}/test/b.py")):
        with pytest.raises(up.FetchError, match=says):
            up.extract(archive, folder, want=digest, files=files)
        assert sorted(p.name for p in folder.parent.iterdir()) == []
    with pytest.raises(up.FetchError, match=f"sha256 {digest}, not Liger-Kernel 0.8.5's"):
        up.extract(archive, folder)  # the real digest: this archive is not Liger's
