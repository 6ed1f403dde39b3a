"""Markdown table and plots from a pytest-benchmark JSON file of this suite.

    python -m benchmarks.report RESULTS.json [--out DIR] [--no-plots] [--brief]

Prints the markdown (also written to DIR/<stem>.md; DIR defaults to benchmarks/results/) and, when matplotlib is
installed, writes DIR/<stem>_<path>_<shape>.png: median time and peak memory against N, one row per mode, one line
per provider. Columns: median time; peak memory above the inputs; both as a ratio to the best *peer* (the fastest /
leanest provider that is not ours) of the same path, mode and shape; the achieved rate and its fraction of the
ceiling measured in the same run (matmul TFLOP/s for the linear paths, logits-copy GB/s for the logits path); and
the loss (or mean log-prob) relative to the eager reference's, to show every provider computed the same thing.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PATH_TITLES = {"linear": "Fused linear head: GRPO loss from hidden (B,T,H) and a trainable lm_head (V,H)",
               "logits": "Logits path: GRPO loss from given (B,T,V) logits",
               "logprob": "Old / reference policy: log-probs from hidden and lm_head under no_grad"}
MODE_TITLES = {"fwdbwd": "forward + backward", "fwd": "forward", "bwd": "backward (forward untimed)",
               "nograd": "no-grad forward"}
MODE_ORDER = ("fwdbwd", "fwd", "bwd", "nograd")


def load(path: pathlib.Path) -> tuple[dict, list[dict]]:
    data = json.loads(path.read_text())
    rows = []
    for b in data.get("benchmarks", []):
        e = dict(b.get("extra_info", {}))
        e["median_s"] = b["stats"]["median"]
        e["min_s"] = b["stats"]["min"]
        e["rounds"] = b["stats"]["rounds"]
        rows.append(e)
    return data, rows


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


MEM_RATIO_FLOOR = 1 << 20  # below 1 MiB the best peer's figure is allocator noise, not a denominator


def _shape_id(r: dict) -> str:
    return f"N={r['N']} H={r['H']} V={r['V']}" if r["H"] else f"N={r['N']} V={r['V']}"


def _achieved(r: dict) -> float | None:
    if not r.get("work") or not r["median_s"]:
        return None
    return r["work"] / r["median_s"] / (1e12 if r["work_unit"] == "FLOP" else 1e9)


def _value_check(r: dict, eager: dict | None) -> str:
    if eager is None or r.get("value") is None or eager.get("value") is None:
        return "n/a"
    if r is eager:
        return f"= {r['value']:.6g}"
    den = max(abs(eager["value"]), 1e-12)
    return f"{abs(r['value'] - eager['value']) / den:.1e}"


def _excluded_from_best(r: dict) -> bool:
    # Liger's chunked loss computes the gradients in its forward: its "backward" is a copy, not a peer time.
    return r["mode"] == "bwd" and r.get("grads_in_forward", False)


def table(rows: list[dict], modes=MODE_ORDER) -> str:
    """One markdown section per (path, mode); rows grouped by shape, providers sorted by time."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("path") in PATH_TITLES:
            groups[(r["path"], r["mode"])].append(r)
    out = []
    for path in PATH_TITLES:
        for mode in modes:
            rs = groups.get((path, mode))
            if not rs:
                continue
            unit = "TFLOP/s" if rs[0]["work_unit"] == "FLOP" else "GB/s"
            out.append(f"### {path}: {MODE_TITLES[mode]}\n\n{PATH_TITLES[path]}.\n")
            out.append(f"| shape | provider | median ms | peak mem | time / best peer | mem / best peer | "
                       f"achieved {unit} | % of ceiling | {'mean log-prob' if path == 'logprob' else 'loss'} check |")
            out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
            by_shape = defaultdict(list)
            for r in rs:
                by_shape[(r["N"], r["H"], r["V"])].append(r)
            for key in sorted(by_shape, key=lambda k: (k[1], k[2], k[0])):
                srs = sorted(by_shape[key], key=lambda r: r["median_s"])
                peers = [r for r in srs if r.get("provider_kind") == "peer" and not _excluded_from_best(r)]
                best_t = min((r["median_s"] for r in peers), default=None)
                mems = [r["peak_mem_bytes"] for r in peers if r.get("peak_mem_bytes") is not None]
                best_m = min(mems, default=None)
                eager = next((r for r in srs if r["provider"] == "eager"), None)
                for r in srs:
                    ach = _achieved(r)
                    frac = f"{100 * ach / r['ceiling']:.1f}" if ach is not None and r.get("ceiling") else "n/a"
                    dagger = _excluded_from_best(r)
                    name = r["provider"] + (" †" if dagger else "")
                    name = f"**{name}**" if r.get("provider_kind") == "ours" else name
                    t_ratio = "—" if dagger else _ratio(r["median_s"], best_t)
                    m_ratio = "—" if dagger else _ratio(r.get("peak_mem_bytes"), best_m, MEM_RATIO_FLOOR)
                    rate = "—" if dagger else "n/a" if ach is None else f"{ach:.3g}"
                    out.append(f"| {_shape_id(r)} | {name} | {_ms(r['median_s'])} | {_mem(r.get('peak_mem_bytes'))}"
                               f" | {t_ratio} | {m_ratio} | {rate} | {'—' if dagger else frac} | "
                               f"{_value_check(r, eager)} |")
            ceilings = {(_shape_id(r), r["ceiling_what"], r["ceiling"]) for r in rs if r.get("ceiling")}
            out.append("")
            out.append("Ceilings measured in this run: " + "; ".join(
                f"{s}: {w} = {c:.3g} {rs[0]['ceiling_unit']}" for s, w, c in sorted(ceilings)) + ".")
            if any(_excluded_from_best(r) for r in rs):
                out.append("\n† computes its gradients inside the forward; its backward only scales them (not "
                           "counted as a peer here).")
            out.append("")
    return "\n".join(out)


def header(data: dict, rows: list[dict]) -> str:
    first = next((r for r in rows if r.get("path") in PATH_TITLES), {})
    machine = data.get("machine_info", {})
    commit = data.get("commit_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", "?"))
    lines = [f"## grpo-kernels benchmarks: {first.get('device', '?')} ({first.get('dtype', '?')})", "",
             f"- run: {data.get('datetime', '?')}; torch {first.get('torch', '?')}; python "
             f"{machine.get('python_version', '?')}; host CPU: {cpu}"
             + (f"; {first['threads']} CPU thread(s)" if first.get("threads") else ""),
             f"- commit: {commit.get('id', '?')[:12]}{' (dirty)' if commit.get('dirty') else ''}",
             f"- peak memory: {first.get('mem_method', '?')}, above the inputs (backward: above the state after the "
             "forward); time: median of the timed rounds",
             "- loss config for every provider: dapo, beta 0.04 with reference log-probs, eps 0.2/0.2, "
             "bias-corrected KL, temperature 1, off-policy old log-probs, right-padded mask",
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
    return "\n".join(lines) + "\n"


_COLORS = {"ours": "tab:blue", "ours-triton-interp": "tab:cyan", "eager": "tab:green", "compile": "tab:orange",
           "liger-chunked": "tab:red", "liger-triton": "tab:pink", "trl-chunked": "tab:purple",
           "trl-triton": "tab:brown"}


def _color(provider: str) -> str:
    return _COLORS.get(provider, "tab:gray")


def plots(rows: list[dict], out_dir: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """Time and memory against N, per (path, H, V); a row of two panels per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (the table is complete)", file=sys.stderr)
        return []
    written = []
    groups = defaultdict(list)
    for r in rows:
        if r.get("path") in PATH_TITLES:
            groups[(r["path"], r["H"], r["V"])].append(r)
    for (path, H, V), rs in sorted(groups.items()):
        modes = [m for m in MODE_ORDER if any(r["mode"] == m for r in rs)]
        fig, axes = plt.subplots(len(modes), 2, figsize=(11, 3.4 * len(modes)), squeeze=False)
        providers = sorted({r["provider"] for r in rs}, key=lambda p: (not p.startswith("ours"), p))
        Ns = sorted({r["N"] for r in rs})
        for i, mode in enumerate(modes):
            for p in providers:
                pts = sorted((r["N"], r["median_s"] * 1e3, r.get("peak_mem_bytes")) for r in rs
                             if r["mode"] == mode and r["provider"] == p)
                if not pts:
                    continue
                dagger = any(_excluded_from_best(r) for r in rs if r["mode"] == mode and r["provider"] == p)
                style = dict(marker="o", linewidth=2.5 if p.startswith("ours") else 1.3, color=_color(p),
                             label=p + (" (grads computed in fwd)" if dagger else ""))
                axes[i][0].plot([n for n, _, _ in pts], [t for _, t, _ in pts], **style)
                # log axis: an all-small-blocks peak of 0 bytes is drawn at the 0.01 MiB floor
                mem = [(n, max(m / (1 << 20), 0.01)) for n, _, m in pts if m is not None]
                if mem:
                    axes[i][1].plot([n for n, _ in mem], [m for _, m in mem], **style)
            for j, ylabel in enumerate(("median time (ms)", "peak memory above inputs (MiB)")):
                ax = axes[i][j]
                ax.set_xscale("log", base=2)
                ax.set_xticks(Ns, [str(n) for n in Ns])
                ax.minorticks_off() if len(Ns) > 1 else None
                ax.set_yscale("log")
                ax.set_xlabel("N tokens")
                ax.set_ylabel(ylabel)
                ax.set_title(f"{path} {MODE_TITLES[mode]}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
            axes[i][0].legend(fontsize=8)
        dev = rs[0].get("device", "?")
        fig.suptitle(f"{PATH_TITLES[path]}\n{dev} {rs[0].get('dtype', '')}, {f'H={H} ' if H else ''}V={V}",
                     fontsize=11)
        fig.tight_layout()
        name = f"{stem}_{path}_{'H%d_' % H if H else ''}V{V}.png"
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(out_dir / name)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=pathlib.Path, help="pytest-benchmark --benchmark-json output")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="output folder (default benchmarks/results)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--brief", action="store_true",
                    help="print only the forward+backward and no-grad tables (the file has all of them)")
    args = ap.parse_args(argv)
    data, rows = load(args.results)
    if not any(r.get("path") in PATH_TITLES for r in rows):
        print(f"{args.results}: no benchmark of this suite in the file", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.results.stem
    pngs = [] if args.no_plots else plots(rows, args.out, stem)
    md = header(data, rows) + "\n" + table(rows)
    if pngs:
        md += "\nPlots: " + ", ".join(f"`{p.name}`" for p in pngs) + "\n"
    (args.out / f"{stem}.md").write_text(md)
    print(header(data, rows) + "\n" + table(rows, ("fwdbwd", "nograd")) if args.brief else md)
    print(f"wrote {args.out / (stem + '.md')}" + "".join(f"\nwrote {p}" for p in pngs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
