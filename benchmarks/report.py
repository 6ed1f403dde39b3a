"""Markdown tables (and optional plots) from a pytest-benchmark JSON file of this suite.

    python -m benchmarks.report RESULTS.json [--out DIR] [--no-plots] [--print all|summary] [--e2e E2E.json]

Writes DIR/<stem>.md (DIR defaults to the folder of RESULTS.json) with every table, and prints it (``--print
summary``: only the summary table, one row per case, and the trainer tables). One section per (path, variant, mode) of
``harness.CASES``: median time; peak memory above the inputs; both as a ratio to the best *peer* (the fastest /
leanest provider that is not ours) at the same shape; the rows each provider computed; its work per call from its
declared work model (``work.py``: matmul FLOPs as a multiple of R*H*V, or logits bytes); the achieved rate and its
fraction of the ceiling measured in the same run (a bare matmul of the same shape; a device copy of the logits);
and the loss (or mean log-prob) relative to the eager reference's. Then the benchmarks that did not run, with the
reason (no CUDA, a peer that failed or ran out of memory, a warm-up over its limit, the time budget), one line per
reason. Trainer tables when their results exist: the time per optimizer step of ``grpo.train`` against TRL's
GRPOTrainer (``benchmarks/test_trainer_speed.py``, in the same JSON), of TRL's SFTTrainer stock against
``patch_trl()`` (``benchmarks/test_sft_step.py``, same JSON) and the end-to-end GRPO step of
``benchmarks/e2e_step.py`` (``e2e_step.json`` next to RESULTS.json, or ``--e2e``). Plots (matplotlib): a bar chart
per case of every run; line plots against N where a shape ran at two or more N (``--bench-grid full``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict

PATH_TITLES = {"linear": "Fused linear head: GRPO loss from hidden (B,T,H) and the lm_head (V,H)",
               "logits": "Logits path: GRPO loss from given (B,T,V) logits",
               "logprob": "Old / reference policy: log-probs from hidden and lm_head under no_grad",
               "distill": "Distillation: TRL's divergence loss from the student's hidden (B,T,H_s) and lm_head "
                          "(V,H_s), trainable, and the teacher's (B,T,H_t), (V,H_t), frozen"}
MODE_TITLES = {"fwdbwd": "forward + backward", "fwd": "forward", "bwd": "backward (forward untimed)",
               "nograd": "no-grad forward"}
# what a (path, mode) computes, where it is not the path's title
CASE_TITLES = {("logits", "nograd"): "Logits path, no-grad forward: per-token log-probs + entropy from given (B,T,V) "
                                     "logits under torch.no_grad() (an old / reference policy pass; no loss, no "
                                     "gradient-in-forward kernel)",
               ("distill", "nograd"): "Distillation, no-grad forward: the per-token divergence from both heads under "
                                      "torch.no_grad() (an evaluation pass; Liger has no such call)"}
MODE_ORDER = ("fwdbwd", "fwd", "bwd", "nograd")
VARIANT_TITLES = {"valid": "every token valid", "padded": "a third of the tokens padded",
                  "frozen": "frozen lm_head, every token valid", "longrow": "one long row, every token valid",
                  "reverse_kl": "reverse KL (beta 1, TRL's default), every token valid"}
# the (path, variant, mode) cases in run order, harness.CASES (here, so that the report runs without torch)
CASES = (("linear", "valid", "fwdbwd"), ("logits", "valid", "fwdbwd"), ("logprob", "valid", "nograd"),
         ("distill", "valid", "fwdbwd"),
         ("linear", "padded", "fwdbwd"), ("logits", "padded", "fwdbwd"), ("logprob", "padded", "nograd"),
         ("linear", "frozen", "fwdbwd"), ("logits", "longrow", "fwdbwd"),
         ("linear", "valid", "fwd"), ("linear", "valid", "bwd"), ("logits", "valid", "nograd"),
         ("logits", "valid", "bwd"), ("distill", "reverse_kl", "fwdbwd"), ("distill", "valid", "nograd"))
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
    if r.get("H_t"):  # distillation: the student's and the teacher's widths
        s = f"N={r['N']} H_s={r['H']} H_t={r['H_t']} V={r['V']}"
    else:
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


def _value_name(path: str, mode: str) -> str:
    """What the check column compares: the loss, or the no-grad pass's mean (log-prob; divergence on the distill
    path)."""
    if mode != "nograd":
        return "loss"
    return "mean divergence" if path == "distill" else "mean log-prob"


def section(path: str, variant: str, mode: str, rs: list[dict]) -> list[str]:
    unit = "TFLOP/s" if rs[0]["work_unit"] == "FLOP" else "GB/s"
    split = mode == "fwdbwd"  # forward and backward peaks of their own
    out = [f"### {path}, {VARIANT_TITLES.get(variant, variant)}: {MODE_TITLES[mode]}", "",
           f"{CASE_TITLES.get((path, mode), PATH_TITLES[path])}.", "",
           f"| shape | provider | median ms | time / best peer | peak mem | mem / best peer | "
           + ("peak fwd / bwd | " if split else "") + f"rows computed | work / call | {unit} | % of ceiling | "
           f"{_value_name(path, mode)} check |",
           "|---|---|---:|---:|---:|---:|" + ("---:|" if split else "") + "---:|---|---:|---:|---:|"]
    by_shape = defaultdict(list)
    for r in rs:
        by_shape[(r["N"], r["H"], r["V"], r.get("H_t") or 0)].append(r)
    above = daggers = False
    for key in sorted(by_shape, key=lambda k: (k[1], k[3], k[2], k[0])):
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
            fb = (f"{_mem(r.get('peak_fwd_bytes'))} / {_mem(r.get('peak_bwd_bytes'))} | " if split else "")
            out.append(f"| {shape_id(r)} | {name} | {_ms(r['median_s'])} | {t_ratio} | "
                       f"{_mem(r.get('peak_mem_bytes'))} | {m_ratio} | {fb}{_rows(r)} | "
                       f"{r.get('work_formula', '?')} | {rate} | {frac} | {_value_check(r, eager)} |")
    ceilings = {(shape_id(r), r["ceiling_what"], r["ceiling"]) for r in rs if r.get("ceiling")}
    out += ["", "Ceilings measured in this run: " + "; ".join(
        f"{s}: {w} = {c:.3g} {rs[0]['ceiling_unit']}" for s, w, c in sorted(ceilings)) + "."]
    if split:
        out.append("\nPeak fwd / bwd: the forward alone (holding what it saves for the backward) and the backward "
                   "alone (above the state after the forward), from a separate call.")
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
            by_shape[(r["N"], r["H"], r["V"], r.get("T"), r.get("H_t") or 0)].append(r)
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


def _compact_cases(ns: list[dict]) -> str:
    """"14 (linear 8, logits 6)": how many benchmarks, and how many on each path, instead of listing them."""
    per_path = defaultdict(int)
    for n in ns:
        per_path[n.get("path", "?")] += 1
    return f"{len(ns)} (" + ", ".join(f"{p} {k}" for p, k in sorted(per_path.items())) + ")"


def not_run_table(not_run: list[dict]) -> str:
    """Benchmarks that did not run: one line per (status, reason), with the providers it hit and a count of cases."""
    if not not_run:
        return "Every benchmark of the run finished.\n"
    groups = defaultdict(list)
    for n in not_run:
        groups[(n["status"], n["reason"])].append(n)
    out = ["| status | reason | providers | benchmarks |", "|---|---|---|---:|"]
    for (status, reason), ns in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        providers = ", ".join(sorted({n["provider"] for n in ns}))
        out.append(f"| {status} | {reason.replace('|', '/')} | {providers} | {_compact_cases(ns)} |")
    return "\n".join(out) + "\n"


def trainer_table(rows: list[dict]) -> str:
    """grpo.train against TRL's GRPOTrainer per optimizer step (benchmarks/test_trainer_speed.py), or ""."""
    trs = [r for r in rows if r.get("path") == "trainer" and r.get("ours_step_s") and r.get("trl_step_s")]
    if not trs:
        return ""
    out = ["### Trainer step: grpo.train against TRL's GRPOTrainer", "",
           "Same tiny Llama, task, batch (16 prompts x G = 8, 6 completion tokens), loss (dapo, beta 0.02) and "
           "optimizer; a step is generation, rewards, reference log-probs, loss forward/backward and the optimizer "
           "(median over the timed steps; `benchmarks/test_trainer_speed.py`).", "",
           "| trainer | median step (ms) | / TRL | steps timed | CPU threads |", "|---|---:|---:|---:|---:|"]
    for r in trs:
        out.append(f"| grpo.train | {1e3 * r['ours_step_s']:.1f} | {r['ours_step_s'] / r['trl_step_s']:.2f}x | "
                   f"{r.get('steps_timed', '?')} | {r.get('threads') or '?'} |")
        out.append(f"| TRL GRPOTrainer | {1e3 * r['trl_step_s']:.1f} | 1.00x | {r.get('steps_timed', '?')} | "
                   f"{r.get('threads') or '?'} |")
    return "\n".join(out) + "\n"


def sft_table(rows: list[dict]) -> str:
    """TRL's SFTTrainer per optimizer step, stock against patch_trl() (benchmarks/test_sft_step.py), or ""."""
    trs = [r for r in rows if r.get("path") == "trl_sft" and r.get("stock_step_s") and r.get("patched_step_s")]
    if not trs:
        return ""
    out = ["### TRL SFTTrainer step: stock against patch_trl()", "",
           "Same tiny Llama (hidden 64, V = 8000, untied head), 64 random 64-token texts, batch 8, AdamW, fp32; a step "
           "is forward, backward, metrics and optimizer (median over the timed steps; "
           "`benchmarks/test_sft_step.py`).", "",
           "| SFTTrainer | median step (ms) | / stock | steps timed | device | CPU threads |",
           "|---|---:|---:|---:|---|---:|"]
    for r in trs:
        common = f"{r.get('steps_timed', '?')} | {r.get('device', '?')} | {r.get('threads') or '?'} |"
        out.append(f"| with patch_trl() | {1e3 * r['patched_step_s']:.1f} | "
                   f"{r['patched_step_s'] / r['stock_step_s']:.2f}x | {common}")
        out.append(f"| stock TRL | {1e3 * r['stock_step_s']:.1f} | 1.00x | {common}")
    return "\n".join(out) + "\n"


def e2e_table(e2e: dict | None) -> str:
    """The end-to-end GRPO step of benchmarks/e2e_step.py (its JSON), or "" when there is none."""
    if not e2e or not e2e.get("results"):
        return ""
    setup, results = e2e.get("setup", {}), e2e["results"]
    stock = results.get("trl", {}).get("step_s")
    out = ["### End-to-end GRPO step (`benchmarks/e2e_step.py`)", "",
           f"{setup.get('model', '?')}, V={setup.get('vocab', '?')}, {setup.get('prompts', '?')} prompts x "
           f"G={setup.get('G', '?')}, {setup.get('completion_length', '?')} completion tokens, "
           f"{setup.get('steps', '?')} steps (the first is warm-up); a step is generation, rewards, loss and "
           "optimizer.", "",
           "| variant | median step (s) | / TRL stock | peak memory (GiB) |", "|---|---:|---:|---:|"]
    titles = {"trl": "TRL GRPOTrainer", "trl_patched": "TRL + grpo_kernels.patch_trl()", "grpo_train": "grpo.train"}
    for variant, r in results.items():
        name = titles.get(variant, variant)
        if "skipped" in r:
            out.append(f"| {name} | not run: {str(r['skipped']).splitlines()[0][:200].replace('|', '/')} | | |")
            continue
        ratio = f"{r['step_s'] / stock:.2f}x" if stock else "n/a"
        peak = r.get("peak_gib")
        peak = "n/a" if peak is None or peak != peak else f"{peak:.2f}"  # NaN on CPU smoke runs
        out.append(f"| {name} | {r['step_s']:.3f} | {ratio} | {peak} |")
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
             *(["- distillation, every provider: TRL's divergence (beta 0 KL(teacher || student), 1 KL(student || "
                "teacher), else the generalized JSD with mixture (1 - beta) p_student + beta p_teacher): beta 0.5 "
                "for 'every token valid', 1 for 'reverse KL'; temperature 1; the mean over the valid tokens; the "
                "gradient to the student only; every value checked before the timing against float64 by the "
                "three-way rule (tests/support/tolerances.py); work in multiples of R V H_s and R V H_t (k RHV "
                "where H_s = H_t)"] if any(r.get("path") == "distill" for r in rows) else []),
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


def trainers(rows: list[dict], e2e: dict | None) -> str:
    parts = [t for t in (trainer_table(rows), sft_table(rows), e2e_table(e2e)) if t]
    return "\n".join(parts)


def render(data: dict, rows: list[dict], not_run: list[dict], e2e: dict | None = None) -> str:
    extra = trainers(rows, e2e)
    return (header(data, rows) + "\n### Summary: ours against the fastest peer\n\n" + summary(rows, not_run)
            + ("\n" + extra if extra else "") + "\n" + tables(rows) + "\n### Not run\n\n"
            + not_run_table(not_run))


def load_e2e(results: pathlib.Path, explicit: pathlib.Path | None) -> dict | None:
    """benchmarks/e2e_step.py's JSON: ``explicit``, else e2e_step.json next to the results; None when absent."""
    path = explicit if explicit is not None else results.parent / "e2e_step.json"
    if not path.is_file():
        if explicit is not None:
            raise SystemExit(f"--e2e {path}: no such file")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--e2e {path}: not a JSON file of benchmarks/e2e_step.py ({exc})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=pathlib.Path, help="pytest-benchmark --benchmark-json output")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="output folder (default: the folder of the results file)")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG (the tables are complete without them)")
    ap.add_argument("--print", dest="show", choices=("all", "summary"), default="all",
                    help="what to print (the file always has everything)")
    ap.add_argument("--e2e", type=pathlib.Path, default=None,
                    help="results of benchmarks/e2e_step.py (default: e2e_step.json next to the results, if any)")
    args = ap.parse_args(argv)
    try:
        data, rows, not_run = load(args.results)
    except OSError as exc:
        print(f"{args.results}: cannot read ({exc.strerror or type(exc).__name__})", file=sys.stderr)
        return 1
    except (ValueError, KeyError, TypeError) as exc:
        print(f"{args.results}: not a pytest-benchmark JSON file ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    e2e = load_e2e(args.results, args.e2e)
    if not any(r.get("path") in PATH_TITLES or r.get("path") in ("trainer", "trl_sft") for r in rows) and not not_run:
        print(f"{args.results}: no benchmark of this suite in the file", file=sys.stderr)
        return 1
    out = args.results.parent if args.out is None else args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"--out {out}: cannot create the folder ({exc.strerror or type(exc).__name__})", file=sys.stderr)
        return 1
    stem = args.results.stem
    md = render(data, rows, not_run, e2e)
    pngs, plot_notes = [], []
    if not args.no_plots:
        from .plots import plots
        pngs, plot_notes = plots(rows, out, stem)
    if pngs or plot_notes:
        md += "\n### Plots\n\n" + "".join(f"- `{p.name}`\n" for p in pngs) + "".join(f"- {n}\n" for n in plot_notes)
    try:
        (out / f"{stem}.md").write_text(md)
    except OSError as exc:
        print(f"--out {out}: cannot write {stem}.md ({exc.strerror or type(exc).__name__})", file=sys.stderr)
        return 1
    if args.show == "summary":
        first = next((r for r in rows if r.get("path") in PATH_TITLES), {})
        print(f"Benchmark summary: {first.get('device', '?')} ({first.get('dtype', '?')}), torch "
              f"{first.get('torch', '?')}, triton {first.get('triton', '?')}; all tables in "
              f"{out / (stem + '.md')}\n")
        print(summary(rows, not_run))
        extra = trainers(rows, e2e)
        if extra:
            print(extra)
    else:
        print(md)
    for note in plot_notes:
        print(note, file=sys.stderr)
    print(f"wrote {out / (stem + '.md')}" + "".join(f"\nwrote {p}" for p in pngs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
