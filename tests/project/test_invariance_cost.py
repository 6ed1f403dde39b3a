"""benchmarks/invariance_cost.py, the command that writes the table docs/benchmarks.md includes
(benchmarks/results/invariance_cost_cpu.md): it runs on tiny shapes with one round into a fresh folder and writes a
well-formed table (a dated header naming the command, the commit, the CPU, its cores and torch; every section's
table with a numeric cell per variant); its floor section is the planner's (the bisection finds the bytes the
budget's error names), and the committed results file is the one docs/benchmarks.md cites, written by the
documented command."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from benchmarks import invariance_cost

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m benchmarks.invariance_cost --out benchmarks/results"


def _tables(text: str) -> list[list[list[str]]]:
    """Every markdown table of ``text`` as rows of cells (header and separator rows dropped)."""
    tables, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if current is None:
                current = [cells]
            elif not set("".join(cells)) <= set("-:"):
                current.append(cells)
        elif current is not None:
            tables.append(current)
            current = None
    return tables + ([current] if current else [])


def test_the_tiny_run_writes_a_well_formed_table(tmp_path):
    out = tmp_path / "fresh" / "results"
    invariance_cost.main(["--out", str(out), "--tiny", "--rounds", "1"])
    text = (out / invariance_cost.RESULTS_NAME).read_text()
    assert re.search(r"Written by `python -m benchmarks\.invariance_cost --out \S+ --tiny --rounds 1` on "
                     r"\d{4}-\d\d-\d\d \d\d:\d\d at commit \S+", text), text[:400]
    assert f"{torch.__version__}" in text and "cores" in text and invariance_cost.cpu_model() in text
    tables = _tables(text)
    grid = invariance_cost.TINY
    # quick grid, block sweep, one table per case against N, the floor
    assert len(tables) == 2 + 4 + 1, [t[0] for t in tables]
    quick, blocks, *per_n, floor = tables
    assert len(quick) == 1 + 8 and len(blocks) == 1 + 8
    assert blocks[0][2:] == [f"{b} rows ms (ratio)" for b in grid.blocks]
    for table in per_n:
        assert [row[0] for row in table[1:]] == [str(n) for n in grid.ns]
        assert table[0][2:] == ["invariant ms (ratio)"] + [f"{b} rows ms (ratio)" for b in grid.n_blocks]
    for table in [quick, blocks, *per_n]:
        for row in table[1:]:
            assert len(row) == len(table[0]) and re.fullmatch(r"\d+\.\d", row[1]), row
            assert all(re.fullmatch(r"\d+\.\d \(\d+\.\d\dx\)", c) for c in row[2:]), row
    assert len(floor) == 1 + 2 * 4 * len(grid.floor_shapes)
    assert all(re.fullmatch(r"\d+(\.\d\d [KM]iB| B)", c) for row in floor[1:] for c in row[4:]), floor


def test_the_floor_is_the_bytes_the_budget_error_names():
    """The bisection's floor is the planner's: one byte less raises the budget's error, which names that floor."""
    plan = invariance_cost._floor_plans(9, 8, 64, "cpu")["logits log-probs, no grad"]
    floor = invariance_cost.smallest_budget(lambda b: plan(b, batch_invariant=True))
    assert plan(floor, batch_invariant=True).batch_invariant
    with pytest.raises(ValueError, match=f"below the {floor} bytes"):
        plan(floor - 1, batch_invariant=True)
    # logits.torch: the block's two fp32 temporaries per row of V, and 16 bytes per token
    assert floor == 256 * 2 * 4 * 64 + 16 * 9


def test_the_results_file_is_the_documented_commands():
    text = (ROOT / "benchmarks" / "results" / invariance_cost.RESULTS_NAME).read_text()
    assert f"Written by `{COMMAND} " in text or f"Written by `{COMMAND}`" in text
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert COMMAND in doc and f"benchmarks/results/{invariance_cost.RESULTS_NAME}" in doc


BEGIN, END = "<!-- tables of benchmarks/results/invariance_cost_cpu.md: begin -->", \
    "<!-- tables of benchmarks/results/invariance_cost_cpu.md: end -->"


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_docs_copy_the_results_tables_verbatim():
    """docs/benchmarks.md's copy of the tables (between its markers) is the results file's, line for line: a new
    run of the command means a new copy."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    assert BEGIN in doc and END in doc
    copy = doc[doc.index(BEGIN):doc.index(END)]
    results = (ROOT / "benchmarks" / "results" / invariance_cost.RESULTS_NAME).read_text()
    assert _table_lines(copy) == _table_lines(results)
