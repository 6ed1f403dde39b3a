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
