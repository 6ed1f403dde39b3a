"""Liger-Kernel 0.8.5's own JSD tests, fetched (not kept in this repository) from its source archive on PyPI into
``.liger-upstream/0.8.5`` by scripts/setup_liger_tests.sh, and run in a subprocess with Liger's JSD names bound to
grpo_kernels.liger's (the plugin tests/support/liger_upstream_plugin.py) by tests/hf/test_liger_jsd.py: which files and
their digests, what to run, what may fail and why, and how a run's outcomes are read. Also the script's helper:
``python -m tests.support.liger_upstream check-folder FOLDER | check-archive ARCHIVE | extract ARCHIVE FOLDER``
(standard library only)."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIGER_VERSION = "0.8.5"
CACHE = ROOT / ".liger-upstream"  # git-ignored
UPSTREAM = CACHE / LIGER_VERSION  # the extracted files: the root of Liger's test run
ARCHIVE_TOP = f"liger_kernel-{LIGER_VERSION}"  # the archive's one top folder
ARCHIVE_NAME = f"{ARCHIVE_TOP}.tar.gz"  # kept in CACHE: a damaged folder is re-extracted offline
ARCHIVE_SHA256 = "4e8f8f611a8ad735c37c989410d09820bb08881f131851a3967c34baa7889d66"  # PyPI's sdist
SETUP_COMMAND = "bash scripts/setup_liger_tests.sh"
SKIP_REASON = (f"needs Liger-Kernel {LIGER_VERSION}'s own JSD tests, fetched from its source archive on PyPI into "
               f".liger-upstream/{LIGER_VERSION} by {SETUP_COMMAND} (scripts/setup.sh runs it; missing where PyPI "
               "could not be reached then): run it, then these run")
PLUGIN = "tests.support.liger_upstream_plugin"
# Ours, written into UPSTREAM with Liger's files and again before each run: it makes that folder the run's rootdir
# (Liger's node ids, Liger's conftest.py alone, no search up into this repository's pytest.ini), with Liger's
# python_files (its pyproject.toml).
PYTEST_INI = ("[pytest]\n# grpo-kernels' settings for Liger-Kernel's tests (tests/support/liger_upstream.py)\n"
              "python_files = test_*.py\n")
FUSED = "test/transformers/test_fused_linear_jsd.py"
CHUNKED = "test/chunked_loss/test_jsd_loss.py"

# The files the run needs (and Liger's license and notice, which go with the copy), relative to the archive's top
# folder (ARCHIVE_TOP), with their sha256: a changed copy is no longer Liger's test. test_jsd.py holds the JSD
# torch reference the fused tests import (its own tests are not run); the rest are Liger's test helpers and fixtures.
SHA256 = {
    "test/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "test/conftest.py": "3f39ff918d1d31798bc727fd8949fd0589481707ced67614286b7d0d578de480",
    "test/utils.py": "367df4d2a52b56a0b6204906227cea3adfcc1eaa4e5723da7bdf188093d88e69",
    "test/transformers/test_jsd.py": "93d2b9e95cb9b28626f3c78a6f0784c3e5bd0d9400bd0a7f7a0953aa7faa483d",
    FUSED: "23792bc1a9bf766ca389cf0f8805ada28a2e471e503844effb0578fd0e04fa0a",
    "test/chunked_loss/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    CHUNKED: "9de6cda1f735535262d48448f3ed9eec977d4e828c747679ddc2e1098955f311",
    "LICENSE": "3a1ccb0c7274b68e1af2ca1d54b10b662085ca56753400182ecf87ae33f2d1a8",
    "NOTICE": "9e3c27a0f64b87d00df12250cf1bc218b1e2fbc5fffc0bd64737ba8e8357218f",
}

# One case of each of Liger's test functions (the fast suite's selection; the slow test runs every case): the small
# shapes; fp32 for the correctness tests, whose bf16 tolerances (up to rtol 0.5) pass with beta read backwards
# (tests/hf/test_liger_jsd.py::test_liger_jsd_tests_fail_with_beta_read_backwards), bf16 for the others.
FAST = [
    f"{FUSED}::test_low_probability_vocab_block_is_finite",
    f"{FUSED}::test_correctness[2.0-0.1-1.0-dtype1-1e-05-0.0005-4-423-167-1423]",
    f"{FUSED}::test_correctness_with_ignore_index[1.0-1.0-2-1.0-dtype1-1e-05-0.0005-4-423-167-1423]",
    f"{FUSED}::test_correctness_functional[accum_dtype1-2.0-0.1-42-0.5-dtype1-1e-05-0.0005-9-7-41-41]",
    f"{FUSED}::test_correctness_all_ignored[2.0-0.1-42-1.0-dtype0-0.005-0.05-4-423-167-1423]",
    f"{FUSED}::test_amp[autocast_dtype0-0.005-0.05]",
    f"{FUSED}::test_logits_projection_is_not_rounded_to_input_dtype[0.5-dtype0]",
    f"{CHUNKED}::test_correctness[42-2.0-0.0-1.0-0.8-True-1.0-dtype1-1e-05-0.0005-3-47-31-123]",
    f"{CHUNKED}::test_correctness_functional[2.0-0.1-0.9-0.5-42-True-1.0-dtype1-0.0001-0.005-9-7-41-41]",
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[0.0-False-False]",
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[0.0-True-True]",
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[0.5-False-True]",
]

# The documented deviations (docs/api.md, "Coming from Liger-Kernel"): node id -> (what the failure must say, why).
EXPECTED_FAILURES = {
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[{case}]": (
        "assert False == True",
        "the test spies on torch.nn.functional.nll_loss, Liger's implementation of the hard loss; ours takes the "
        "student's log-prob of the label from linear_token_logprobs (no logits held), so the spy sees no call. What "
        "the test means, the hard loss computed exactly when weighted or returned and equal to the cross-entropy, "
        "is tests/hf/test_liger_jsd.py::test_hard_loss_computed_only_when_used")
    for case in ("0.0-True-True", "0.5-False-True")
}
# Skipped by Liger's own skipif on a machine without CUDA (it needs torch.mm's out_dtype on sm_80+): on a GPU it runs.
CUDA_ONLY = "test_logits_projection_is_not_rounded_to_input_dtype"
FLIP_ENV = "GRPO_LIGER_UPSTREAM_FLIP_BETA"
SUMMARY = re.compile(r"grpo_kernels\.liger: bound (.*); calls: (.*)")


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def file_digests(folder: Path = UPSTREAM) -> dict:
    return {name: sha256(folder / name) for name in SHA256}


def fetched(folder: Path = UPSTREAM) -> bool:
    """Every file of ``SHA256`` is in ``folder`` (whether each is Liger's: test_fetched_tests_are_liger_085)."""
    return all((folder / name).is_file() for name in SHA256)


def run_upstream(selection: list[str], junit: Path, timeout: int = 900, flip_beta: bool = False):
    """Liger's tests ``selection`` (node ids or files, relative to UPSTREAM) in a subprocess from that folder, with
    the plugin (``flip_beta``: ours with 1 - beta); its outcomes in ``junit`` (JUnit XML). Returns the
    CompletedProcess."""
    ini = UPSTREAM / "pytest.ini"
    if not ini.is_file() or ini.read_text() != PYTEST_INI:
        ini.write_text(PYTEST_INI)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != FLIP_ENV}
    if flip_beta:
        env[FLIP_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(UPSTREAM)])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN,
           "-W", "ignore::RuntimeWarning", f"--junitxml={junit}", *selection]
    return subprocess.run(cmd, cwd=UPSTREAM, env=env, capture_output=True, text=True, timeout=timeout)


def outcomes(junit: Path) -> dict:
    """node id -> ("passed" | "failed" | "skipped" | "error", message) from a JUnit XML report."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"  # test.x.test_y -> test/x/test_y.py
        kind, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
        found[node] = (kind, message)
    return found



# ------------------------------------------------------------------- the fetch (scripts/setup_liger_tests.sh)

class FetchError(Exception):
    """What went wrong, in one line (the script prints it)."""


def check_archive(archive: Path, want: str = ARCHIVE_SHA256) -> None:
    """FetchError unless ``archive`` exists with the sha256 ``want``."""
    if not Path(archive).is_file():
        raise FetchError(f"{archive}: no such file")
    got = sha256(archive)
    if got != want:
        raise FetchError(f"{archive}: sha256 {got}, not Liger-Kernel {LIGER_VERSION}'s source archive ({want})")


def extract(archive: Path, folder: Path, want: str = ARCHIVE_SHA256, files: dict | None = None) -> None:
    """The members ``files`` (name -> sha256; default ``SHA256``) of the archive's top folder, alone, into
    ``folder``, each checked, with ``PYTEST_INI``: built in ``folder``.partial and moved into place, so that a failed
    run leaves no half-filled folder and a rerun replaces a damaged one whole. FetchError on a bad archive or file."""
    files = SHA256 if files is None else files
    check_archive(archive, want)
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = {m.name: m for m in tar.getmembers()}
            for name in files:
                member = members.get(f"{ARCHIVE_TOP}/{name}")
                if member is None or not member.isfile():
                    raise FetchError(f"{archive}: no plain file {ARCHIVE_TOP}/{name}")
                (partial / name).parent.mkdir(parents=True, exist_ok=True)
                (partial / name).write_bytes(tar.extractfile(member).read())
        wrong = [n for n, want_n in files.items() if sha256(partial / n) != want_n]
        if wrong:
            raise FetchError(f"{archive}: {', '.join(wrong)} not as recorded in tests/support/liger_upstream.py")
        (partial / "pytest.ini").write_text(PYTEST_INI)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def main(argv: list[str]) -> int:
    """check-folder FOLDER (0: every file there and Liger's; 1 otherwise, silently), check-archive ARCHIVE,
    extract ARCHIVE FOLDER (0, or 1 with one line on stderr)."""
    usage = "usage: python -m tests.support.liger_upstream check-folder FOLDER | check-archive ARCHIVE | " \
            "extract ARCHIVE FOLDER"
    commands = {"check-folder": 1, "check-archive": 1, "extract": 2}
    if not argv or commands.get(argv[0]) != len(argv) - 1:
        print(usage, file=sys.stderr)
        return 2
    command, *paths = argv
    if command == "check-folder":
        folder = Path(paths[0])
        return 0 if fetched(folder) and file_digests(folder) == SHA256 else 1
    try:
        if command == "check-archive":
            check_archive(Path(paths[0]))
        else:
            extract(Path(paths[0]), Path(paths[1]))
    except FetchError as error:
        print(f"liger tests: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
