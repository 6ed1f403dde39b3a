"""The cost of ``batch_invariant=True`` against the default call, on the CPU, in one process, written as the table
docs/benchmarks.md ("Batch invariance: cost") includes: benchmarks/results/invariance_cost_cpu.md.

    .venv/bin/python -m benchmarks.invariance_cost --out benchmarks/results [--rounds 9] [--threads 1]

Four sections, each call fp32 with the loss dapo (old and reference log-probs, beta 0.04):
- the quick grid's CPU shape (B = 8, T = 64, H = 64, V = 8000; "padded": a third of the tokens masked, 344 valid
  rows): the head's loss forward + backward, the logits loss forward + backward, the no-grad log-probs of both,
  default against the device's block (256 rows on CPU);
- the block size (``invariant_block_rows``) swept at that shape, every row valid (N = 512) and padded (344);
- the cost against N (one sequence of N tokens, H = 256, V = 32000): the head's and the logits' no-grad log-probs
  and loss step, default against the device's block and smaller chosen blocks;
- the floor: the smallest ``memory_budget`` each call accepts, default against invariant, from the planner alone
  (``grpo_kernels.explain.plan_call``; nothing runs), on the CPU and on meta tensors (which plan as a CUDA device).
Each timing round runs every variant of a case back to back, the order rotating, so that a shared machine's load
falls on all of them alike; the table gives the median of the rounds (after one warm-up call of each variant) and
each variant's ratio to the default call. The file's header names the date, commit, CPU, cores, torch and the load
average before and after. ``--tiny`` (tests/project/test_invariance_cost.py): tiny shapes, seconds.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

import grpo_kernels as gk
from grpo_kernels.explain import plan_call
from grpo_kernels.invariance import block_rows

RESULTS_NAME = "invariance_cost_cpu.md"
LOSS_OPTIONS = dict(beta=0.04, loss_type="dapo")


@dataclass(frozen=True)
class Grid:
    """The shapes of one run: the quick grid's (B, T, H, V), the block sizes swept there, the cost-against-N shape
    (H, V), its N values and its chosen blocks, and the floor's shapes ((N, H, V) each) and chosen block."""

    quick: tuple = (8, 64, 64, 8000)
    blocks: tuple = (64, 128, 256, 512)
    n_shape: tuple = (256, 32000)
    ns: tuple = (1, 4, 16, 64, 255, 256, 257, 512, 1024)
    n_blocks: tuple = (64, 16)
    floor_shapes: tuple = ((1024, 256, 32000), (8192, 4096, 151936))
    floor_block: int = 64


TINY = Grid(quick=(2, 6, 8, 64), blocks=(4, 8), n_shape=(8, 64), ns=(1, 5, 9), n_blocks=(4,),
            floor_shapes=((9, 8, 64),), floor_block=4)


def _calls(B: int, T: int, H: int, V: int, padded: bool, seed: int = 0) -> dict:
    """{case name: fn(**options)}: the head's and the logits' loss forward + backward and no-grad log-probs on one
    (B, T) grid (``padded``: the last third of each row masked)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.1).requires_grad_(True)
    logits = torch.randn(B, T, V, generator=g).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    if padded:
        mask[:, T - T // 3:] = False
    adv, old = torch.randn(B, generator=g), torch.randn(B, T, generator=g) * 0.1 - 9.0
    kw = dict(old_logps=old, ref_logps=old + 0.05, **LOSS_OPTIONS)

    def head_loss(**o):
        loss, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kw, **o)
        loss.backward()
        hidden.grad = weight.grad = None

    def logits_loss(**o):
        loss, _ = gk.grpo_loss(logits, ids, adv, mask, **kw, **o)
        loss.backward()
        logits.grad = None

    def head_nograd(**o):
        with torch.no_grad():
            gk.linear_token_logprobs(hidden, weight, ids, mask=mask, **o)

    def logits_nograd(**o):
        with torch.no_grad():
            gk.token_logprobs(logits, ids, return_entropy=True, **o)

    return {"head loss fwd + bwd": head_loss, "logits loss fwd + bwd": logits_loss,
            "head log-probs, no grad": head_nograd, "logits log-probs, no grad": logits_nograd}


def _variants(blocks, with_device_block: bool = True) -> dict:
    """{label: options}: the default call, the device's block, and each chosen block."""
    out = {"default": {}}
    if with_device_block:
        out["invariant"] = {"batch_invariant": True}
    out.update({f"{b} rows": {"batch_invariant": True, "invariant_block_rows": b} for b in blocks})
    return out


def time_variants(fn, variants: dict, rounds: int) -> dict:
    """{label: median seconds} of ``fn(**options)``: one warm-up call each, then ``rounds`` rounds in which every
    variant runs once, the order rotating by one each round."""
    labels = list(variants)
    for label in labels:
        fn(**variants[label])
    times = {label: [] for label in labels}
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            t0 = time.perf_counter()
            fn(**variants[label])
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(t) for label, t in times.items()}


def _row(name: str, medians: dict) -> str:
    base = medians["default"]
    cells = [f"{base * 1e3:.1f}"] + [f"{t * 1e3:.1f} ({t / base:.2f}x)" for k, t in medians.items() if k != "default"]
    return f"| {name} | " + " | ".join(cells) + " |"


def _header_row(first: str, labels) -> list[str]:
    cols = [first, "default ms"] + [f"{label} ms (ratio)" for label in labels if label != "default"]
    return ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]


def quick_section(grid: Grid, rounds: int) -> list[str]:
    B, T, H, V = grid.quick
    variants = _variants(())
    lines = [f"## The quick grid's shape: B = {B}, T = {T}, H = {H}, V = {V}", "",
             f"`invariant`: `batch_invariant=True` with the device's block ({block_rows('cpu')} rows). "
             f"Padded: the last third of each row masked ({B * (T - T // 3)} valid rows of {B * T}).", ""]
    lines += _header_row("case", variants)
    for padded in (False, True):
        for name, fn in _calls(B, T, H, V, padded).items():
            lines.append(_row(f"{name}{', padded' if padded else ''}", time_variants(fn, variants, rounds)))
    return lines + [""]


def block_section(grid: Grid, rounds: int) -> list[str]:
    B, T, H, V = grid.quick
    variants = _variants(grid.blocks, with_device_block=False)
    lines = [f"## Block size: `invariant_block_rows` at B = {B}, T = {T}, H = {H}, V = {V}", "",
             f"Every row valid (N = {B * T}) and padded ({B * (T - T // 3)} valid rows).", ""]
    lines += _header_row("case", variants)
    for padded in (False, True):
        for name, fn in _calls(B, T, H, V, padded).items():
            lines.append(_row(f"{name}{', padded' if padded else ''}", time_variants(fn, variants, rounds)))
    return lines + [""]


def n_section(grid: Grid, rounds: int) -> list[str]:
    H, V = grid.n_shape
    variants = _variants(grid.n_blocks)
    lines = [f"## Cost against N: one sequence of N tokens, H = {H}, V = {V}", "",
             f"`invariant`: the device's block ({block_rows('cpu')} rows); `R rows`: "
             "`invariant_block_rows=R` (another bit pattern).", ""]
    per_case: dict[str, list[str]] = {}
    for n in grid.ns:
        for name, fn in _calls(1, n, H, V, padded=False, seed=n).items():
            per_case.setdefault(name, []).append(_row(str(n), time_variants(fn, variants, rounds)))
    for name, rows in per_case.items():
        lines += [f"### {name}", ""] + _header_row("N", variants) + rows + [""]
    return lines


def smallest_budget(plan) -> int:
    """The smallest ``memory_budget`` for which ``plan(budget)`` plans instead of raising the budget's ValueError:
    doubling from 1 KiB to a budget that plans, then bisection (a larger budget never refuses what a smaller one
    takes)."""
    def fits(budget: int) -> bool:
        try:
            plan(budget)
            return True
        except ValueError as exc:
            if "memory_budget" not in str(exc):
                raise
            return False

    lo, hi = 0, 1 << 10
    while not fits(hi):
        lo, hi = hi + 1, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def _floor_plans(N: int, H: int, V: int, device: str) -> dict:
    """{call: plan(budget, **options)} for the four functions on one sequence of N tokens."""
    hidden = torch.empty(1, N, H, device=device, requires_grad=True)
    weight = torch.empty(V, H, device=device, requires_grad=True)
    logits = torch.empty(1, N, V, device=device, requires_grad=True)
    ids = torch.zeros(1, N, dtype=torch.long, device=device)
    adv, old = torch.zeros(1, device=device), torch.zeros(1, N, device=device)
    kw = dict(old_logps=old, ref_logps=old, **LOSS_OPTIONS)

    def no_grad(fn, *args):
        def plan(budget, **o):
            with torch.no_grad():
                return plan_call(fn, *args, memory_budget=budget, **o)
        return plan

    return {"head log-probs, no grad": no_grad(gk.linear_token_logprobs, hidden, weight, ids),
            "head loss fwd + bwd": lambda b, **o: plan_call(gk.fused_linear_grpo_loss, hidden, weight, ids, adv,
                                                               memory_budget=b, **kw, **o),
            "logits log-probs, no grad": no_grad(gk.token_logprobs, logits, ids),
            "logits loss fwd + bwd": lambda b, **o: plan_call(gk.grpo_loss, logits, ids, adv, memory_budget=b,
                                                              **kw, **o)}


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def floor_rows(grid: Grid) -> list[tuple]:
    """(device, shape, call, path, default floor, invariant floor, chosen-block floor) in bytes, from the planner."""
    out = []
    variants = _variants((grid.floor_block,))
    for device in ("cpu", "meta"):
        for N, H, V in grid.floor_shapes:
            for name, plan in _floor_plans(N, H, V, device).items():
                floors = {k: smallest_budget(lambda b, o=o: plan(b, **o)) for k, o in variants.items()}
                path = plan(floors["invariant"], batch_invariant=True).path
                out.append((device, (N, H, V), name, path, *floors.values()))
    return out


def floor_section(grid: Grid) -> list[str]:
    lines = ["## Floor: the smallest `memory_budget` each call accepts (from the planner; nothing runs)", "",
             "Below it the call raises a ValueError naming `memory_budget` and the bytes it needs. `cuda`: meta "
             "tensors, which plan as a CUDA device (512-row blocks, the Triton paths). One sequence of N tokens, "
             "fp32.", "",
             f"| device | N, H, V | call | invariant path | default | invariant | {grid.floor_block} rows |",
             "|---|---|---|---|---:|---:|---:|"]
    for device, (N, H, V), name, path, *floors in floor_rows(grid):
        lines.append(f"| {'cuda' if device == 'meta' else device} | {N}, {H}, {V} | {name} | {path} | "
                     + " | ".join(_size(f) for f in floors) + " |")
    return lines + [""]


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(argv: list[str], rounds: int, started: tuple, load_after: float) -> list[str]:
    """The file's first lines; ``started``: (date, commit, load average) read before the first timing."""
    (date, commit, load_before), cores, threads = started, os.cpu_count() or 1, torch.get_num_threads()
    shared = max(load_before, load_after) > 0.5 * cores
    load = (f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after on {cores} cores"
            + (": a shared machine, other jobs ran alongside; the interleaving puts their load on every variant "
               "alike, so read the ratios more than the times" if shared else ": idle"))
    return ["# Batch invariance: cost on the CPU", "",
            f"Written by `python -m benchmarks.invariance_cost {' '.join(argv)}` on "
            f"{date} at commit {commit}.", "",
            f"Machine: {cpu_model()}, {cores} cores, torch {torch.__version__} ({threads} thread"
            f"{'' if threads == 1 else 's'}), "
            f"Python {platform.python_version()}; {load}.", "",
            f"Timing: the median of {rounds} interleaved rounds after one warm-up call of each variant (a round runs "
            "every variant of a case once, the order rotating); fp32; loss dapo with old and reference log-probs, "
            "beta 0.04; ratios to the default call of the same round set.", ""]


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.invariance_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help=f"folder for {RESULTS_NAME} (created)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case (each runs every variant)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (one: on a shared machine more "
                                                                "threads wait on each other at every op)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the command's own test)")
    a = parser.parse_args(argv)
    if a.rounds < 1 or a.threads < 1:
        parser.error("--rounds and --threads must be >= 1")
    grid = TINY if a.tiny else Grid()
    os.makedirs(a.out, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:  # (restored after: the command's test runs it in the test process)
        started = (datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), _commit(), os.getloadavg()[0])
        body = quick_section(grid, a.rounds) + block_section(grid, a.rounds) + n_section(grid, a.rounds)
        body += floor_section(grid)
        text = "\n".join(header(argv, a.rounds, started, os.getloadavg()[0]) + body)
    finally:
        torch.set_num_threads(threads)
    path = os.path.join(a.out, RESULTS_NAME)
    with open(path, "w") as f:
        f.write(text)
    print(text)
    print(f"written: {path}", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
