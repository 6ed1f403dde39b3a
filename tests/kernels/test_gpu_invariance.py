"""Batch invariance on the compiled Triton kernels of a CUDA GPU, at the GPU's own block size (512 rows) and a
large vocabulary (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs it with the test suite).

On CPU tests/api/test_batch_invariance.py checks the same guarantee under the interpreter with 16-row blocks; here
the compiled kernels and cuBLAS run: a probe sequence's log-probs, entropy and d hidden alone and inside batches
whose row counts straddle the blocks' edges (511 / 512 / 513 rows and more), at other positions, bf16 and fp32;
and the no-gradient log-probs against the loss's own (a ratio of exactly 1), token-level and sequence-level.

What only a GPU can show, by name (docs/numerics.md, "Batch invariance"):
- ``test_a_sequence_is_the_same_in_every_batch_on_the_gpu``: cuBLAS choosing its GEMM algorithm (tiles, split-K)
  by the row count, and the compiled head kernels, at the 512-row blocks; the CPU sees only its BLAS's one- to
  three-row kernels and the interpreter's vocabulary splits.
- ``test_no_gradient_logps_give_a_ratio_of_exactly_one_on_the_gpu``: head.no_grad against head.fast / head.light,
  different kernels on a GPU (the trainer's first iteration rests on it: on the CPU the trainer's no-gradient call
  and its loss run the same head.torch tiles, tests/train/test_batch_invariant_training.py).
- ``test_the_logits_paths_are_batch_invariant_by_construction_on_the_gpu``: the compiled logits kernels (one program
  per row, rows in flight sized by N and L2) with the option off as on, the claim the CPU checks under the
  interpreter.
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


def _logits(dtype, rows: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return ((torch.randn(rows, V, device=DEV, generator=g) * 3).to(dtype),
            torch.randint(0, V, (rows,), device=DEV, generator=g))


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["option-off", "option"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_logits_paths_are_batch_invariant_by_construction_on_the_gpu(dtype, batch_invariant):
    """logits.sweep (token_logprobs) and logits.fast (a token-level grpo_loss with a given num_items_in_batch)
    compute each row in one program, with a block width chosen by V alone: a probe's log-probs, entropy and d logits
    are the same in every batch, with the option off as with it on. The CPU's check of the same claim under the
    interpreter: tests/api/test_batch_invariance.py::test_token_logprobs_are_batch_invariant_with_or_without_the_option
    and the by-construction case of test_losses_are_batch_invariant_and_the_same_padded_or_packed."""
    probe, probe_ids = _logits(dtype, PROBE, 2)
    first = None
    for filler, before in itertools.product(FILLERS, (True, False)):
        fill, fill_ids = _logits(dtype, filler, 3 + filler)
        parts = [(fill, fill_ids), (probe, probe_ids)] if before else [(probe, probe_ids), (fill, fill_ids)]
        parts = [p for p in parts if p[0].shape[0]]
        ids = torch.cat([p[1] for p in parts])
        x = torch.cat([p[0] for p in parts]).requires_grad_(True)
        logp, ent = gk.token_logprobs(x, ids, return_entropy=True, batch_invariant=batch_invariant)
        (logp * 0.5 + ent * 0.25).sum().backward()
        y = x.detach().clone().requires_grad_(True)
        cu = torch.tensor([0, *itertools.accumulate(p[0].shape[0] for p in parts)], device=DEV)
        adv = torch.tensor([1.0 if p[0] is probe else -0.5 for p in parts], device=DEV)
        loss, _ = gk.grpo_loss(y, ids, adv, cu_seqlens=cu, num_items_in_batch=100, loss_type="dapo",
                               batch_invariant=batch_invariant)
        loss.backward()
        at = slice(filler, filler + PROBE) if before else slice(0, PROBE)
        got = (logp.detach()[at], ent.detach()[at], x.grad[at], y.grad[at])
        if first is None:
            first = got
            continue
        for name, a, b in zip(("logp", "entropy", "d logits", "loss d logits"), got, first):
            assert torch.equal(a, b), f"{name}: {filler} other rows ({'before' if before else 'after'})"
