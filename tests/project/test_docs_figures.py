"""Figures the documentation states that the code defines, checked against the code (documentation that cannot
drift): docs/kernels.md's AOT config counts (per module and in all, from every kernel module's ``aot_launches()`` as
tools/aot.py records them), the instruction budget of the row sweeps README.md and docs/kernels.md state
(``tools.aot.SWEEP_BUDGET``, which tests/kernels/test_aot.py holds the sweeps to) and docs/numerics.md's pass rule
(tests/support/tolerances.py's K, FLOOR_TERMS, U and ATOL)."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from ..support.tolerances import ATOL, FLOOR_TERMS, K, U

ROOT = Path(__file__).resolve().parents[2]
KERNELS_MD = (ROOT / "docs" / "kernels.md").read_text()
NUMERICS_MD = (ROOT / "docs" / "numerics.md").read_text()
README = (ROOT / "README.md").read_text()
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "float64": torch.float64}


def stated_aot_counts(text: str) -> tuple[int, int, dict[str, int]]:
    """(per architecture, all architectures, {module: configs}) as docs/kernels.md's variant list states them."""
    heading = re.search(r"### The variant list \(per architecture; (\d+) configs, (\d+) for sm_90 \+ sm_80\)", text)
    assert heading, "docs/kernels.md: no '### The variant list (per architecture; N configs, M for ...)' heading"
    table = text[heading.end():text.index("\n### ", heading.end())]
    rows = dict(re.findall(r"^\| `(\w+_kernels)` \|.*\| (\d+) \|$", table, re.M))
    return int(heading[1]), int(heading[2]), {m: int(n) for m, n in rows.items()}


def test_kernels_md_states_the_declared_aot_config_counts():
    """Computed from the modules (a child process records every scenario, ~5 s): a scenario added on any branch
    changes the count, and this test names the figures docs/kernels.md must then state."""
    pytest.importorskip("triton")
    from tools import aot

    configs = aot.declared_configs()
    archs = sorted({a for a, _, _ in configs})
    per_arch = {a: Counter(m.rsplit(".", 1)[1] for b, m, _ in configs if b == a) for a in archs}
    assert len({tuple(sorted(c.items())) for c in per_arch.values()}) == 1, \
        f"the architectures declare different configs: {per_arch}"
    modules = per_arch[archs[0]]
    declared = (sum(modules.values()), len(configs), dict(sorted(modules.items())))
    stated = stated_aot_counts(KERNELS_MD)
    assert stated == declared, (f"docs/kernels.md states {stated}; the modules declare {declared[0]} configs per "
                                f"architecture, {declared[1]} in all, per module {declared[2]}")


def test_the_aot_count_check_sees_a_stale_figure():
    stale = KERNELS_MD.replace("562 for sm_90", "442 for sm_90")
    assert stated_aot_counts(stale)[1] == 442 != stated_aot_counts(KERNELS_MD)[1]


def stated_budgets(text: str) -> list[int]:
    """Every instruction budget ``text`` states: 'N SASS instructions per element', 'the N budget',
    'budget of N'."""
    patterns = (r"(\d+) SASS instructions per element", r"the (\d+) budget", r"budget of\s+(\d+)")
    return [int(n) for p in patterns for n in re.findall(p, text)]


def test_docs_state_the_sweep_instruction_budget():
    from tools import aot

    for name, text in (("README.md", README), ("docs/kernels.md", KERNELS_MD)):
        budgets = stated_budgets(text)
        assert budgets and set(budgets) == {aot.SWEEP_BUDGET}, \
            f"{name} states instruction budgets {budgets}; tools/aot.py's SWEEP_BUDGET is {aot.SWEEP_BUDGET}"
    assert stated_budgets("at most 15 SASS instructions per element") == [15]


def test_numerics_md_states_the_pass_rule_of_the_tests():
    assert f"K = {K:g}" in NUMERICS_MD, f"docs/numerics.md does not state K = {K:g}"
    assert f"`ATOL[D] = {FLOOR_TERMS} u(compute) + u(D)`" in NUMERICS_MD
    rows = re.findall(r"^\| (fp32|bf16|fp16|float64) \| 2\^-(\d+) \| ([0-9.]+e-\d+) \|$", NUMERICS_MD, re.M)
    assert {name for name, _, _ in rows} == set(DTYPE_NAMES), rows
    for name, exponent, atol in rows:
        dtype = DTYPE_NAMES[name]
        assert 2.0 ** -int(exponent) == U[dtype], (name, exponent)
        assert float(atol) == float(f"{ATOL[dtype]:.1e}"), \
            f"docs/numerics.md: ATOL[{name}] {atol}, the tests use {ATOL[dtype]:.1e}"


README_TIMES = ROOT / "benchmarks" / "results" / "readme_commands_cpu.md"
TIME_ROW = re.compile(r"^\| (setup|train|main-again|tests) \| (\d+) \| (\d+ min \d\d s) \|", re.M)


def test_readme_states_the_measured_times_of_its_commands():
    """README's table of its two commands' times is the last fresh-clone measurement's
    (scripts/time_readme_commands.sh writes the results file): every command exited 0 and README states each time
    and the measurement's date."""
    measured = README_TIMES.read_text()
    rows = TIME_ROW.findall(measured)
    assert [name for name, _, _ in rows] == ["setup", "train", "main-again", "tests"], rows
    assert all(rc == "0" for _, rc, _ in rows), rows
    date = re.search(r"fresh clone \((\d{4}-\d\d-\d\d), commit", measured)[1]
    table = README[README.index("| on a 2-core machine"):README.index("The main job shows")]
    for name, _, wall in rows:
        assert wall in table, f"README's times table does not state the measured {name} time {wall!r}"
    assert date in table, f"README's times table does not name the measurement's date {date}"


def test_the_times_script_reports_what_its_run_logged(tmp_path):
    """scripts/time_readme_commands.sh --report on a run's logs (made up here) writes the table the test above
    reads, a failed command's exit status included."""
    import subprocess

    (tmp_path / "times.txt").write_text("setup 0 76 0.5 1.2\ntrain 0 65 1.2 1.1\nmain-again 0 601 1.1 1.0\n"
                                        "tests 1 9 1.0 2.0\n")
    (tmp_path / "commit.txt").write_text("abc1234\n")
    (tmp_path / "log-train.txt").write_text("[grpo.train] output folder runs/version_0\n"
                                            "[grpo.train] greedy accuracy on the 58 held-out prompts 0.0 -> 1.0\n")
    (tmp_path / "log-main-again.txt").write_text("[grpo.train] output folder runs/version_1\n")
    (tmp_path / "log-tests.txt").write_text("1 failed, 10 passed in 3.00s\n")
    out = tmp_path / "report.md"
    subprocess.run(["bash", str(ROOT / "scripts" / "time_readme_commands.sh"), "--report", str(tmp_path)], check=True,
                   env={"PATH": "/usr/bin:/bin", "README_TIMES_OUT": str(out)}, capture_output=True)
    rows = TIME_ROW.findall(out.read_text())
    assert rows == [("setup", "0", "1 min 16 s"), ("train", "0", "1 min 05 s"), ("main-again", "0", "10 min 01 s"),
                    ("tests", "1", "0 min 09 s")]
    assert "runs/version_1" in out.read_text() and "1 failed, 10 passed" in out.read_text()
