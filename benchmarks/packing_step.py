"""``grpo.train`` training step on a long-tailed batch: padded rows (``--no-packing``) against packed rows, in one run.

    python -m benchmarks.packing_step --out DIR [--device cpu|cuda] [--shape cpu|qwen2.5-0.5b] [--steps 8]
    python -m benchmarks.packing_step --out DIR --sampling --max-len 64     # + the sampling forward, --single-pass

The batch: ``--prompts`` prompts x G = 8 completions, lengths drawn from a fixed, documented distribution (seeded):
- prompt lengths uniform in [8, 32] tokens;
- in every group of G, one completion runs to the limit ``--max-len`` (no EOS: truncated) and the other G - 1 stop
  early, after ``ceil(Exp(mean = max_len / 8))`` tokens (at most max_len, EOS last): the long tail of GRPO
  completions, where a few answers hit the limit and most do not.
With max_len 256 about 72-75% of the padded (rows x (longest prompt + max_len)) batch is padding; the run measures
and prints the fraction. Tokens are random ids the sampler may emit; advantages are random normals.

A step is what ``grpo.train`` runs after sampling: the reference pass (beta = 0.04, no grad), the loss forward and
backward, clipping and AdamW (``Trainer``'s own ``rollout_logprobs`` and ``optimizer_step`` with its step options; the
rollout is injected in place of sampling, which does not change with packing: it decodes with a KV cache on padded
rows). Variants: ``padded`` (``--no-packing``), ``packed`` (the default), ``packed_budget``
(``--max-tokens-per-micro-batch`` a quarter of the packed batch's tokens: several micro-batches).

``--sampling`` (completion limit <= 64 tokens, grpo.train's ``--single-pass`` limit): every step starts with the
sampling forward, grpo.train's own decode loop (``grpo.rollout.sample_completions``: the prompts' forward, then one
token per row and step with a KV cache, padded rows) with each draw replaced by the batch's token (so the lengths
stay the documented ones; the loop runs to the limit, since one row per group does), and a fourth variant runs,
``single_pass`` (``--single-pass``: that forward runs with autograd on and the loss backpropagates through it, on
its padded rows; the reference pass packed), against which the others pay a forward of their own for the loss. The
decode loop runs each row's own prompt (the batch's prompt lengths differ within a group; grpo.train runs a group's
prompt once and repeats its cache). Step time: the trainers in one process, their steps alternating (the order rotating), so that a busy machine slows all
alike; the first step of each is warm-up, the median of the others is reported. Peak memory: each variant in a
process of its own, over two steps; on CUDA ``torch.cuda.max_memory_allocated`` (weights, reference and optimizer
state included), on the CPU the peak resident memory above the resident memory before the steps (VmHWM - VmRSS,
allocator slack included).

Models: ``cpu``, a random Qwen2 of hidden 128, 2 layers, vocabulary 2048 (one thread unless ``--threads``);
``qwen2.5-0.5b``, Qwen2.5-0.5B's shape (benchmarks/e2e_step.py), bf16 autocast on CUDA. Writes
``DIR/packing_step.json`` and ``DIR/packing_step.md``. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

from .e2e_step import QWEN25_05B, build_model_dir

VARIANTS = ("padded", "packed", "packed_budget")
SAMPLING_VARIANTS = VARIANTS + ("single_pass",)
CPU_SHAPE = dict(QWEN25_05B, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048)
SHAPES = {"cpu": CPU_SHAPE, "qwen2.5-0.5b": QWEN25_05B}
G = 8
EOS, PAD = 1, 0


def lengths(prompts: int, max_len: int, seed: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, completion lengths) of the documented distribution (module docstring)."""
    import random

    rng = random.Random(seed)
    prompt = [rng.randint(8, 32) for _ in range(prompts * G)]
    completion = []
    for _ in range(prompts):
        completion.append(max_len)
        completion += [min(max_len, max(1, math.ceil(rng.expovariate(8.0 / max_len)))) for _ in range(G - 1)]
    return prompt, completion


def make_rollout(prompt_lengths, completion_lengths, max_len: int, vocab: int, seed: int, device):
    """A Rollout of these lengths (left-padded prompts, EOS closing each completion shorter than max_len)."""
    import torch

    from grpo.rollout import Rollout, completion_mask_after_eos

    g = torch.Generator().manual_seed(seed)
    B, P = len(prompt_lengths), max(prompt_lengths)
    prompt = torch.full((B, P), PAD, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion = torch.full((B, max_len), PAD, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt[b, P - p:] = torch.randint(2, vocab, (p,), generator=g)
        prompt_mask[b, P - p:] = 1
        completion[b, :c] = torch.randint(2, vocab, (c,), generator=g)
        if c < max_len:
            completion[b, c - 1] = EOS
    mask, truncated = completion_mask_after_eos(completion, [EOS])
    rollout = Rollout(input_ids=torch.cat([prompt, completion], 1).to(device),
                      attention_mask=torch.cat([prompt_mask, mask.long()], 1).to(device), prompt_length=P,
                      completion_ids=completion.to(device), completion_mask=mask.to(device),
                      rewards=torch.zeros(B, 1), reward_total=torch.zeros(B), truncated=truncated,
                      prompts=[""] * B, completions=[""] * B)
    advantages = torch.randn(B, generator=g).to(device)
    return rollout, advantages


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return int(status[key].split()[0]) * 1024


def build_trainer(variant: str, model_dir: str, work: str, a):
    """grpo.train's Trainer for ``variant`` on the --model folder, and its list of (rollout, advantages)."""
    import torch

    from grpo import TrainConfig
    from grpo.distributed import DistEnv
    from grpo.trainer import Trainer
    from grpo_kernels import GRPOLossConfig

    data = os.path.join(work, "prompts.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"prompt": "abcdefgh" * 2, "answer": "0"}) + "\n" for _ in range(8))
    prompt, completion = lengths(a.prompts, a.max_len, a.seed)
    budget = sum(p + c - 1 for p, c in zip(prompt, completion)) // 4 if variant == "packed_budget" else None
    cfg = TrainConfig(model=model_dir, dataset=data, output_dir=os.path.join(work, variant), overwrite=True,
                      max_steps=a.steps, progress=False, save_steps=0, eval_size=0, device=a.device,
                      prompts_per_step=a.prompts, num_generations=G, max_new_tokens=a.max_len, lr=1e-6,
                      warmup_steps=0, chat_template="off", rewards=("benchmarks.e2e_step:length_reward",),
                      loss=GRPOLossConfig(beta=0.04), packing=variant != "padded", max_tokens_per_micro_batch=budget,
                      single_pass=variant == "single_pass")
    os.makedirs(cfg.output_dir, exist_ok=True)
    trainer = Trainer(cfg, DistEnv(device=torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")))
    vocab = trainer.lm.get_output_embeddings().weight.shape[0]
    batches = [make_rollout(prompt, completion, a.max_len, vocab, a.seed + i, trainer.device) for i in range(a.steps)]
    return trainer, batches, budget


def sampling_forward(trainer, rollout) -> None:
    """grpo.train's decode loop on ``rollout``'s prompts, each draw replaced by the rollout's own token (module
    docstring); with ``--single-pass`` its hidden states are kept with their graph in ``rollout.hidden``, as
    ``Sampler.rollout(keep_graph=True)`` keeps them."""
    import contextlib

    import torch

    import grpo.rollout as sampling

    P, T = rollout.prompt_length, rollout.completion_ids.shape[1]
    forced = iter(rollout.completion_ids.t())
    draw, sampling.next_tokens = sampling.next_tokens, lambda *args, **kwargs: next(forced)
    autocast = trainer.sampler.autocast_dtype
    trainer.lm.eval()
    try:
        with torch.autocast(trainer.device.type, dtype=autocast) if autocast else contextlib.nullcontext():
            ids, hidden = sampling.sample_completions(
                trainer.lm, rollout.input_ids[:, :P], rollout.attention_mask[:, :P], repeats=1, max_new_tokens=T,
                eos_ids=[EOS], pad_id=PAD, banned=trainer.sampler.banned, keep_graph=trainer.single_pass)
    finally:
        sampling.next_tokens = draw
        trainer.lm.train()
    if not torch.equal(ids, rollout.completion_ids):
        raise RuntimeError("the teacher-forced decode loop did not reproduce the batch's tokens")
    rollout.hidden = hidden


def train_step(trainer, rollout, advantages, sampling: bool = False) -> tuple[float, dict]:
    """(seconds, stats) of one step as ``Trainer._train_loop`` runs it after sampling (``sampling``: from the
    sampling forward on): the reference pass, then ``optimizer_step`` over the whole rollout (one mini-batch)."""
    import time

    import torch

    from grpo.update import optimizer_step, rollout_logprobs

    cuda = trainer.device.type == "cuda"
    t0 = time.perf_counter()
    if sampling:
        sampling_forward(trainer, rollout)
    ref = rollout_logprobs(trainer.ref, rollout, trainer.cfg.micro_batch_size, trainer.packing)
    rows = torch.arange(rollout.batch_size, device=trainer.device)
    stats = optimizer_step(trainer.model, trainer.policy, trainer.optimizer, trainer.scheduler, rollout, rows,
                           advantages, None, ref, trainer.step_options)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, stats


def time_variants(model_dir: str, work: str, a) -> dict:
    """Every variant's trainer in this one process, their steps alternating (the order rotating each step), so
    that the machine's load falls on all alike: {variant: step seconds, tokens_per_step, padding_saved, budget}."""
    variants = SAMPLING_VARIANTS if a.sampling else VARIANTS
    built = {v: build_trainer(v, model_dir, work, a) for v in variants}
    out = {v: {"step_s": [], "budget": built[v][2]} for v in variants}
    for i in range(a.steps):
        order = variants[i % len(variants):] + variants[:i % len(variants)]
        for v in order:
            trainer, batches, _ = built[v]
            seconds, stats = train_step(trainer, *batches[i], sampling=a.sampling)
            out[v]["step_s"].append(seconds)
            out[v]["tokens_per_step"] = stats["positions"]
            out[v]["padding_saved"] = 1.0 - stats["positions"] / stats["padded_positions"]
    return out


def peak_memory(variant: str, model_dir: str, work: str, a) -> dict:
    """Peak memory of ``variant``'s steps in a process of its own: CUDA, max_memory_allocated over the steps (model,
    reference, optimizer state included); CPU, peak resident memory above the resident memory before them."""
    import torch

    trainer, batches, _ = build_trainer(variant, model_dir, work, a)
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _status("VmRSS")
    for rollout, advantages in batches[:2]:
        train_step(trainer, rollout, advantages, sampling=a.sampling)
    return {"peak_bytes": float(torch.cuda.max_memory_allocated() if cuda else _status("VmHWM") - before)}


def _child(mode: str, variant: str | None, model_dir: str, a) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.packing_step", "--mode", mode, "--model-dir", model_dir,
           "--out", a.out, "--device", a.device, "--shape", a.shape, "--prompts", str(a.prompts), "--max-len",
           str(a.max_len), "--steps", str(a.steps), "--seed", str(a.seed), "--threads", str(a.threads)]
    if variant is not None:
        cmd += ["--variant", variant]
    if a.sampling:
        cmd.append("--sampling")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads)) if a.device == "cpu" else None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"skipped": f"timed out after {a.timeout_s} s"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PACKING_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}"}
    return json.loads(line.split(" ", 1)[1])


def report(results: dict, setup: dict, out: str) -> str:
    base = results.get("padded", {})
    step = "from the sampling forward (teacher-forced) on" if setup.get("sampling") else "after sampling"
    lines = [f"{setup['model']}, {setup['rows']} completions (G = {G}), completion limit {setup['max_len']}, "
             f"{setup['padding']:.1%} of the padded batch is padding, {setup['precision']}, the step {step}", "",
             "| variant | step (s) | vs padded | peak memory (MiB) | vs padded | tokens per step | padding saved |",
             "|---|---|---|---|---|---|---|"]
    for variant, r in results.items():
        if "step_s" not in r:
            lines.append(f"| {variant} | skipped: {r['skipped']} | | | | | |")
            continue
        ratio = r["step_s"] / base["step_s"] if "step_s" in base else float("nan")
        peak = r.get("peak_bytes", float("nan"))  # nan: its memory run failed ("skipped" says why)
        mem = peak / base["peak_bytes"] if base.get("peak_bytes") else float("nan")
        lines.append(f"| {variant} | {r['step_s']:.3f} | {ratio:.2f} | {peak / 2**20:.0f} | {mem:.2f} | "
                     f"{r['tokens_per_step']:.0f} | {r['padding_saved']:.1%} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "packing_step.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "packing_step.json"), "w") as f:
        json.dump({"setup": setup, "results": results}, f, indent=2)
    return text


def main(argv=None) -> int:
    from grpo.config import SINGLE_PASS_MAX_NEW_TOKENS, quiet_unused_deepspeed

    p = argparse.ArgumentParser(prog="python -m benchmarks.packing_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for packing_step.json and packing_step.md")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shape", choices=tuple(SHAPES), default="cpu")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (x G = 8 completions)")
    p.add_argument("--max-len", type=int, default=256, help="completion limit in tokens")
    p.add_argument("--steps", type=int, default=8, help="steps per variant, alternating (the first is warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--timeout-s", type=int, default=1200, help="per child process")
    p.add_argument("--sampling", action="store_true",
                   help=f"time each step from the sampling forward on and add the single_pass variant (--max-len <= "
                        f"{SINGLE_PASS_MAX_NEW_TOKENS})")
    p.add_argument("--mode", choices=("time", "memory"), help=argparse.SUPPRESS)  # internal: JSON on stdout
    p.add_argument("--variant", choices=SAMPLING_VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    quiet_unused_deepspeed()  # saving the model imports DeepSpeed where installed, which warns on a CPU machine
    if a.sampling and a.max_len > SINGLE_PASS_MAX_NEW_TOKENS:
        p.error(f"--sampling: --max-len must be <= {SINGLE_PASS_MAX_NEW_TOKENS} (grpo.train's --single-pass limit)")
    os.makedirs(a.out, exist_ok=True)
    if a.mode is not None:
        import torch

        if a.device == "cpu":
            torch.set_num_threads(a.threads)
        result = time_variants(a.model_dir, a.out, a) if a.mode == "time" else \
            peak_memory(a.variant, a.model_dir, a.out, a)
        print("PACKING_RESULT " + json.dumps(result), flush=True)
        return 0
    model_dir = os.path.join(a.out, f"model_{a.shape}")
    if not os.path.isdir(model_dir):
        build_model_dir(model_dir, SHAPES[a.shape])
    timed = _child("time", None, model_dir, a)
    results = {}
    for variant in SAMPLING_VARIANTS if a.sampling else VARIANTS:
        r = timed if "skipped" in timed else dict(timed[variant])
        if "step_s" in r:
            r["steps"], r["step_s"] = r["step_s"], statistics.median(r["step_s"][1:] or r["step_s"])
            r.update(_child("memory", variant, model_dir, a))
        results[variant] = r
    prompt, completion = lengths(a.prompts, a.max_len, a.seed)
    real = sum(p + c for p, c in zip(prompt, completion))
    setup = {"model": f"{a.shape}-shaped Qwen2, random init", "rows": len(prompt), "max_len": a.max_len,
             "padding": 1 - real / (len(prompt) * (max(prompt) + a.max_len)), "steps": a.steps, "device": a.device,
             "threads": a.threads if a.device == "cpu" else None,
             "precision": "bf16 autocast" if a.device == "cuda" else "fp32", "sampling": a.sampling,
             "lengths": {"prompt": prompt, "completion": completion}}
    print(report(results, setup, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
