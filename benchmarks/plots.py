"""PNG plots of a benchmark run (optional: needs matplotlib): median time and peak memory against N.

One figure per (path, H, V) of the "every token valid" benchmarks that ran at two or more N (the full grid); a row
of two panels per mode, one line per provider.
"""
from __future__ import annotations

import pathlib
import sys
from collections import defaultdict

_COLORS = {"ours": "tab:blue", "ours-atomic": "tab:olive", "ours-triton-interp": "tab:cyan", "eager": "tab:green",
           "compile": "tab:orange", "liger-chunked": "tab:red", "liger-triton": "tab:pink",
           "trl-chunked": "tab:purple", "trl-triton": "tab:brown"}


def plots(rows: list[dict], out_dir: pathlib.Path, stem: str) -> list[pathlib.Path]:
    from .report import MODE_ORDER, MODE_TITLES, PATH_TITLES, excluded_from_best

    groups = defaultdict(list)
    for r in rows:
        if r.get("path") in PATH_TITLES and r.get("variant", "valid") == "valid":
            groups[(r["path"], r["H"], r["V"])].append(r)
    groups = {k: rs for k, rs in groups.items() if len({r["N"] for r in rs}) > 1}
    if not groups:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots (the tables are complete)", file=sys.stderr)
        return []
    written = []
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
        fig.suptitle(f"{PATH_TITLES[path]}\n{dev} {rs[0].get('dtype', '')}, {f'H={H} ' if H else ''}V={V}",
                     fontsize=11)
        fig.tight_layout()
        name = f"{stem}_{path}_{'H%d_' % H if H else ''}V{V}.png"
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        written.append(out_dir / name)
    return written
