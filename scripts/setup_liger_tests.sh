#!/usr/bin/env bash
# Fetch Liger-Kernel 0.8.5's own JSD tests, which tests/hf/test_liger_jsd.py runs with Liger's names bound to
# grpo_kernels.liger's (docs/api.md "Coming from Liger-Kernel"). They are Liger's code, under its BSD 2-clause license,
# so this repository does not hold them: they come from Liger's source archive on PyPI,
#   pip download liger-kernel==0.8.5 --no-binary liger-kernel --no-deps    (liger_kernel-0.8.5.tar.gz, 6.8 MB, sha256
#   4e8f8f611a8ad735c37c989410d09820bb08881f131851a3967c34baa7889d66; pip prepares its metadata, which installs
#   setuptools, wheel and setuptools-scm into pip's own temporary build environment),
# kept in .liger-upstream/ (git-ignored), and only the files the run needs are extracted, with Liger's LICENSE and
# NOTICE, into .liger-upstream/0.8.5/, each checked against its sha256 (SHA256 in tests/support/liger_upstream.py):
#   test/transformers/test_fused_linear_jsd.py   LigerFusedLinearJSD / liger_fused_linear_jsd (run)
#   test/chunked_loss/test_jsd_loss.py           LigerFusedLinearJSDLoss and the chunked functional (run)
#   test/transformers/test_jsd.py                its JSD torch reference, imported by the fused tests (not run)
#   test/utils.py, test/conftest.py, test/__init__.py, test/chunked_loss/__init__.py   Liger's helpers and fixtures
# The source matches the installed wheel's liger_kernel package file for file. What is ours stays in tests/support/:
# the pytest plugin that binds the names (liger_upstream_plugin.py) and the pytest.ini that makes the folder the root
# of Liger's run (liger_upstream.py: PYTEST_INI, written there with the files and again before each run). By hand:
#   cd .liger-upstream/0.8.5 && PYTHONPATH=../..:. ../../.venv/bin/python -m pytest -q \
#       -p tests.support.liger_upstream_plugin test/transformers/test_fused_linear_jsd.py \
#       test/chunked_loss/test_jsd_loss.py
# scripts/setup.sh runs this script after its install. Idempotent: a second run only checks the files' digests
# (0.05-0.14 s); a damaged folder is extracted again from the kept archive, offline. A first run, 2026-12-04 on 2
# cores: 15.9 s with pip's cache off, 7.5 s with it warm (most of it pip's build environment). Exit status: 0 ready; 3 the archive could not be downloaded (PyPI not reachable: one line
# on stderr, pip's output in .liger-upstream/logs/pip-download.log; setup.sh goes on, the tests that need the files
# skip naming this script); 1 anything else (no .venv, a digest that is not Liger's: one line on stderr).
# Knob: LIGER_TESTS_PIP (the pip command, .venv's; setup.sh passes its own, tests replace it).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.8.5
CACHE=.liger-upstream
FOLDER=$CACHE/$VERSION
ARCHIVE=$CACHE/liger_kernel-$VERSION.tar.gz
LOG=$CACHE/logs/pip-download.log
PY=.venv/bin/python
HELPER="$PY -m tests.support.liger_upstream"  # the digests and the extraction (standard library only)
if [ ! -x "$PY" ]; then
    echo "liger tests: .venv is missing: make it first with bash scripts/setup.sh" >&2
    exit 1
fi
PIP=${LIGER_TESTS_PIP:-$PY -m pip}
if $HELPER check-folder "$FOLDER" > /dev/null 2>&1; then
    echo "$FOLDER ready: Liger-Kernel $VERSION's JSD tests (cached)"
    exit 0
fi
if ! $HELPER check-archive "$ARCHIVE" > /dev/null 2>&1; then
    rm -f "$ARCHIVE"  # absent, or not Liger's: downloaded again
    mkdir -p "$CACHE/logs"
    if ! $PIP download -q --disable-pip-version-check --no-deps --no-binary liger-kernel --timeout 10 --retries 0 \
            -d "$CACHE" "liger-kernel==$VERSION" > "$LOG" 2>&1; then
        echo "liger tests: liger-kernel $VERSION's source archive not downloaded, PyPI not reachable? ($LOG);" \
             "tests/hf/test_liger_jsd.py's runs of Liger's own tests skip until bash scripts/setup_liger_tests.sh" \
             "succeeds" >&2
        exit 3
    fi
    if ! $HELPER check-archive "$ARCHIVE"; then  # its line names both digests
        rm -f "$ARCHIVE"
        exit 1
    fi
fi
$HELPER extract "$ARCHIVE" "$FOLDER"
echo "$FOLDER ready: Liger-Kernel $VERSION's JSD tests"
