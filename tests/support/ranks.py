"""Starting the ranks of the distributed tests: plain processes (one per rank) with a hard time limit.

Importable from the rank processes too (they get the repository root on PYTHONPATH): stdlib only.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT = 150  # seconds for a whole launch (process start, imports, every case); ~10-25 s when idle


def start_ranks(world: int, tmp: Path, argv, env=None) -> list[str]:
    """Start ``world`` processes (``argv(rank)``, extra environment ``env(rank)``), wait at most LAUNCH_TIMEOUT,
    kill any still running; fail on a hang or a non-zero exit. Returns each rank's output."""
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1")
    logs = [open(tmp / f"rank{r}.log", "w") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, *argv(r)], env={**base, **(env(r) if env else {})}, cwd=REPO,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in hung:
            procs[r].kill()
            procs[r].wait()
        for f in logs:
            f.close()
    outputs = [(tmp / f"rank{r}.log").read_text() for r in range(world)]
    tails = "\n".join(f"--- rank {r} ---\n{out[-3000:]}" for r, out in enumerate(outputs))
    assert not hung, f"ranks {hung} still running after {LAUNCH_TIMEOUT} s (a hang):\n{tails}"
    assert all(p.returncode == 0 for p in procs), f"a rank failed:\n{tails}"
    return outputs
