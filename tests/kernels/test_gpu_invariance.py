"""Batch invariance on the compiled Triton kernels of a CUDA GPU, at the GPU's own block size (512 rows) and a
large vocabulary (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs it with the test suite).

On CPU tests/api/test_batch_invariance.py checks the same guarantee under the interpreter with 16-row blocks; here
the compiled kernels and cuBLAS run: a probe sequence's log-probs, entropy and d hidden alone and inside batches
whose row counts straddle the blocks' edges (511 / 512 / 513 rows and more), at other positions, bf16 and fp32;
and the no-gradient log-probs against the loss's own (a ratio of exactly 1), token-level and sequence-level.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import grpo_kernels as gk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; runs in benchmarks/gpu_check.sh")]
DEV = "cuda"
H, V = 512, 32000
PROBE = 37                      # rows of the probe sequence
FILLERS = (0, 474, 475, 476, 1100)  # rows around it: totals 37, 511, 512, 513, 1137


def _inputs(dtype, rows: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(rows, H, device=DEV, generator=g).to(dtype),
            torch.randint(0, V, (rows,), device=DEV, generator=g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_sequence_is_the_same_in_every_batch_on_the_gpu(dtype):
    weight = (torch.randn(V, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)) / 20).to(dtype)
    probe_h, probe_ids = _inputs(dtype, PROBE, 2)
    first = None
    for filler, before in itertools.product(FILLERS, (True, False)):
        fill_h, fill_ids = _inputs(dtype, filler, 3 + filler)
        parts = [(fill_h, fill_ids), (probe_h, probe_ids)] if before else [(probe_h, probe_ids), (fill_h, fill_ids)]
        x = torch.cat([p[0] for p in parts]).requires_grad_(True)
        ids = torch.cat([p[1] for p in parts])
        logp, ent = gk.linear_token_logprobs(x, weight, ids, return_entropy=True, batch_invariant=True)
        (logp * 0.5 + ent * 0.25).sum().backward()
        at = slice(filler, filler + PROBE) if before else slice(0, PROBE)
        got = (logp.detach()[at], ent.detach()[at], x.grad[at])
        if first is None:
            first = got
            continue
        for name, a, b in zip(("logp", "entropy", "d hidden"), got, first):
            assert torch.equal(a, b), f"{name}: {filler} other rows ({'before' if before else 'after'})"


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_no_gradient_logps_give_a_ratio_of_exactly_one_on_the_gpu(dtype, level):
    weight = (torch.randn(V, H, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)) / 20).to(dtype)
    hidden, ids = _inputs(dtype, 700, 4)
    with torch.no_grad():  # the old log-probs, computed on a differently composed batch (reversed rows)
        old = gk.linear_token_logprobs(hidden.flip(0), weight, ids.flip(0), batch_invariant=True).flip(0)
    cu = torch.tensor([0, 300, 513, 700], device=DEV)
    adv = torch.tensor([1.0, -0.5, 2.0], device=DEV)
    losses = []
    for o in (old, None):
        loss, _ = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, old_logps=o, cu_seqlens=cu,
                                            importance_sampling_level=level, batch_invariant=True)
        losses.append(loss)
    assert torch.equal(losses[0], losses[1]), f"loss with old log-probs {losses[0].item()!r} != {losses[1].item()!r}"
