"""OpenRLHF's policy step, stock ``Actor.forward`` against ``grpo_kernels.openrlhf``: traced peak memory (CPU) and
the log-probs' agreement. Runs in .venv-openrlhf (scripts/setup_openrlhf.sh)::

    .venv-openrlhf/bin/python -m benchmarks.openrlhf_memory --out DIR [--prompt 512] [--completion 512]
        [--vocab 32000] [--batch 2] [--hidden 64] [--dtype bf16 fp32]

The actor is OpenRLHF's (``openrlhf.models.Actor`` loading a random one-layer Llama saved here: tiny width, so
that the backbone's own memory is small next to the head's and the step runs on a CPU), with temperature 0.7; the
batch is B rows of ``--prompt`` prompt tokens and ``--completion`` completion tokens, every token valid. The step is
the one ``trainer/ray/ppo_actor.py`` runs with ``--actor.entropy_coef`` set: ``actor(sequences, action_mask,
attention_mask, return_output=True, return_entropy=True)``, a loss ``-mean(adv * logp) - 0.01 * mean(entropy)`` over
the action tokens, and its backward to every parameter. Three variants, each measured in its own traced call:
``stock`` (OpenRLHF's own forward), ``patched`` (``grpo_kernels.openrlhf``, default ``round_logits="model"``) and
``backbone`` (the model's backbone alone, forward and backward of ``sum(hidden)``: the memory both share); and the
no-grad pass of the old / reference log-probs (``actor(sequences, action_mask, attention_mask)`` under
``torch.no_grad()``), stock and patched.

Traced peak: ``tests.support.memory_trace.transient_peak`` (the torch profiler's CPU memory events: the most bytes
held at any moment by allocations made during the call, other than its results: the log-probs and the parameters'
gradients). "head and loss" is a variant's peak minus the backbone's (what the head, the entropy, the log-probs and
the loss add). Agreement: patched log-probs against stock's over the action tokens, max and median |difference|,
and the same-maths slack of the project's tolerances (2 x ATOL[fp32] x max(1, max |logp|)) for scale. Writes
``DIR/openrlhf_memory.json`` and ``DIR/openrlhf_memory.md``. Not collected by pytest.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STUBS = ROOT / "tests" / "openrlhf" / "stubs"  # the test-only flash_attn stand-in (OpenRLHF imports it at load)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _setup_path():
    import importlib.util

    for path in (str(ROOT), str(STUBS) if importlib.util.find_spec("flash_attn") is None else None):
        if path and path not in sys.path:
            sys.path.insert(0, path)


def _batch(args):
    g = torch.Generator().manual_seed(0)
    seqlen = args.prompt + args.completion
    sequences = torch.randint(0, args.vocab, (args.batch, seqlen), generator=g)
    attention_mask = torch.ones(args.batch, seqlen, dtype=torch.long)
    action_mask = torch.ones(args.batch, args.completion, dtype=torch.bool)
    advantages = torch.randn(args.batch, 1, generator=g)
    return sequences, attention_mask, action_mask, advantages


def _step(actor, forward, batch):
    """The policy step; returns what it leaves behind on purpose (log-probs, the parameters' gradients)."""
    sequences, attention_mask, action_mask, advantages = batch
    logp, output = forward(actor, sequences, action_mask, attention_mask=attention_mask, return_output=True,
                           return_entropy=True)
    entropy = output.entropy[:, -action_mask.shape[1]:]
    mask = action_mask.float()
    loss = -(advantages * logp * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    loss.backward()
    return [logp, *(p.grad for p in actor.parameters() if p.grad is not None)]


def _no_grad_pass(actor, forward, batch):
    """The old / reference log-probs (``PolicyModelActor.forward`` / ``ReferenceModelActor.forward``)."""
    sequences, attention_mask, action_mask, _ = batch
    with torch.no_grad():
        return [forward(actor, sequences, action_mask, attention_mask)]


def _backbone_step(actor, batch):
    from grpo_kernels.integrations.openrlhf import _unwrap

    sequences, attention_mask, _, _ = batch
    lm = _unwrap(actor.model)
    position_ids = attention_mask.long().cumsum(-1) - 1
    hidden = lm.base_model(sequences, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    hidden.float().sum().backward()
    return [p.grad for p in actor.parameters() if p.grad is not None]


def measure(args, dtype_name: str) -> dict:
    """One dtype's three traced variants and the agreement (in this process)."""
    _setup_path()
    import grpo_kernels.openrlhf as gk_openrlhf
    from tests.support.memory_trace import transient_peak
    from tests.support.openrlhf_actors import build_actor
    from tests.support.tolerances import same_maths_slack

    folder = Path(tempfile.mkdtemp(prefix="openrlhf-memory-"))
    actor = build_actor(folder, dtype=DTYPES[dtype_name], vocab_size=args.vocab, hidden_size=args.hidden)
    batch = _batch(args)
    variants = {"stock": lambda: _step(actor, gk_openrlhf.stock_forward, batch),
                "patched": lambda: _step(actor, lambda a, *x, **k: a(*x, **k), batch),
                "backbone": lambda: _backbone_step(actor, batch),
                "stock_no_grad": lambda: _no_grad_pass(actor, gk_openrlhf.stock_forward, batch),
                "patched_no_grad": lambda: _no_grad_pass(actor, lambda a, *x, **k: a(*x, **k), batch)}
    peaks, logps = {}, {}
    for name, fn in variants.items():
        fn()  # warm-up (torch.compile of OpenRLHF's entropy, first-call allocations)
        actor.zero_grad(set_to_none=True)
        kept = []
        peaks[name] = transient_peak(lambda: kept.extend(fn()) or kept)
        if name in ("stock", "patched"):
            logps[name] = kept[0].detach()
        actor.zero_grad(set_to_none=True)
    gap = (logps["patched"] - logps["stock"]).abs()
    return {"dtype": dtype_name, "peak_bytes": peaks,
            "head_and_loss_bytes": {k: peaks[k] - peaks["backbone"] for k in ("stock", "patched")},
            "logp_max_abs_diff": gap.max().item(), "logp_median_abs_diff": gap.median().item(),
            "same_maths_slack": same_maths_slack(torch.float32) * max(1.0, logps["stock"].abs().max().item())}


def _table(args, rows, commit) -> str:
    mib = 2.0 ** 20
    lines = [f"OpenRLHF {args.openrlhf_version} policy step (`benchmarks/openrlhf_memory.py`, {args.date}, commit "
             f"{commit}): B = {args.batch}, prompt {args.prompt} + completion {args.completion} tokens, V = "
             f"{args.vocab}, hidden {args.hidden}, 1 layer, CPU, {torch.get_num_threads()} threads.", "",
             "| dtype | stock peak | patched peak | backbone alone | head and loss: stock | patched | patched / stock "
             "| logp max / median abs diff (slack) | no-grad pass: stock / patched peak |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        p, h = r["peak_bytes"], r["head_and_loss_bytes"]
        lines.append(f"| {r['dtype']} | {p['stock'] / mib:.1f} MiB | {p['patched'] / mib:.1f} MiB | "
                     f"{p['backbone'] / mib:.1f} MiB | {h['stock'] / mib:.1f} MiB | {h['patched'] / mib:.1f} MiB | "
                     f"{h['patched'] / h['stock']:.3f}x | {r['logp_max_abs_diff']:.2e} / "
                     f"{r['logp_median_abs_diff']:.2e} ({r['same_maths_slack']:.1e}) | "
                     f"{p['stock_no_grad'] / mib:.1f} / {p['patched_no_grad'] / mib:.1f} MiB |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one dtype, print JSON
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(args, args.one)))
        return
    rows = []
    for dtype_name in args.dtype:  # each dtype in a fresh process: nothing cached from the other
        given = sys.argv[1:] if argv is None else list(argv)
        cmd = [sys.executable, "-m", "benchmarks.openrlhf_memory", *given, "--one", dtype_name]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode or not lines:
            raise SystemExit(f"{dtype_name}: failed\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len("RESULT "):]))
    from importlib.metadata import version

    args.openrlhf_version, args.date = version("openrlhf"), datetime.date.today().isoformat()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "openrlhf_memory.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "one"},
                                                          "commit": commit, "rows": rows}, indent=1))
    table = _table(args, rows, commit)
    (out / "openrlhf_memory.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
