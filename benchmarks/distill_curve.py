"""On-policy distillation in ``grpo.train``, from scratch: a teacher trained by the default run, then a fresh,
narrower student distilled from it, beside plain GRPO from the same student initialization.

    python -m benchmarks.distill_curve --out DIR [--steps 800] [--student-hidden 32] [--seed 0] [--teacher PATH]
    python -m benchmarks.distill_curve --from-json DIR/distill_curve.json   # the report again, no training

Runs, one after another, each ``python -m grpo.train`` in a process of its own (``--no-progress``, the same
``--seed``, ``--max-steps``; every other option the default: the copy task, 16 prompts x G = 8, dapo, lr 1e-3):

- ``teacher``: the default run (the built-in 3-layer Llama of hidden 64); ``--teacher PATH`` skips it and uses PATH;
- ``grpo``: the student (``--hidden-size``, default 32: half the teacher's width, 4 heads of 8) with plain GRPO;
- ``grpo+distill``: the same student with ``--teacher DIR/teacher/checkpoint-<steps>``: the distillation loss
  (reverse KL, coefficient 1) added to the GRPO loss;
- ``distill-only``: the same with ``--distill-only`` (no GRPO term, no reference model);
- ``distill-only-beta0``: the same with ``--distill-beta 0``: the forward KL(teacher || student) instead.

The students start from the same weights (the built-in model is initialized from ``--seed`` before the teacher is
loaded) and see the same prompts; their samples differ once their weights do. The table is each run's held-out
greedy exact-copy accuracy (``eval/accuracy`` in metrics.jsonl: the 58 held-out strings, the string then EOS) every
100 steps. Then the outputs themselves: every final model (``checkpoint-<steps>/model``) decodes the held-out prompts
again with transformers' own ``generate`` (greedy, the task's letters and EOS allowed, as the trainer's sampler
allows them) and each completion is compared with its answer as text (not through the trainer's sampler or its
reward); the count must equal the last ``eval/accuracy``. Writes ``DIR/distill_curve.json`` and
``DIR/distill_curve.md``, the run folders under ``DIR`` (evaluations every 50 steps, the default; the table shows
every 100th and the first evaluation reaching 0.9 and 1.0). Not collected by pytest.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

RUNS = ("teacher", "grpo", "grpo+distill", "distill-only", "distill-only-beta0")
EVERY = 100


def run_train(name: str, out: str, args: list[str]) -> float:
    """One ``python -m grpo.train`` run into ``out`` (its log in ``out.log``); its wall seconds."""
    t0 = time.time()
    with open(out + ".log", "w") as log:
        proc = subprocess.run([sys.executable, "-m", "grpo.train", "--output-dir", out, "--overwrite",
                               "--no-progress", *args], stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"distill_curve: the {name} run failed (exit {proc.returncode}); see {out}.log")
    return time.time() - t0


def accuracy_curve(run_dir: str) -> dict[int, float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {r["step"]: r["eval/accuracy"] for r in records if "eval/accuracy" in r}


def initial_weights(run_dir: str, steps: int) -> str:
    """The run's initial-weights fingerprint (run_settings.json of its last checkpoint, grpo/run_settings.py)."""
    with open(os.path.join(run_dir, f"checkpoint-{steps}", "run_settings.json")) as f:
        return json.load(f)["identity"]["model_weights"]


def held_out_rows() -> list[dict]:
    """The default run's held-out rows (the fixed split of the built-in copy task)."""
    from grpo.data import BUILTIN_TASKS, split_eval

    return split_eval(BUILTIN_TASKS["copy"](), None)[1]


def decode_check(model_dir: str, rows: list[dict], max_new_tokens: int = 6) -> dict:
    """Greedy completions of ``rows`` by the model in ``model_dir`` with ``generate`` (only the task's letters and
    EOS allowed), compared with the answers as text: (exact count, total, samples)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from grpo.data import TASK_COMPLETION_CHARS

    hf_logging.disable_progress_bar()

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    allowed = set(TASK_COMPLETION_CHARS["copy"])
    vocab = lm.get_output_embeddings().weight.shape[0]
    banned = [i for i in range(vocab) if i != tok.eos_token_id and
              (i >= len(tok) or not set(tok.decode([i])) or not set(tok.decode([i])) <= allowed)]
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=True)
    with torch.no_grad():
        ids = lm.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, suppress_tokens=banned,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    exact, samples = 0, []
    for row, out in zip(rows, ids[:, enc["input_ids"].shape[1]:].tolist()):
        stop = out.index(tok.eos_token_id) if tok.eos_token_id in out else None
        text = tok.decode(out if stop is None else out[:stop])
        ok = stop is not None and text == row["answer"]
        exact += ok
        samples.append({"prompt": row["prompt"], "completion": text, "eos": stop is not None, "exact": ok})
    return {"exact": exact, "total": len(rows), "samples": samples}


def table(curves: dict[str, dict[int, float]], steps: int, widths: dict[str, int]) -> list[str]:
    names = [n for n in RUNS if n in curves]
    head = " | ".join(f"{n} (hidden {widths[n]})" for n in names)
    lines = [f"| step | {head} |", "|---" * (len(names) + 1) + "|"]
    for step in range(0, steps + 1, EVERY):
        cells = " | ".join(f"{curves[n][step]:.3f}" if step in curves[n] else "-" for n in names)
        lines.append(f"| {step} | {cells} |")
    return lines


def first_at(curve: dict[int, float], level: float) -> str:
    hit = [s for s, a in sorted(curve.items()) if a >= level]
    return str(hit[0]) if hit else "never"


def report(result: dict) -> str:
    steps, widths = result["steps"], result["widths"]
    lines = [f"On-policy distillation in grpo.train: held-out greedy exact-copy accuracy against optimizer steps "
             f"(measured {result['date']}, {result['machine']}; `python -m benchmarks.distill_curve --out DIR`, "
             f"seed {result['seed']}, {steps} steps each)", ""]
    lines += table(result["curves"], steps, widths)
    lines += ["", f"The {len(result['curves']) - ('teacher' in result['curves'])} students start from the same weights "
              f"(initial-weights fingerprint sha256 {result['student_initial_weights'][:16]}, run_settings.json)."]
    lines += ["", "| run | first evaluation >= 0.9 | first evaluation at 1.0 | wall seconds | final outputs exact "
              "(generate) |",
              "|---|---|---|---|---|"]
    for name in RUNS:
        if name not in result["curves"]:
            continue
        check = result["checks"][name]
        curve = result["curves"][name]
        seconds = result["seconds"].get(name)
        lines.append(f"| {name} | {first_at(curve, 0.9)} | {first_at(curve, 1.0)} | "
                     f"{'-' if seconds is None else f'{seconds:.0f}'} | {check['exact']} / {check['total']} |")
    lines += ["", "Greedy outputs of the final models (`generate`, held-out prompts; the first 6, then any misses):", ""]
    for name in RUNS:
        if name not in result["checks"]:
            continue
        samples = result["checks"][name]["samples"]
        shown = samples[:6] + [s for s in samples[6:] if not s["exact"]][:6]
        text = ", ".join(f"`{s['prompt']}` -> `{s['completion']}`{'' if s['eos'] else ' (no EOS)'}"
                         f"{'' if s['exact'] else ' (miss)'}" for s in shown)
        lines.append(f"- {name}: {text}")
    return "\n".join(lines) + "\n"


def machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"CPU, {os.cpu_count()} cores, load {load:.1f} at the end"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder of the run folders and the results")
    p.add_argument("--from-json", help="print the report of an earlier distill_curve.json (no training)")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps of every run (default 800)")
    p.add_argument("--student-hidden", type=int, default=32, help="the students' --hidden-size (default 32)")
    p.add_argument("--seed", type=int, default=0, help="--seed of every run (default 0)")
    p.add_argument("--teacher", help="use this model / checkpoint folder as the teacher instead of training one")
    a = p.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            result = json.load(f)
        result["curves"] = {n: {int(k): v for k, v in c.items()} for n, c in result["curves"].items()}
        print(report(result), end="")
        return 0
    if not a.out:
        p.error("--out DIR is needed (or --from-json)")
    os.makedirs(a.out, exist_ok=True)
    common = ["--seed", str(a.seed), "--max-steps", str(a.steps)]
    student = common + ["--hidden-size", str(a.student_hidden)]
    seconds, widths = {}, {n: a.student_hidden for n in RUNS}
    widths["teacher"] = 64
    teacher = a.teacher
    if teacher is None:
        seconds["teacher"] = run_train("teacher", os.path.join(a.out, "teacher"), common)
        teacher = os.path.join(a.out, "teacher", f"checkpoint-{a.steps}")
    plan = {"grpo": student, "grpo+distill": student + ["--teacher", teacher],
            "distill-only": student + ["--teacher", teacher, "--distill-only"],
            "distill-only-beta0": student + ["--teacher", teacher, "--distill-only", "--distill-beta", "0"]}
    for name, args in plan.items():
        seconds[name] = run_train(name, os.path.join(a.out, name), args)
    dirs = {n: os.path.join(a.out, n) for n in plan}
    if a.teacher is None:
        dirs["teacher"] = os.path.join(a.out, "teacher")
    curves = {n: accuracy_curve(d) for n, d in dirs.items()}
    rows = held_out_rows()
    checks = {n: decode_check(os.path.join(d, f"checkpoint-{a.steps}", "model"), rows) for n, d in dirs.items()}
    for n in dirs:  # the trainer's last evaluation and the independent decode count the same exact copies
        final = curves[n][max(curves[n])]
        if round(final * checks[n]["total"]) != checks[n]["exact"]:
            raise SystemExit(f"distill_curve: {n}: eval/accuracy {final} but generate finds {checks[n]['exact']} "
                             f"of {checks[n]['total']} exact")
    starts = {initial_weights(dirs[n], a.steps) for n in plan}
    if len(starts) != 1:
        raise SystemExit(f"distill_curve: the students started from different weights: {sorted(starts)}")
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "seed": a.seed, "steps": a.steps,
              "widths": widths, "teacher": teacher, "seconds": seconds, "curves": curves, "checks": checks,
              "student_initial_weights": starts.pop()}
    with open(os.path.join(a.out, "distill_curve.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = report(result)
    with open(os.path.join(a.out, "distill_curve.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
