"""The benchmark commands of docs/benchmarks.md (and README), run as a user runs them.

- ``test_documented_commands_verbatim`` (slow, ~1-2 min on 2 cores): both commands exactly as documented, in a
  fresh folder where ``bench-out/`` does not exist, on the quick grid (one timed round): the JSON, the report and
  its bar charts appear, the report has the trainer-vs-TRL table and says that line plots need the full grid.
- The fast tests run the same first command on the memory probe alone (``-k``), and check that an unwritable
  ``--benchmark-json`` path is refused in one line before anything runs.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The commands as documented (docs/benchmarks.md, README); ".venv/bin/python" is this interpreter here.
BENCH = ".venv/bin/python -m pytest benchmarks/ --benchmark-only --benchmark-json bench-out/run.json"
REPORT = ".venv/bin/python -m benchmarks.report bench-out/run.json"


def _workdir(tmp_path) -> pathlib.Path:
    """A folder holding a copy of benchmarks/ (and pytest.ini) and no bench-out/, like a fresh clone."""
    work = tmp_path / "clone"
    shutil.copytree(ROOT / "benchmarks", work / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pytest.ini", work / "pytest.ini")
    return work


def _run(command: str, cwd, extra_args: str = "", timeout: int = 600, **env):
    argv = command.replace(".venv/bin/python", sys.executable, 1).split() + extra_args.split()
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    full_env.pop("TRITON_INTERPRET", None)  # as in a user's shell: the suite decides
    for name in [n for n in full_env if n.startswith("PYTEST_")]:
        # pytest-xdist's worker variables (PYTEST_XDIST_WORKER, ...) make pytest-benchmark disable benchmarks in the
        # child pytest too, which then refuses --benchmark-only: a user's shell has none of them
        del full_env[name]
    return subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_commands_are_the_documented_ones():
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert BENCH in doc and REPORT in doc


@pytest.mark.slow
def test_documented_commands_verbatim(tmp_path):
    work = _workdir(tmp_path)
    bench = _run(BENCH, work, GRPO_BENCH_ROUNDS="1")
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    data = json.loads((work / "bench-out" / "run.json").read_text())
    paths = {b["extra_info"].get("path") for b in data["benchmarks"]}
    assert {"linear", "logits", "logprob", "distill", "trainer", "probe"} <= paths, paths
    report = _run(REPORT, work)
    assert report.returncode == 0, report.stderr[-3000:]
    md = (work / "bench-out" / "run.md").read_text()
    assert "### Trainer step: grpo.train against TRL's GRPOTrainer" in md
    assert "### logits, every token valid: no-grad forward" in md and "peak fwd / bwd" in md
    assert "### distill, every token valid: forward + backward" in md and "| 16RHV |" in md  # TRL's JSD
    assert "line plots against N need" in md and "--bench-grid full" in report.stderr
    for path in ("linear", "logits", "logprob", "distill"):
        png = work / "bench-out" / f"run_bars_{path}.png"
        assert png.stat().st_size > 10_000, png
    # "Not run": one line per reason, not per case (the CPU run skips the CUDA-only providers on many cases)
    not_run = md[md.index("### Not run"):md.index("### Plots")]
    reasons = [line.split(" | ")[1] for line in not_run.splitlines()[4:] if line.startswith("| ")]
    assert reasons and len(reasons) == len(set(reasons)), not_run


def test_first_command_creates_the_folder(tmp_path):
    """The documented command into a folder that does not exist, on the one cheap benchmark (the memory probe)."""
    work = _workdir(tmp_path)
    bench = _run(BENCH, work, "-k memory_probe -p no:cacheprovider", timeout=300)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    data = json.loads((work / "bench-out" / "run.json").read_text())
    assert [b["extra_info"]["path"] for b in data["benchmarks"]] == ["probe"]


def test_unwritable_results_path_is_one_line(tmp_path):
    work = _workdir(tmp_path)
    (work / "bench-out").write_text("a file where the folder should be")
    bench = _run(BENCH, work, "-p no:cacheprovider", timeout=120)
    assert bench.returncode != 0
    lines = [line for line in (bench.stdout + bench.stderr).splitlines() if line.strip()]
    # one line; the OS's wording of the cause varies ("Not a directory", "File exists")
    assert len(lines) == 1 and lines[0].startswith("ERROR: --benchmark-json bench-out/run.json: cannot write the "
                                                   "results there ("), lines
    assert "Traceback" not in bench.stderr
