"""``python -m grpo.train``'s own step on the built-in task: the default (packed) against ``--single-pass``, in one run.

    python -m benchmarks.single_pass_step --out DIR [--steps 40]

Variants, each the default run (the built-in 3-layer Llama of hidden 64, the copy task, 16 prompts x G = 8,
completions of at most 6 tokens, dapo, beta 0.02, fp32 on the CPU) but for one flag: ``packed`` (the default: the
sampling forward without autograd, then the loss's forward and backward on packed rows), ``single_pass``
(``--single-pass``: the sampling forward with autograd on, the loss backpropagating through its padded rows) and
``padded`` (``--no-packing``: the loss's forward and backward on padded rows). A step is the body of
``Trainer._train_loop``: sampling a rollout, the reference pass and ``optimizer_step``. The three trainers start
from the same seed (the same weights and first rollout) and run in one process, their steps alternating (the
order rotating), so that a busy machine slows all alike; the first two steps of each are warm-up, the median of the
others is reported with the range of the per-step ratios to ``packed``. Peak memory: each variant in a process of
its own over three steps, the peak resident memory above the resident memory before them (VmHWM - VmRSS). One
thread (``--threads``). Writes ``DIR/single_pass_step.json`` and ``DIR/single_pass_step.md``. Not collected by
pytest. The long-tailed comparison, where completions differ in length: ``benchmarks/packing_step.py --sampling``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("packed", "single_pass", "padded")
WARMUP = 2


def build_trainer(variant: str, work: str, steps: int):
    import torch

    from grpo import TrainConfig
    from grpo.distributed import DistEnv
    from grpo.trainer import Trainer

    cfg = TrainConfig(output_dir=os.path.join(work, variant), overwrite=True, max_steps=steps, progress=False,
                      save_steps=0, packing=variant != "padded", single_pass=variant == "single_pass")
    os.makedirs(cfg.output_dir, exist_ok=True)
    return Trainer(cfg, DistEnv(device=torch.device("cpu")))


def train_step(trainer) -> tuple[float, dict]:
    """(seconds, stats) of one step of ``Trainer._train_loop`` (one rollout, one optimizer step)."""
    from grpo.update import optimizer_step, rollout_logprobs

    t0 = time.perf_counter()
    rollout, advantages = trainer.make_rollout()
    ref = rollout_logprobs(trainer.ref, rollout, trainer.cfg.micro_batch_size, trainer.packing)
    (rows,) = trainer.minibatches()
    stats = optimizer_step(trainer.model, trainer.policy, trainer.optimizer, trainer.scheduler, rollout, rows,
                           advantages, None, ref, trainer.step_options)
    return time.perf_counter() - t0, stats


def time_variants(work: str, steps: int) -> dict:
    built = {v: build_trainer(v, work, steps) for v in VARIANTS}
    out = {v: {"steps": [], "padding_saved": []} for v in VARIANTS}
    for i in range(steps):
        for v in VARIANTS[i % len(VARIANTS):] + VARIANTS[:i % len(VARIANTS)]:
            seconds, stats = train_step(built[v])
            out[v]["steps"].append(seconds)
            out[v]["padding_saved"].append(1.0 - stats["positions"] / stats["padded_positions"])
    return out


def peak_memory(variant: str, work: str) -> dict:
    trainer = build_trainer(variant, work, 3)
    before = _status("VmRSS")
    for _ in range(3):
        train_step(trainer)
    return {"peak_bytes": float(_status("VmHWM") - before)}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return int(status[key].split()[0]) * 1024


def _child(a, mode: str, variant: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.single_pass_step", "--out", a.out, "--steps", str(a.steps),
           "--threads", str(a.threads), "--mode", mode] + (["--variant", variant] if variant else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s,
                          env=dict(os.environ, OMP_NUM_THREADS=str(a.threads)))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SINGLE_PASS_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{mode} {variant or ''} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(line.split(" ", 1)[1])


def report(results: dict, steps: int, out: str) -> str:
    base = results["packed"]
    lines = [f"grpo.train's default run on the built-in copy task (CPU, fp32, one thread), {steps} steps per variant "
             f"alternating, median of the last {steps - WARMUP}", "",
             "| variant | step (s) | vs packed | per-step ratio range | peak memory (MiB) | vs packed | padding saved |",
             "|---|---|---|---|---|---|---|"]
    for variant, r in results.items():
        ratios = [s / b for s, b in zip(r["steps"][WARMUP:], base["steps"][WARMUP:])]
        lines.append(f"| {variant} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} | "
                     f"{min(ratios):.2f}-{max(ratios):.2f} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / base['peak_bytes']:.2f} | {statistics.mean(r['padding_saved']):.1%} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "single_pass_step.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "single_pass_step.json"), "w") as f:
        json.dump({"steps": steps, "results": results}, f, indent=2)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.single_pass_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for single_pass_step.json and single_pass_step.md")
    p.add_argument("--steps", type=int, default=40, help=f"steps per variant, alternating (the first {WARMUP} are "
                                                         "warm-up)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--timeout-s", type=int, default=1200, help="per child process")
    p.add_argument("--mode", choices=("time", "memory"), help=argparse.SUPPRESS)  # internal: JSON on stdout
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps <= WARMUP:
        p.error(f"--steps must be > {WARMUP} (the first {WARMUP} are warm-up)")
    from grpo.config import quiet_unused_deepspeed

    quiet_unused_deepspeed()
    os.makedirs(a.out, exist_ok=True)
    if a.mode is not None:
        result = time_variants(a.out, a.steps) if a.mode == "time" else peak_memory(a.variant, a.out)
        print("SINGLE_PASS_RESULT " + json.dumps(result), flush=True)
        return 0
    results = _child(a, "time")
    for variant, r in results.items():
        r["step_s"] = statistics.median(r["steps"][WARMUP:])
        r.update(_child(a, "memory", variant))
    print(report(results, a.steps, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
