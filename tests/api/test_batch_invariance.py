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


def token_logprobs_call(pool: Pool, order, packed: bool, impl: str, budget=None, block=None):
    """token_logprobs on the arranged logits; the backward of sum(a logp + b entropy) with each sequence's own
    coefficients (0 at padding). Returns per sequence (logp, entropy, d logits). ``block``: invariant_block_rows."""
    logits, _ = _arrange(pool, order, "logits", packed)
    ids, _ = _arrange(pool, order, "ids", packed)
    a, _ = _arrange(pool, order, "grad_logp", packed)
    b, _ = _arrange(pool, order, "grad_entropy", packed)
    x = logits.clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, temperature=0.8, return_entropy=True, impl=impl, batch_invariant=True,
                                  memory_budget=budget, invariant_block_rows=block)
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


def impl_dtypes(impls=("torch", "triton")):
    """(impl, dtype) cases: every dtype on the PyTorch path and fp32 under the interpreter in the fast suite; the
    interpreter's bf16 / fp16 cases (the same kernels, ~15 s each) run under -m slow (CI's second step)."""
    out = []
    for impl in impls:
        for dtype, name in zip(DTYPES, ("fp32", "bf16", "fp16")):
            marks = [pytest.mark.slow] if impl == "triton" and dtype != torch.float32 else []
            out.append(pytest.param(impl, dtype, id=f"{impl}-{name}", marks=marks))
    return out


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


def _hidden_grid(pool: Pool, order, packed: bool):
    hidden, cu = _arrange(pool, order, "hidden", packed)
    ids, _ = _arrange(pool, order, "ids", packed)
    return hidden, ids, cu


def linear_token_logprobs_call(pool: Pool, order, packed: bool, impl: str, budget=None, extras=(), block=None):
    """linear_token_logprobs on the arranged hidden states (padded: with the mask, so the valid rows are compacted;
    packed: all rows), backward of sum(a logp + b entropy). Returns per sequence (logp, entropy, d hidden, extras)."""
    hidden, ids, _ = _hidden_grid(pool, order, packed)
    a, _ = _arrange(pool, order, "grad_logp", packed)
    b, _ = _arrange(pool, order, "grad_entropy", packed)
    mask = None if packed else _arrange(pool, order, "ids", False)[0].new_zeros(ids.shape, dtype=torch.bool)
    if mask is not None:
        for row, i in enumerate(order):
            mask[row, : pool.ids[i].shape[0]] = True
    x = hidden.clone().requires_grad_(True)
    out = gk.linear_token_logprobs(x, pool.weight, ids, temperature=0.8, return_entropy=True, impl=impl, mask=mask,
                                   memory_budget=budget, extra_outputs=extras, batch_invariant=True,
                                   invariant_block_rows=block)
    logp, ent = (out.logp, out.entropy) if extras else out
    (a * logp + b * ent).sum().backward()
    values = [logp.detach(), ent.detach(), x.grad]
    if extras:
        values += [getattr(out, name) for name in extras]
    return [_per_sequence(t, order, pool, packed) for t in values]


HEAD_ARRANGEMENTS = {"torch": ARRANGEMENTS, "triton": FEW}


@pytest.mark.parametrize("impl, dtype", impl_dtypes())
def test_linear_token_logprobs_and_trl_extras_are_batch_invariant(impl, dtype, blocks):
    """The fused head with gradients (head.torch / head.light) and without (head.torch / head.no_grad), with TRL's
    extra outputs, masked padded rows compacted or packed rows, two budgets."""
    pool = _pool(dtype)
    extras = ("log_sum_sq_probs", "mean_logits", "is_top1")
    results = [(_label(order, packed, budget), linear_token_logprobs_call(pool, order, packed, impl, budget, extras))
               for order in HEAD_ARRANGEMENTS[impl] for packed in (False, True)
               for budget in ((None, 8 << 20) if len(order) == 3 else (None,))]
    assert_invariant(results, f"linear_token_logprobs ({impl}, {dtype})")
    no_grad = []
    for order in HEAD_ARRANGEMENTS[impl][:4]:
        hidden, ids, _ = _hidden_grid(pool, order, True)
        with torch.no_grad():
            logp = gk.linear_token_logprobs(hidden, pool.weight, ids, temperature=0.8, impl=impl, batch_invariant=True)
        no_grad.append((_label(order, True), [_per_sequence(logp, order, pool, True)]))
    assert_invariant(no_grad, f"linear_token_logprobs without gradients ({impl}, {dtype})")


LOSS_CONFIGS = {
    # token-level, normalized by a given count: each token's gradient depends on the token alone (head.fast)
    "dapo-num-items": dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=True),
    # a sequence-level ratio: each token's gradient reads its sequence (the tree sums; head.light)
    "gspo": dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04),
}


def loss_call(pool: Pool, order, packed: bool, impl: str, fn: str, cfg: dict):
    """The loss on the arranged rows (``fn``: "fused_linear_grpo_loss" or "grpo_loss"); returns (the loss and its
    metrics, per sequence (d hidden or d logits,))."""
    field = "hidden" if fn == "fused_linear_grpo_loss" else "logits"
    x, cu = _arrange(pool, order, field, packed)
    ids, _ = _arrange(pool, order, "ids", packed)
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(len(LENGTHS), generator=g)[list(order)]
    old = [torch.randn(pool.ids[i].shape[0], generator=torch.Generator().manual_seed(10 + i)) * 0.2 - 3.0
           for i in range(len(LENGTHS))]
    old_grid, _ = _arrange(dataclasses.replace(pool, grad_logp=tuple(old)), order, "grad_logp", packed)
    mask = None
    if not packed:
        mask = torch.zeros(ids.shape)
        for row, i in enumerate(order):
            mask[row, : pool.ids[i].shape[0]] = 1.0
    x = x.clone().requires_grad_(True)
    args = (x, pool.weight) if fn == "fused_linear_grpo_loss" else (x,)
    loss, metrics = getattr(gk, fn)(*args, ids, adv, mask, old_logps=old_grid, ref_logps=old_grid + 0.1,
                                    num_items_in_batch=40, impl=impl, cu_seqlens=cu, batch_invariant=True,
                                    temperature=0.8, **cfg)
    loss.backward()
    return (loss.detach(), {k: v for k, v in metrics.items()}), [_per_sequence(x.grad, order, pool, packed)]


# (impl, function, config) -> the path the planner takes: every family of paths is covered
LOSS_PATHS = {("torch", "fused_linear_grpo_loss"): {"dapo-num-items": "head.torch", "gspo": "head.torch"},
              ("torch", "grpo_loss"): {"dapo-num-items": "logits.torch", "gspo": "logits.torch"},
              ("triton", "fused_linear_grpo_loss"): {"dapo-num-items": "head.fast", "gspo": "head.light"},
              ("triton", "grpo_loss"): {"dapo-num-items": "logits.fast", "gspo": "logits.sweep"}}


@pytest.mark.parametrize("config", list(LOSS_CONFIGS))
@pytest.mark.parametrize("fn", ["fused_linear_grpo_loss", "grpo_loss"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_losses_are_batch_invariant_and_the_same_padded_or_packed(impl, fn, config, blocks, knobs, plans):
    """Each sequence's gradient bitwise the same in every arrangement (its reduction weight is the same: a given
    num_items_in_batch), and the loss and every metric bitwise the same for the same sequences padded or packed."""
    knobs(fast_path_min_rows=1)  # the gradient-in-forward paths at these sizes
    pool = _pool(torch.float32)
    results, totals = [], {}
    for order in HEAD_ARRANGEMENTS[impl]:
        for packed in (False, True):
            total, grads = loss_call(pool, order, packed, impl, fn, LOSS_CONFIGS[config])
            results.append((_label(order, packed), grads))
            totals.setdefault(order, []).append(total)
    assert {p.path for p in plans} == {LOSS_PATHS[(impl, fn)][config]} and all(p.batch_invariant for p in plans)
    assert_invariant(results, f"{fn} ({impl}, {config})")
    for order, ((loss_p, metrics_p), (loss_k, metrics_k)) in totals.items():
        assert torch.equal(loss_p, loss_k), f"{order}: padded {loss_p.item()!r} != packed {loss_k.item()!r}"
        for key in metrics_p:
            assert torch.equal(metrics_p[key], metrics_k[key]), f"{order}: metric {key}"


def _old_logps_without_gradients(pool: Pool, fn: str, impl: str, order, block=None) -> dict:
    """Per sequence, the log-probs the no-gradient call gives in the packed arrangement ``order`` (the old /
    reference log-probs a trainer computes at generation time, in other batches than the loss's)."""
    x, _ = _arrange(pool, order, "hidden" if fn == "fused_linear_grpo_loss" else "logits", True)
    ids, _ = _arrange(pool, order, "ids", True)
    with torch.no_grad():
        if fn == "fused_linear_grpo_loss":
            logp = gk.linear_token_logprobs(x, pool.weight, ids, temperature=0.8, impl=impl, batch_invariant=True,
                                            invariant_block_rows=block)
        else:
            logp = gk.token_logprobs(x, ids, temperature=0.8, impl=impl, batch_invariant=True,
                                     invariant_block_rows=block)
    return _per_sequence(logp, order, pool, True)


def _loss_at(pool: Pool, fn: str, impl: str, order, cfg: dict, old: dict | None, nudge: bool = False,
             block=None):
    """(loss, d input) of ``fn`` on the packed sequences ``order`` with old_logps from ``old`` (None: the loss's own
    log-probs, detached, so its ratio is exactly 1); ``nudge`` moves every old log-prob by one ulp."""
    x, cu = _arrange(pool, order, "hidden" if fn == "fused_linear_grpo_loss" else "logits", True)
    ids, _ = _arrange(pool, order, "ids", True)
    old_t = None if old is None else torch.cat([old[i] for i in order])
    if nudge:
        old_t = torch.nextafter(old_t, torch.full_like(old_t, -torch.inf))
    x = x.clone().requires_grad_(True)
    args = (x, pool.weight) if fn == "fused_linear_grpo_loss" else (x,)
    adv = torch.linspace(-1.5, 2.0, len(LENGTHS))[list(order)]
    loss, _ = getattr(gk, fn)(*args, ids, adv, old_logps=old_t, cu_seqlens=cu, impl=impl, batch_invariant=True,
                              temperature=0.8, invariant_block_rows=block,
                              **{**cfg, "beta": 0.0})  # no reference: the ratio alone
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("config", list(LOSS_CONFIGS))
@pytest.mark.parametrize("fn", ["fused_linear_grpo_loss", "grpo_loss"])
@pytest.mark.parametrize("impl, dtype", impl_dtypes())
def test_old_logps_without_gradients_give_a_ratio_of_exactly_one(impl, fn, config, dtype, blocks, knobs):
    """The old log-probs of a no-gradient call (another batch) equal the loss's own log-probs bitwise, on every path
    (head.no_grad = head.fast = head.light's forward; logits.sweep = the logits loss paths): the loss and its
    gradient are bitwise those of the ratio-exactly-1 call (old_logps=None). The comparison can fail: old
    log-probs one ulp off change the loss."""
    knobs(fast_path_min_rows=1)
    pool = _pool(dtype)
    old = _old_logps_without_gradients(pool, fn, impl, (6, 5, 7, 2, 4, 1, 0, 3))
    for order in ((2, 0, 3), (5, 0)):
        exact = _loss_at(pool, fn, impl, order, LOSS_CONFIGS[config], None)
        ours = _loss_at(pool, fn, impl, order, LOSS_CONFIGS[config], old)
        assert torch.equal(ours[0], exact[0]), f"{order}: loss {ours[0].item()!r} != {exact[0].item()!r} (ratio != 1)"
        assert torch.equal(ours[1], exact[1]), f"{order}: the gradient differs from the ratio-1 call's"
        nudged = _loss_at(pool, fn, impl, order, LOSS_CONFIGS[config], old, nudge=True)
        assert not torch.equal(nudged[0], exact[0]), "a one-ulp change of the old log-probs went unseen"


# A block the caller chooses (``invariant_block_rows``, no knob): single sequences of 7 / 8 / 9 rows and batches of
# 15 / 16 / 17 rows cross its edges, each sequence at several positions
CHOSEN_BLOCK = 8
CHOSEN_ORDERS = [(3,), (7,), (2,), (0, 2, 1), (5, 0), (2, 3, 1), (7, 3), (3, 7, 1)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_chosen_block_is_batch_invariant_at_its_size(impl, plans):
    """invariant_block_rows=8: every sequence's log-probs, entropy and gradient bitwise the same in every arrangement
    (padded or packed) with that block, on the head (head.torch / head.light and head.no_grad under the
    interpreter) and the logits (logits.torch; the Triton logits paths have no row blocks); every plan has 8-row
    blocks (the option reaches the planner, not the device's 256)."""
    pool = _pool(torch.float32)
    orders = CHOSEN_ORDERS if impl == "torch" else CHOSEN_ORDERS[:5]
    head = [(_label(order, packed), linear_token_logprobs_call(pool, order, packed, impl, block=CHOSEN_BLOCK))
            for order in orders for packed in (False, True)]
    assert_invariant(head, f"linear_token_logprobs ({impl}, invariant_block_rows={CHOSEN_BLOCK})")
    if impl == "torch":
        logits = [(_label(order, packed), token_logprobs_call(pool, order, packed, impl, block=CHOSEN_BLOCK))
                  for order in orders for packed in (False, True)]
        assert_invariant(logits, f"token_logprobs ({impl}, invariant_block_rows={CHOSEN_BLOCK})")
    assert plans and all(p.batch_invariant and p.chunk_rows == CHOSEN_BLOCK for p in plans), \
        {(p.path, p.chunk_rows) for p in plans}


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_chosen_block_gives_a_ratio_of_exactly_one(impl, knobs):
    """Old log-probs of a no-gradient call in another batch with the same chosen block: the loss and its gradient
    are bitwise the ratio-1 call's (head.torch; head.no_grad against head.fast under the interpreter)."""
    knobs(fast_path_min_rows=1)
    pool = _pool(torch.float32)
    fn, cfg = "fused_linear_grpo_loss", LOSS_CONFIGS["dapo-num-items"]
    old = _old_logps_without_gradients(pool, fn, impl, (6, 5, 7, 2, 4, 1, 0, 3), block=CHOSEN_BLOCK)
    for order in ((2, 0, 3), (5, 0)):
        exact = _loss_at(pool, fn, impl, order, cfg, None, block=CHOSEN_BLOCK)
        ours = _loss_at(pool, fn, impl, order, cfg, old, block=CHOSEN_BLOCK)
        assert torch.equal(ours[0], exact[0]), f"{order}: loss {ours[0].item()!r} != {exact[0].item()!r} (ratio != 1)"
        assert torch.equal(ours[1], exact[1]), f"{order}: the gradient differs from the ratio-1 call's"
