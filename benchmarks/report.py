"""Markdown tables (and optional plots) from a pytest-benchmark JSON file of this suite.

    python -m benchmarks.report RESULTS.json [--out DIR] [--no-plots] [--print all|summary]

Writes DIR/<stem>.md (DIR defaults to bench-out/, git-ignored) with every table, and prints it (``--print
summary``: only the summary table, one row per case). One section per (path, variant, mode) of
``harness.CASES``: median time; peak memory above the inputs; both as a ratio to the best *peer* (the fastest /
leanest provider that is not ours) at the same shape; the rows each provider computed; its work per call from its
declared work model (``work.py``: matmul FLOPs as a multiple of R*H*V, or logits bytes); the achieved rate and its
fraction of the ceiling measured in the same run (a bare matmul of the same shape; a device copy of the logits);
and the loss (or mean log-prob) relative to the eager reference's. Then the benchmarks that did not run, with the
reason (no CUDA, a peer that failed or ran out of memory, a warm-up over its limit, the time budget).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "bench-out"
PATH_TITLES = {"linear": "Fused linear head: GRPO loss from hidden (B,T,H) and the lm_head (V,H)",
               "logits": "Logits path: GRPO loss from given (B,T,V) logits",
               "logprob": "Old / reference policy: log-probs from hidden and lm_head under no_grad"}
MODE_TITLES = {"fwdbwd": "forward + backward", "fwd": "forward", "bwd": "backward (forward untimed)",
               "nograd": "no-grad forward"}
MODE_ORDER = ("fwdbwd", "fwd", "bwd", "nograd")
VARIANT_TITLES = {"valid": "every token valid", "padded": "a third of the tokens padded",
                  "frozen": "frozen lm_head, every token valid", "longrow": "one long row, every token valid"}
# harness.CASES, repeated here so that the report runs without torch
CASES = (("linear", "valid", "fwdbwd"), ("logits", "valid", "fwdbwd"), ("logprob", "valid", "nograd"),
         ("linear", "padded", "fwdbwd"), ("logits", "padded", "fwdbwd"), ("logprob", "padded", "nograd"),
         ("linear", "frozen", "fwdbwd"), ("logits", "longrow", "fwdbwd"),
         ("linear", "valid", "fwd"), ("linear", "valid", "bwd"), ("logits", "valid", "fwd"),
         ("logits", "valid", "bwd"))
MEM_RATIO_FLOOR = 1 << 20  # below 1 MiB the best peer's figure is allocator noise, not a denominator


def load(path: pathlib.Path) -> tuple[dict, list[dict], list[dict]]:
    data = json.loads(path.read_text())
    rows = []
    for b in data.get("benchmarks", []):
        e = dict(b.get("extra_info", {}))
        e.setdefault("variant", "valid")
        e["median_s"] = b["stats"]["median"]
        e["min_s"] = b["stats"]["min"]
        e["rounds"] = b["stats"]["rounds"]
        rows.append(e)
    return data, rows, list(data.get("grpo_not_run", []))


def _mem(nbytes) -> str:
    if nbytes is None:
        return "n/a"
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _ratio(x, best, floor: float = 0.0) -> str:
    if x is None or best is None or best < max(floor, 1e-300):
        return "n/a"
    return f"{x / best:.2f}x"


def shape_id(r: dict) -> str:
    s = f"N={r['N']} H={r['H']} V={r['V']}" if r["H"] else f"N={r['N']} V={r['V']}"
    return s + (f" (B=1, T={r['T']})" if r.get("T") == r["N"] else "")


def achieved(r: dict) -> float | None:
    """Work per second from the provider's declared work (TFLOP/s or GB/s); None when there is no work."""
    if not r.get("work") or not r["median_s"]:
        return None
    return r["work"] / r["median_s"] / (1e12 if r["work_unit"] == "FLOP" else 1e9)


def frac_of_ceiling(r: dict) -> float | None:
    a = achieved(r)
    return None if a is None or not r.get("ceiling") else a / r["ceiling"]


def _value_check(r: dict, eager: dict | None) -> str:
    if eager is None or r.get("value") is None or eager.get("value") is None:
        return "n/a"
    if r is eager:
        return f"= {r['value']:.6g}"
    den = max(abs(eager["value"]), 1e-12)
    return f"{abs(r['value'] - eager['value']) / den:.1e}"


def excluded_from_best(r: dict) -> bool:
    # Liger's chunked loss and our Triton paths compute the gradients in their forward: their "backward" only
    # scales them (nothing when the incoming gradient is 1), not a backward time to compare.
    return r["mode"] == "bwd" and r.get("grads_in_forward", False)


def best_peer(rs: list[dict]) -> dict | None:
    peers = [r for r in rs if r.get("provider_kind") == "peer" and not excluded_from_best(r)]
    return min(peers, key=lambda r: r["median_s"], default=None)


def _rows(r: dict) -> str:
    rows, n = r.get("rows", r["N"]), r["N"]
    return f"{rows} of {n}" if rows != n else f"all {n}"


def _rate(r: dict) -> tuple[str, str, bool]:
    """(achieved, % of ceiling, above the ceiling?) as printed; "≥" marks a lower-bound work model."""
    a, f = achieved(r), frac_of_ceiling(r)
    if a is None:
        return "—", "—", False
    lb = "" if r.get("work_exact", True) else "≥ "
    return f"{lb}{a:.3g}", ("n/a" if f is None else f"{lb}{100 * f:.1f}" + (" (!)" if f > 1 else "")), \
        f is not None and f > 1


def section(path: str, variant: str, mode: str, rs: list[dict]) -> list[str]:
    unit = "TFLOP/s" if rs[0]["work_unit"] == "FLOP" else "GB/s"
    out = [f"### {path}, {VARIANT_TITLES.get(variant, variant)}: {MODE_TITLES[mode]}", "",
           f"{PATH_TITLES[path]}.", "",
           f"| shape | provider | median ms | time / best peer | peak mem | mem / best peer | rows computed | "
           f"work / call | {unit} | % of ceiling | {'mean log-prob' if path == 'logprob' else 'loss'} check |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    by_shape = defaultdict(list)
    for r in rs:
        by_shape[(r["N"], r["H"], r["V"])].append(r)
    above = daggers = False
    for key in sorted(by_shape, key=lambda k: (k[1], k[2], k[0])):
        srs = sorted(by_shape[key], key=lambda r: r["median_s"])
        best = best_peer(srs)
        mems = [r["peak_mem_bytes"] for r in srs if r.get("provider_kind") == "peer" and not excluded_from_best(r)
                and r.get("peak_mem_bytes") is not None]
        best_m = min(mems, default=None)
        eager = next((r for r in srs if r["provider"] == "eager"), None)
        for r in srs:
            dagger = excluded_from_best(r)
            daggers |= dagger
            name = r["provider"] + (" †" if dagger else "")
            name = f"**{name}**" if r.get("provider_kind") == "ours" else name
            rate, frac, over = _rate(r)
            above |= over
            t_ratio = "—" if dagger else _ratio(r["median_s"], best["median_s"] if best else None)
            m_ratio = "—" if dagger else _ratio(r.get("peak_mem_bytes"), best_m, MEM_RATIO_FLOOR)
            out.append(f"| {shape_id(r)} | {name} | {_ms(r['median_s'])} | {t_ratio} | "
                       f"{_mem(r.get('peak_mem_bytes'))} | {m_ratio} | {_rows(r)} | {r.get('work_formula', '?')} | "
                       f"{rate} | {frac} | {_value_check(r, eager)} |")
    ceilings = {(shape_id(r), r["ceiling_what"], r["ceiling"]) for r in rs if r.get("ceiling")}
    out += ["", "Ceilings measured in this run: " + "; ".join(
        f"{s}: {w} = {c:.3g} {rs[0]['ceiling_unit']}" for s, w, c in sorted(ceilings)) + "."]
    if daggers:
        out.append("\n† computes its gradients inside the forward; its backward only scales them (not counted as a "
                   "peer here).")
    if above:
        out.append("\n(!) above the ceiling measured in this run: the work model or the ceiling is wrong for that "
                   "row; do not read it as a rate.")
    return out + [""]


def _grouped(rows: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        if r.get("path") in PATH_TITLES:
            groups[(r["path"], r["variant"], r["mode"])].append(r)
    return groups


def _case_order(groups) -> list:
    return [c for c in CASES if c in groups] + sorted(c for c in groups if c not in CASES)


def tables(rows: list[dict]) -> str:
    groups = _grouped(rows)
    out = []
    for case in _case_order(groups):
        out += section(*case, groups[case])
    return "\n".join(out)


def summary(rows: list[dict], not_run: list[dict]) -> str:
    """One row per (case, shape): ours (the default provider) against the fastest peer."""
    groups = _grouped(rows)
    cases = list(CASES) + sorted(c for c in groups if c not in CASES)  # a case never reached still gets its row
    out = ["| case | shape | ours ms | fastest peer | peer ms | ours / peer | ours % of ceiling | "
           "peer % of ceiling | rows ours / peer |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for case in cases:
        path, variant, mode = case
        label = f"{path} {MODE_TITLES[mode]}, {VARIANT_TITLES.get(variant, variant)}"
        by_shape = defaultdict(list)
        for r in groups.get(case, []):
            by_shape[(r["N"], r["H"], r["V"], r.get("T"))].append(r)
        if not by_shape:
            why = sorted({n["status"] for n in not_run if (n["path"], n["variant"], n["mode"]) == case
                          and n["provider"] == "ours"})
            why = ", ".join(why) if why else "never reached: the run stopped before it"
            out.append(f"| {label} | | not run ({why}) | | | | | | |")
            continue
        for key in sorted(by_shape):
            srs = by_shape[key]
            ours = next((r for r in srs if r["provider"] == "ours"), None)
            best = best_peer(srs)
            f_o = frac_of_ceiling(ours) if ours else None
            f_p = frac_of_ceiling(best) if best else None

            def pct(r, f):
                if f is None:
                    return "n/a"
                return ("" if r.get("work_exact", True) else "≥ ") + f"{100 * f:.1f}" + (" (!)" if f > 1 else "")
            out.append(f"| {label} | {shape_id(srs[0])} | {_ms(ours['median_s']) if ours else 'not run'} | "
                       f"{best['provider'] if best else 'none ran'} | {_ms(best['median_s']) if best else '—'} | "
                       f"{_ratio(ours['median_s'], best['median_s']) if ours and best else 'n/a'} | "
                       f"{pct(ours, f_o) if ours else '—'} | {pct(best, f_p) if best else '—'} | "
                       f"{ours.get('rows', '?') if ours else '—'} / {best.get('rows', '?') if best else '—'} |")
    return "\n".join(out) + "\n"


def not_run_table(not_run: list[dict]) -> str:
    """Benchmarks that did not run, grouped by (provider, status, reason)."""
    if not not_run:
        return "Every benchmark of the run finished.\n"
    groups = defaultdict(list)
    for n in not_run:
        groups[(n["provider"], n["status"], n["reason"])].append(n)
    out = ["| provider | status | cases | reason |", "|---|---|---|---|"]
    for (provider, status, reason), ns in sorted(groups.items()):
        cases = ", ".join(sorted({f"{n['path']} {n['variant']} {n['mode']} {shape_id(n)}" for n in ns}))
        out.append(f"| {provider} | {status} | {cases} | {reason.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def header(data: dict, rows: list[dict]) -> str:
    first = next((r for r in rows if r.get("path") in PATH_TITLES), {})
    machine = data.get("machine_info", {})
    commit = data.get("commit_info", {})
    settings = data.get("grpo_settings", {})
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", "?"))
    lines = [f"## grpo-kernels benchmarks: {first.get('device', '?')} ({first.get('dtype', '?')})", "",
             f"- run: {data.get('datetime', '?')}; torch {first.get('torch', '?')}; triton "
             f"{first.get('triton', '?')}; python {machine.get('python_version', '?')}; host CPU: {cpu}"
             + (f"; {first['threads']} CPU thread(s)" if first.get("threads") else ""),
             f"- commit: {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}",
             "- settings: " + (", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in settings.items()) or "?"),
             f"- time: median of the timed rounds, after an untimed first call (compilation, autotuning) and the "
             f"warm-up rounds; peak memory: {first.get('mem_method', '?')}, above the inputs (backward: above the "
             "state after the forward)",
             "- loss config for every provider: dapo, beta 0.04 with reference log-probs, eps 0.2/0.2, "
             "bias-corrected KL, temperature 1, off-policy old log-probs; each provider gets the mask",
             "- work / call: the provider's own work (benchmarks/work.py): matmul FLOPs as a multiple of R*H*V "
             "(R = rows computed: 2 per GEMM; 6 when the logits are kept for the backward, 8 when the backward "
             "recomputes them, 2 less for a frozen head) or, on the logits path, bytes of B x T x V traffic (≥: a "
             "lower bound for providers that make several passes); rate and % of ceiling follow from it",
             "- check column: the eager reference's value (=), and every other provider's relative difference to "
             "it; ratios: to the best peer (fastest / leanest provider other than ours) at the same shape; memory "
             "ratios are n/a when that best figure is under 1 MiB"]
    probe = next((r for r in rows if r.get("path") == "probe"), None)
    if probe and probe.get("peak_materialize_bytes") is not None:
        nv = probe["nv_fp32_bytes"]
        lines.append(f"- memory probe check (N={probe['N']}, V={probe['V']}, one N x V fp32 = {_mem(nv)}): a "
                     f"materialized N x V tensor measures {_mem(probe['peak_materialize_bytes'])}; eager log-probs "
                     f"{_mem(probe['peak_eager_bytes'])} ({probe['peak_eager_bytes'] / nv:.1f} x N x V); ours "
                     f"{_mem(probe['peak_ours_bytes'])} ({probe['peak_ours_bytes'] / nv:.2f} x N x V)")
    notes = sorted({(r["provider"], r["path"], r["note"]) for r in rows if r.get("note")})
    if notes:
        lines += ["", "Providers:", ""] + [f"- `{p}` ({path}): {n}" for p, path, n in notes]
    sources = sorted({(r["provider"], r["work_source"]) for r in rows if r.get("work_source")})
    if sources:
        lines += ["", "What each provider computes (read from its code):", ""] + \
            [f"- `{p}`: {src}" for p, src in sources]
    return "\n".join(lines) + "\n"


def render(data: dict, rows: list[dict], not_run: list[dict]) -> str:
    return (header(data, rows) + "\n### Summary: ours against the fastest peer\n\n" + summary(rows, not_run)
            + "\n" + tables(rows) + "\n### Not run\n\n" + not_run_table(not_run))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=pathlib.Path, help="pytest-benchmark --benchmark-json output")
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="output folder (default bench-out/)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--print", dest="show", choices=("all", "summary"), default="all",
                    help="what to print (the file always has everything)")
    args = ap.parse_args(argv)
    data, rows, not_run = load(args.results)
    if not any(r.get("path") in PATH_TITLES for r in rows) and not not_run:
        print(f"{args.results}: no benchmark of this suite in the file", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.results.stem
    md = render(data, rows, not_run)
    pngs = []
    if not args.no_plots:
        from .plots import plots
        pngs = plots(rows, args.out, stem)
    if pngs:
        md += "\nPlots: " + ", ".join(f"`{p.name}`" for p in pngs) + "\n"
    (args.out / f"{stem}.md").write_text(md)
    if args.show == "summary":
        first = next((r for r in rows if r.get("path") in PATH_TITLES), {})
        print(f"Benchmark summary: {first.get('device', '?')} ({first.get('dtype', '?')}), torch "
              f"{first.get('torch', '?')}, triton {first.get('triton', '?')}; all tables in "
              f"{args.out / (stem + '.md')}\n")
        print(summary(rows, not_run))
    else:
        print(md)
    print(f"wrote {args.out / (stem + '.md')}" + "".join(f"\nwrote {p}" for p in pngs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
