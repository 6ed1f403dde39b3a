"""benchmarks/packing_step.py: its documented length distribution leaves >= 70% of the padded batch as padding, and
(slow, ~30 s) a tiny CPU run of all three variants writes its table (a smoke run of the code path, no timing
asserted; a completion limit above 64 tokens, where grpo.train has no single pass)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.packing_step import G, lengths

from ..support.train_runs import REPO, run_env


def test_the_long_tailed_batch_is_mostly_padding():
    prompt, completion = lengths(prompts=4, max_len=256, seed=0)
    assert len(prompt) == len(completion) == 4 * G
    assert all(8 <= p <= 32 for p in prompt) and all(1 <= c <= 256 for c in completion)
    assert completion[::G] == [256] * 4  # one completion per group runs to the limit
    padding = 1 - sum(p + c for p, c in zip(prompt, completion)) / (len(prompt) * (max(prompt) + 256))
    assert padding >= 0.70  # bound: not a tolerance: "mostly padding", the benchmark's premise


@pytest.mark.slow
def test_a_tiny_run_writes_its_table(tmp_path):
    env = run_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.packing_step", "--out", str(tmp_path), "--prompts", "1",
                           "--max-len", "80", "--steps", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "packing_step.json").read_text())
    results = data["results"]
    assert set(results) == {"padded", "packed", "packed_budget"}
    assert all("skipped" not in r and r["peak_bytes"] > 0 for r in results.values()), results
    assert results["padded"]["padding_saved"] == 0.0 < results["packed"]["padding_saved"]
    assert results["packed"]["tokens_per_step"] < results["padded"]["tokens_per_step"]
    assert "| packed |" in (tmp_path / "packing_step.md").read_text()
