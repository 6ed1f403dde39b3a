"""The cost of ``batch_invariant=True`` against the default call, interleaved in one process (docs/benchmarks.md,
"Batch invariance: cost"): the quick grid's CPU shapes (B=8, T=64, H=64, V=8000, fp32; "padded": a third of the
tokens masked), the head's loss forward + backward, the logits loss forward + backward, the no-grad log-probs of
both. Each round times the default and the invariant call back to back (order alternating), so that a shared
machine's drift hits both; prints the median of each and their ratio.

    .venv/bin/python -m benchmarks.invariance_cost [--rounds 21]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import grpo_kernels as gk

B, T, H, V = 8, 64, 64, 8000


def _cases(padded: bool):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.1).requires_grad_(True)
    logits = torch.randn(B, T, V, generator=g).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    if padded:
        mask[:, T - T // 3:] = False
    adv, old = torch.randn(B, generator=g), torch.randn(B, T, generator=g) * 0.1 - 9.0
    kw = dict(old_logps=old, ref_logps=old + 0.05, beta=0.04, loss_type="dapo")

    def head_loss(**o):
        loss, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask, **kw, **o)
        loss.backward()

    def logits_loss(**o):
        loss, _ = gk.grpo_loss(logits, ids, adv, mask, **kw, **o)
        loss.backward()

    def head_nograd(**o):
        with torch.no_grad():
            gk.linear_token_logprobs(hidden, weight, ids, mask=mask, **o)

    def logits_nograd(**o):
        with torch.no_grad():
            gk.token_logprobs(logits, ids, return_entropy=True, **o)

    tag = "padded" if padded else "valid"
    return [(f"head loss fwd+bwd ({tag})", head_loss), (f"logits loss fwd+bwd ({tag})", logits_loss),
            (f"head log-probs, no grad ({tag})", head_nograd), (f"logits log-probs, no grad ({tag})", logits_nograd)]


def _time(fn, **o) -> float:
    t0 = time.perf_counter()
    fn(**o)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} interleaved rounds")
    print("| case | default ms | batch_invariant ms | ratio |\n|---|---:|---:|---:|")
    for padded in (False, True):
        for name, fn in _cases(padded):
            fn(), fn(batch_invariant=True)  # warm-up
            base, inv = [], []
            for r in range(args.rounds):
                pair = [(base, {}), (inv, {"batch_invariant": True})]
                for out, o in (pair if r % 2 == 0 else pair[::-1]):
                    out.append(_time(fn, **o))
            b, i = statistics.median(base), statistics.median(inv)
            print(f"| {name} | {b * 1e3:.1f} | {i * 1e3:.1f} | {i / b:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
