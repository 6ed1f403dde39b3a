"""PNG plots of a benchmark run (optional: needs matplotlib).

- Bar charts, every run: one figure per path, a row per case (variant, mode) with two panels, median time and peak
  memory per provider, at the case's largest shape.
- Line plots against N: one figure per (path, H, V; and the teacher's H_t on the distill path) of the "every token
  valid" benchmarks that ran at two or more N (the full grid); a row of two panels per mode, one line per provider.
  A run without such a shape (the quick grid) gets a note saying so instead.
"""
from __future__ import annotations

import pathlib
from collections import defaultdict

_COLORS = {"ours": "tab:blue", "ours-atomic": "tab:olive", "ours-triton-interp": "tab:cyan", "eager": "tab:green",
           "compile": "tab:orange", "liger-chunked": "tab:red", "liger-triton": "tab:pink",
           "trl-chunked": "tab:purple", "trl-triton": "tab:brown", "liger-fused": "tab:pink"}


NEED_FULL_GRID = ("line plots against N need a shape run at two or more N: run the full grid "
                  "(--bench-grid full or GRPO_BENCH_GRID=full), then the report again")



def _save(fig, path):
    """Lay out, write and close one figure; returns its path."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

def plots(rows: list[dict], out_dir: pathlib.Path, stem: str) -> tuple[list[pathlib.Path], list[str]]:
    """(PNG files written, notes for the report): bar charts per case and, where the grid allows, line plots."""
    from .report import PATH_TITLES

    if not any(r.get("path") in PATH_TITLES for r in rows):
        return [], []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], ["matplotlib not installed: no plots (the tables are complete; pip install matplotlib)"]
    written = _bar_charts(plt, rows, out_dir, stem)
    lines = _line_plots(plt, rows, out_dir, stem)
    return written + lines, ([] if lines else [NEED_FULL_GRID])


def _bar_charts(plt, rows: list[dict], out_dir: pathlib.Path, stem: str) -> list[pathlib.Path]:
    from .report import CASES, MODE_TITLES, PATH_TITLES, VARIANT_TITLES, excluded_from_best, shape_id

    cases = defaultdict(list)
    for r in rows:
        if r.get("path") in PATH_TITLES:
            cases[(r["path"], r.get("variant", "valid"), r["mode"])].append(r)
    order = {c: i for i, c in enumerate(CASES)}
    written = []
    for path in PATH_TITLES:
        keys = sorted((c for c in cases if c[0] == path), key=lambda c: (order.get(c, len(order)), c))
        if not keys:
            continue
        fig, axes = plt.subplots(len(keys), 2, figsize=(11, 2.6 * len(keys) + 0.8), squeeze=False)
        for i, key in enumerate(keys):
            largest = max((r["N"] * max(r["H"], 1) * r["V"], r["N"]) for r in cases[key])
            rs = sorted((r for r in cases[key] if (r["N"] * max(r["H"], 1) * r["V"], r["N"]) == largest),
                        key=lambda r: (not r["provider"].startswith("ours"), r["provider"]))
            names = [r["provider"] + (" †" if excluded_from_best(r) else "") for r in rs]
            colors = [_COLORS.get(r["provider"], "tab:gray") for r in rs]
            times = [r["median_s"] * 1e3 for r in rs]
            mems = [(r.get("peak_mem_bytes") or 0) / (1 << 20) for r in rs]
            for j, (values, label) in enumerate(((times, "median time (ms)"), (mems, "peak memory above inputs (MiB)"))):
                ax = axes[i][j]
                ax.barh(range(len(rs)), values, color=colors)
                ax.set_yticks(range(len(rs)), names, fontsize=8)
                ax.invert_yaxis()
                ax.set_xlabel(label, fontsize=8)
                ax.set_title(f"{path}, {VARIANT_TITLES.get(key[1], key[1])}: {MODE_TITLES.get(key[2], key[2])}, "
                             f"{shape_id(rs[0])}", fontsize=9)
                ax.grid(True, axis="x", alpha=0.3)
        dev = rows[0].get("device", "?")
        fig.suptitle(f"{PATH_TITLES[path]}\n{dev} {rows[0].get('dtype', '')} (shorter is better; "
                     "† gradients computed in the forward)", fontsize=10)
        written.append(_save(fig, out_dir / f"{stem}_bars_{path}.png"))
    return written


def _line_plots(plt, rows: list[dict], out_dir: pathlib.Path, stem: str) -> list[pathlib.Path]:
    from .report import MODE_ORDER, MODE_TITLES, PATH_TITLES, excluded_from_best

    groups = defaultdict(list)
    for r in rows:
        if r.get("path") in PATH_TITLES and r.get("variant", "valid") == "valid":
            groups[(r["path"], r["H"], r["V"], r.get("H_t") or 0)].append(r)  # H_t: the distill path's teacher
    groups = {k: rs for k, rs in groups.items() if len({r["N"] for r in rs}) > 1}
    written = []
    for (path, H, V, Ht), rs in sorted(groups.items()):
        widths = (f"H_s={H} H_t={Ht} " if Ht else f"H={H} ") if H else ""
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
                dagger = any(excluded_from_best(r) for r in rs if r["mode"] == mode and r["provider"] == p)
                style = dict(marker="o", linewidth=2.5 if p.startswith("ours") else 1.3,
                             color=_COLORS.get(p, "tab:gray"), label=p + (" (grads computed in fwd)" if dagger else ""))
                axes[i][0].plot([n for n, _, _ in pts], [t for _, t, _ in pts], **style)
                # log axis: an all-small-blocks peak of 0 bytes is drawn at the 0.01 MiB floor
                mem = [(n, max(m / (1 << 20), 0.01)) for n, _, m in pts if m is not None]
                if mem:
                    axes[i][1].plot([n for n, _ in mem], [m for _, m in mem], **style)
            for j, ylabel in enumerate(("median time (ms)", "peak memory above inputs (MiB)")):
                ax = axes[i][j]
                ax.set_xscale("log", base=2)
                ax.set_xticks(Ns, [str(n) for n in Ns])
                ax.minorticks_off()
                ax.set_yscale("log")
                ax.set_xlabel("N tokens")
                ax.set_ylabel(ylabel)
                ax.set_title(f"{path} {MODE_TITLES[mode]}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
            axes[i][0].legend(fontsize=8)
        dev = rs[0].get("device", "?")
        fig.suptitle(f"{PATH_TITLES[path]}\n{dev} {rs[0].get('dtype', '')}, {widths}V={V}", fontsize=11)
        name = (f"H{H}_" if H else "") + (f"Ht{Ht}_" if Ht else "")
        written.append(_save(fig, out_dir / f"{stem}_{path}_{name}V{V}.png"))
    return written
