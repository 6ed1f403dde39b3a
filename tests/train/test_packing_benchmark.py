"""benchmarks/packing_step.py: its documented length distribution leaves >= 70% of the padded batch as padding, and
(slow, ~30 s each) a tiny CPU run writes its table: the three variants after sampling, and with ``--sampling`` the
four from the teacher-forced sampling forward on, ``single_pass`` included (smoke runs of the code paths, no timing
asserted)."""
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
@pytest.mark.parametrize("flags, variants", [
    (["--max-len", "80"], {"padded", "packed", "packed_budget"}),
    (["--max-len", "24", "--sampling"], {"padded", "packed", "packed_budget", "single_pass"}),
], ids=["after-sampling", "sampling"])
def test_a_tiny_run_writes_its_table(tmp_path, flags, variants):
    env = run_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.packing_step", "--out", str(tmp_path), "--prompts", "1",
                           "--steps", "2", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "packing_step.json").read_text())
    results = data["results"]
    assert set(results) == variants and data["setup"]["sampling"] == ("--sampling" in flags)
    assert all("skipped" not in r and r["peak_bytes"] > 0 for r in results.values()), results
    assert results["padded"]["padding_saved"] == 0.0 < results["packed"]["padding_saved"]
    assert results["packed"]["tokens_per_step"] < results["padded"]["tokens_per_step"]
    if "single_pass" in results:  # the loss on the sampling forward's padded rows: the padded run's positions
        assert results["single_pass"]["tokens_per_step"] == results["padded"]["tokens_per_step"]
        assert results["single_pass"]["padding_saved"] == 0.0
    assert "| packed |" in (tmp_path / "packing_step.md").read_text()


def test_sampling_needs_a_single_pass_length(capsys, monkeypatch):
    from benchmarks.packing_step import main

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # main() would set it for the rest of the session otherwise
    with pytest.raises(SystemExit):
        main(["--out", "unused", "--sampling", "--max-len", "65"])
    assert "--sampling: --max-len must be <= 64 (grpo.train's --single-pass limit)" in capsys.readouterr().err
