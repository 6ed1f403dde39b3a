"""Batch invariance (docs/numerics.md, "Batch invariance"): with ``batch_invariant=True`` a sequence's log-probs,
entropies, TRL's extra outputs and the gradients with respect to its own logits / hidden states are bitwise the
same (``torch.equal``, never a tolerance) whatever else is in the call: alone or in batches of 2 to 5 at any
position, across the fixed row blocks' edges (the ``invariant_rows`` knob makes blocks of 16 rows: 15 / 16 / 17 and
31 / 32 / 33 rows), padded with a mask or packed with ``cu_seqlens``, under two memory budgets; both impls (Triton
under the interpreter), fp32, bf16 and fp16. The loss of the same sequences is bitwise the same padded and packed.

Each arrangement is one call of the public function; the pool's sequences have ragged lengths. A checker that
cannot fail proves nothing: ``test_the_comparison_sees_a_batch_dependent_result`` runs it on a function whose result
depends on the batch by one ulp and expects it to be caught."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import grpo_kernels as gk

V, H = 83, 16
LENGTHS = (5, 1, 9, 7, 3, 11, 2, 8)  # the pool's sequences (ragged)
BLOCK = 16                          # rows per fixed block in these tests (the ``invariant_rows`` knob)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclasses.dataclass(frozen=True)
class Pool:
    """Per sequence i: logits (L_i, V), hidden (L_i, H), ids (L_i,) and the upstream gradient coefficients of its
    log-probs / entropies (L_i,), in one dtype; the head's weight (V, H)."""

    logits: tuple
    hidden: tuple
    ids: tuple
    grad_logp: tuple
    grad_entropy: tuple
    weight: torch.Tensor


def _pool(dtype, lengths=LENGTHS, seed=0) -> Pool:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=g) / 2).to(dtype)
    seqs = [(torch.randn(n, V, generator=g) * 3, torch.randn(n, H, generator=g), torch.randint(0, V, (n,), generator=g),
             torch.randn(n, generator=g), torch.randn(n, generator=g)) for n in lengths]
    logits, hidden, ids, a, b = zip(*seqs)
    return Pool(tuple(x.to(dtype) for x in logits), tuple(x.to(dtype) for x in hidden), ids, a, b, weight)


def _arrange(pool: Pool, order, field: str, packed: bool):
    """The sequences ``order`` of the pool laid out as one call's input: padded (B, T, ...) rows with a mask, T one
    more than the longest (a padded position in every row), or packed (N, ...) rows with cu_seqlens."""
    rows = [getattr(pool, field)[i] for i in order]
    if packed:
        cu = torch.tensor([0] + list(itertools.accumulate(r.shape[0] for r in rows)))
        return torch.cat(rows), cu
    T = max(r.shape[0] for r in rows) + 1
    out = torch.zeros((len(rows), T, *rows[0].shape[1:]), dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out, None


def _per_sequence(t, order, pool: Pool, packed: bool):
    """A call's per-token result split back into its sequences (dict: pool index -> the sequence's rows)."""
    lengths = [pool.ids[i].shape[0] for i in order]
    if packed:
        return dict(zip(order, torch.split(t, lengths)))
    return {i: t[b, :n] for b, (i, n) in enumerate(zip(order, lengths))}


def token_logprobs_call(pool: Pool, order, packed: bool, impl: str, budget=None):
    """token_logprobs on the arranged logits; the backward of sum(a logp + b entropy) with each sequence's own
    coefficients (0 at padding). Returns per sequence (logp, entropy, d logits)."""
    logits, _ = _arrange(pool, order, "logits", packed)
    ids, _ = _arrange(pool, order, "ids", packed)
    a, _ = _arrange(pool, order, "grad_logp", packed)
    b, _ = _arrange(pool, order, "grad_entropy", packed)
    x = logits.clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, temperature=0.8, return_entropy=True, impl=impl, batch_invariant=True,
                                  memory_budget=budget)
    (a * logp + b * ent).sum().backward()
    return [_per_sequence(t, order, pool, packed) for t in (logp.detach(), ent.detach(), x.grad)]


# Arrangements of the pool's sequences: alone, in batches of 2 to 5 at every position, and row counts at the
# fixed blocks' edges (the pool's lengths sum to 15 / 16 / 17 and 31 / 32 / 33 rows in the orders below)
ARRANGEMENTS = [(0,), (1,), (0, 1), (1, 0), (2, 0, 3), (3, 2, 0, 1), (4, 3, 2, 1, 0), (0, 2, 1), (5, 0), (0, 5),
                (2, 3, 1), (5, 6, 7, 3, 4), (2, 3, 5, 0), (2, 3, 5, 0, 1), (6, 5, 7, 2, 4, 1, 0)]


# Under the Triton interpreter (a program per row, ~20 ms each) the fast suite runs the orders that cross the first
# block's edge, alone and at other positions; the whole list runs under -m slow
FEW = [(0,), (2, 0, 3), (0, 2, 1), (5, 0), (0, 5), (2, 3, 1)]


def _edges_are_covered(orders, edges=(15, 16, 17, 31, 32, 33)):
    totals = {sum(LENGTHS[i] for i in order) for order in orders}
    return set(edges) <= totals


def arrangements(impl: str, full: bool):
    """The orders a test runs: all of them, or under the interpreter in the fast suite the first block's edges."""
    orders = ARRANGEMENTS if impl == "torch" or full else FEW
    assert _edges_are_covered(orders, (15, 16, 17) if orders is FEW else (15, 16, 17, 31, 32, 33))
    return orders


def assert_invariant(results: list, what: str):
    """Every sequence's values bitwise equal across the calls it appears in (results: per call, (its label, a
    list over outputs of {pool index: values}))."""
    first = {}
    for label, outputs in results:
        for k, per_seq in enumerate(outputs):
            for i, values in per_seq.items():
                if (k, i) not in first:
                    first[(k, i)] = (label, values)
                    continue
                label0, v0 = first[(k, i)]
                assert torch.equal(values, v0), (
                    f"{what}: output {k} of sequence {i} differs between arrangements {label0} and {label} by "
                    f"{(values.double() - v0.double()).abs().max().item():.3e}")


def _label(order, packed, budget=None):
    return f"{order} {'packed' if packed else 'padded'}" + ("" if budget is None else f" budget {budget}")


@pytest.fixture
def blocks(knobs):
    knobs(invariant_rows=BLOCK, max_block_v=32)  # small blocks: the pool's batches cross block and vocab edges


IMPL_CASES = [pytest.param("torch", False, id="torch"), pytest.param("triton", False, id="triton"),
              pytest.param("triton", True, id="triton-every-order", marks=pytest.mark.slow)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("impl, full", IMPL_CASES)
def test_token_logprobs_are_batch_invariant(impl, full, dtype, blocks):
    pool = _pool(dtype)
    results = [(_label(order, packed, budget), token_logprobs_call(pool, order, packed, impl, budget))
               for order in arrangements(impl, full) for packed in (False, True)
               for budget in ((None, 1 << 20) if len(order) == 3 else (None,))]
    assert_invariant(results, f"token_logprobs ({impl}, {dtype})")


def test_the_comparison_sees_a_batch_dependent_result():
    """The checker can fail: a log-prob that moves by one ulp with the batch size is reported."""
    pool = _pool(torch.float32)

    def batch_dependent(order):
        logp = torch.stack([pool.logits[i][0, 0] for i in order])
        return [{i: logp[k:k + 1] + len(order) * torch.finfo(torch.float32).eps * logp[k:k + 1].abs()
                 for k, i in enumerate(order)}]

    with pytest.raises(AssertionError, match="differs between arrangements"):
        assert_invariant([(_label(order, False), batch_dependent(order)) for order in ARRANGEMENTS],
                         "batch-dependent")
