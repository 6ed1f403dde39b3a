"""Batch invariance (docs/numerics.md, "Batch invariance"): with ``batch_invariant=True`` a sequence's log-probs,
entropies, TRL's extra outputs and the gradients with respect to its own logits / hidden states are bitwise the
same (``torch.equal``, never a tolerance) whatever else is in the call: alone or in batches of 2 to 5 at any
position, across the fixed row blocks' edges (the ``invariant_rows`` knob makes blocks of 16 rows: 15 / 16 / 17 and
31 / 32 / 33 rows), padded with a mask or packed with ``cu_seqlens``, under two memory budgets; both impls (Triton
under the interpreter), fp32, bf16 and fp16. The loss of the same sequences is bitwise the same padded and packed.

Each arrangement is one call of the public function; the pool's sequences have ragged lengths. A checker that
cannot fail proves nothing: ``test_the_comparison_sees_a_batch_dependent_result`` runs it on a function whose result
depends on the batch by one ulp and expects it to be caught; and every test here that credits the option fails
without it (tests/api/test_invariance_forced_off.py runs them with ``GRPO_KERNELS_TEST_FORCE_VARIANT=1``, which
makes every call ignore ``batch_invariant``). What the default paths already give by construction (the per-row
logits sweeps) is said where it is tested, and checked with the option off as well as on.

Where the batch enters on the CPU (what the forced-off run rests on: its two probed dependences): the CPU BLAS
computes a GEMM of one to three rows with other kernels than a GEMM of more, so the heads' GEMMs follow the batch
where a sequence of 1 to 3 tokens (the pool's sequences 1, 6 and 4), or a single token, is computed alone and in a
batch: every head test crediting the option runs such an arrangement (MKL on AVX-512 gives a row the same bits at
any place among more than three rows, so longer sequences alone cannot tell the option off from on there); torch
splits a one-row reduction of at least 32768 elements across its threads (the logits path's token alone). Beside the
machine, the default loss sums follow the layout (padded and packed are other sums). Other ways in (a row's place
among more rows on another BLAS, the Triton head's vocabulary splits following N) no test here needs. What only a
GPU shows (cuBLAS choosing its algorithm by the row count, the compiled kernels at 512-row blocks) is
tests/kernels/test_gpu_invariance.py."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.explain import plan_call
from grpo_kernels.sequences import token_sums

from ..support.invariance_checks import assert_invariant, lay_out, split_back

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


# The hidden features' scales, 2^-3 .. 2^3, as a model's hidden states have outlier features. Why a spread: a product
# of two bf16 values is exact in fp32, and sums of 16 such products of one scale rarely round, so without it a GEMM
# of bf16 inputs gives the same bits in any order and no batch dependence of the head could be seen in bf16
FEATURE_SCALE = 2.0 ** torch.linspace(-3, 3, H)


def _pool(dtype, lengths=LENGTHS, seed=0) -> Pool:
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=g) / 2).to(dtype)
    seqs = [(torch.randn(n, V, generator=g) * 3, torch.randn(n, H, generator=g) * FEATURE_SCALE,
             torch.randint(0, V, (n,), generator=g),
             torch.randn(n, generator=g), torch.randn(n, generator=g)) for n in lengths]
    logits, hidden, ids, a, b = zip(*seqs)
    return Pool(tuple(x.to(dtype) for x in logits), tuple(x.to(dtype) for x in hidden), ids, a, b, weight)


def _arrange(pool: Pool, order, field: str, packed: bool):
    """The sequences ``order`` of the pool as one call's input: padded (B, T, ...) rows (their mask is the call's
    own), or packed (N, ...) rows with cu_seqlens (``lay_out``)."""
    data, cu, _ = lay_out([getattr(pool, field)[i] for i in order], packed)
    return data, cu


def _per_sequence(t, order, pool: Pool, packed: bool):
    """A call's per-token result split back into its sequences (dict: pool index -> the sequence's rows)."""
    return split_back(t, order, [pool.ids[i].shape[0] for i in order], packed)


def token_logprobs_call(pool: Pool, order, packed: bool, impl: str, budget=None, batch_invariant=True, block=None):
    """token_logprobs on the arranged logits; the backward of sum(a logp + b entropy) with each sequence's own
    coefficients (0 at padding). Returns per sequence (logp, entropy, d logits). ``block``: invariant_block_rows."""
    logits, _ = _arrange(pool, order, "logits", packed)
    ids, _ = _arrange(pool, order, "ids", packed)
    a, _ = _arrange(pool, order, "grad_logp", packed)
    b, _ = _arrange(pool, order, "grad_entropy", packed)
    x = logits.clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, temperature=0.8, return_entropy=True, impl=impl,
                                  batch_invariant=batch_invariant, memory_budget=budget, invariant_block_rows=block)
    (a * logp + b * ent).sum().backward()
    return [_per_sequence(t, order, pool, packed) for t in (logp.detach(), ent.detach(), x.grad)]


# Arrangements of the pool's sequences: alone, in batches of 2 to 5 at every position, and row counts at the
# fixed blocks' edges (the pool's lengths sum to 15 / 16 / 17 and 31 / 32 / 33 rows in the orders below)
ARRANGEMENTS = [(0,), (1,), (0, 1), (1, 0), (2, 0, 3), (3, 2, 0, 1), (4, 3, 2, 1, 0), (0, 2, 1), (5, 0), (0, 5),
                (2, 3, 1), (5, 6, 7, 3, 4), (2, 3, 5, 0), (2, 3, 5, 0, 1), (6, 5, 7, 2, 4, 1, 0)]


# Under the Triton interpreter (a program per row, ~20 ms each) the fast suite runs the orders that cross the first
# block's edge, alone and at other positions, and the one-token sequence alone (a one-row GEMM: the CPU BLAS's other
# kernel, where the Triton heads' torch GEMMs follow the batch without the option); the whole list runs under -m slow
FEW = [(0,), (2, 0, 3), (0, 2, 1), (5, 0), (0, 5), (2, 3, 1), (1,)]


def _edges_are_covered(orders, edges=(15, 16, 17, 31, 32, 33)):
    totals = {sum(LENGTHS[i] for i in order) for order in orders}
    return set(edges) <= totals


def arrangements(impl: str, full: bool):
    """The orders a test runs: all of them, or under the interpreter in the fast suite the first block's edges."""
    orders = ARRANGEMENTS if impl == "torch" or full else FEW
    assert _edges_are_covered(orders, (15, 16, 17) if orders is FEW else (15, 16, 17, 31, 32, 33))
    return orders



def _label(order, packed, budget=None, batch_invariant=True):
    return (f"{order} {'packed' if packed else 'padded'}" + ("" if budget is None else f" budget {budget}")
            + ("" if batch_invariant else " option off"))


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


def logits_cases():
    """(impl, every order, dtype) cases of the logits sweep: every dtype on the PyTorch path and fp32 under the
    interpreter in the fast suite; the interpreter's bf16 / fp16 and every-order cases under -m slow."""
    out = []
    for impl, full in (("torch", False), ("triton", False), ("triton", True)):
        for dtype, name in zip(DTYPES, ("fp32", "bf16", "fp16")):
            slow = impl == "triton" and (full or dtype != torch.float32)
            out.append(pytest.param(impl, full, dtype, id=f"{impl}{'-every-order' if full else ''}-{name}",
                                    marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("impl, full, dtype", logits_cases())
def test_token_logprobs_are_batch_invariant_with_or_without_the_option(impl, full, dtype, blocks):
    """By construction, not by the option: both logits paths reduce each row alone (logits.sweep: one program per
    row, its block width chosen by V alone; logits.torch: per-row torch reductions over chunks of rows), so the
    default path (``batch_invariant=False``) is batch-invariant already, and the option's numbers are the
    default's. Every arrangement with the option off; with it on, every arrangement on the PyTorch path and one
    under the interpreter; all compared with one another. The one shape where the option changes the PyTorch
    path's numbers (a one-row chunk of at least 32768 logits): ``test_a_token_alone_...`` below."""
    pool = _pool(dtype)
    orders = arrangements(impl, full)
    runs = [(False, order) for order in orders] + [(True, order) for order in (orders if impl == "torch" else
                                                                               orders[1:2])]
    results = [(_label(order, packed, budget, on), token_logprobs_call(pool, order, packed, impl, budget, on))
               for on, order in runs for packed in (False, True)
               for budget in ((None, 1 << 20) if len(order) == 3 else (None,))]
    assert_invariant(results, f"token_logprobs ({impl}, {dtype})")


# At least torch's parallel grain (32768 elements): a one-row reduction over this many logits is split across the
# threads (torch's two-pass reduction of a single output) where the rows of a many-row chunk go one to a thread
ONE_ROW_V = 40_000


@pytest.fixture
def two_threads():
    """Two intra-op threads for the test (the one-row reduction splits only with more than one), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_token_alone_is_the_same_as_in_a_batch_on_the_torch_logits_path(blocks, two_threads):
    """Where the option matters on logits.torch: the default path's chunk of a one-token call is one row, whose
    sums over V = 40000 logits torch splits across its threads, while a chunk of several rows gives each row to one
    thread: a token's entropy (and, less often, its log-prob) then differs in its last bits alone and in a batch.
    With the option every chunk has the fixed block's rows. Each of 48 tokens alone vs all 48 in one call: logp,
    entropy and d logits bitwise equal."""
    g = torch.Generator().manual_seed(3)
    n = 48
    logits = torch.randn(n, ONE_ROW_V, generator=g) * 3
    ids = torch.randint(0, ONE_ROW_V, (n,), generator=g)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)

    def call(rows):
        x = logits[rows].clone().requires_grad_(True)
        logp, ent = gk.token_logprobs(x, ids[rows], temperature=0.8, return_entropy=True, impl="torch",
                                      batch_invariant=True)
        (a[rows] * logp + b[rows] * ent).sum().backward()
        return [{int(r): t[k:k + 1] for k, r in enumerate(rows)} for t in (logp.detach(), ent.detach(), x.grad)]

    results = [("all 48 tokens", call(torch.arange(n)))]
    results += [(f"token {r} alone", call(torch.tensor([r]))) for r in range(n)]
    assert_invariant(results, "token_logprobs (torch, one-token calls)")


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


def token_by_token(call, pool: Pool, order, **kw) -> list:
    """Each token of the sequences ``order`` in a call of its own (a sampler's decoding steps; on the CPU a GEMM of
    one row, which its BLAS computes with another kernel than a GEMM of more rows): ``call`` (``token_logprobs_call``
    or ``linear_token_logprobs_call``) on one-token sequences, packed; per output, {pool index: its tokens' values
    concatenated}, as the call of a whole arrangement gives them."""
    outputs = None
    for i in order:
        tokens = Pool(*(tuple(t[k:k + 1] for k in range(pool.ids[i].shape[0]))
                        for t in (pool.logits[i], pool.hidden[i], pool.ids[i], pool.grad_logp[i],
                                  pool.grad_entropy[i])), pool.weight)
        per_token = [call(tokens, (k,), True, **kw) for k in range(len(tokens.ids))]
        outputs = outputs or [{} for _ in per_token[0]]
        for out, values in zip(outputs, zip(*per_token)):
            out[i] = torch.cat([v[k] for k, v in enumerate(values)])
    return outputs


HEAD_ARRANGEMENTS = {"torch": ARRANGEMENTS, "triton": FEW}


@pytest.mark.parametrize("impl, dtype", impl_dtypes())
def test_linear_token_logprobs_and_trl_extras_are_batch_invariant(impl, dtype, blocks):
    """The fused head with gradients (head.torch / head.light) and without (head.torch / head.no_grad), with TRL's
    extra outputs, masked padded rows compacted or packed rows, two budgets; on the PyTorch path also every token of
    the pool in a call of its own (GEMMs of one row: from bf16 / fp16 inputs, whose products an fp32 GEMM sums
    exactly more often, the one-token sequence alone may round all its outputs as in a batch; the pool's 46 tokens,
    each alone, give the comparison enough rows to see a different kernel)."""
    pool = _pool(dtype)
    extras = ("log_sum_sq_probs", "mean_logits", "is_top1")
    results = [(_label(order, packed, budget), linear_token_logprobs_call(pool, order, packed, impl, budget, extras))
               for order in HEAD_ARRANGEMENTS[impl] for packed in (False, True)
               for budget in ((None, 8 << 20) if len(order) == 3 else (None,))]
    if impl == "torch":  # (under the interpreter, 46 calls of ~0.1 s: the one-token sequence alone, in FEW)
        every = tuple(range(len(LENGTHS)))
        results.append(("token by token", token_by_token(linear_token_logprobs_call, pool, every, impl=impl,
                                                         extras=extras)))
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


def _loss_arguments(pool: Pool, order, packed: bool, impl: str, fn: str, cfg: dict, batch_invariant=True):
    """(args, kwargs) of the loss ``fn`` ("fused_linear_grpo_loss" or "grpo_loss") on the arranged rows; args[0] is
    the input that requires grad."""
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
    args = ((x, pool.weight) if fn == "fused_linear_grpo_loss" else (x,)) + (ids, adv, mask)
    return args, dict(old_logps=old_grid, ref_logps=old_grid + 0.1, num_items_in_batch=40, impl=impl, cu_seqlens=cu,
                      batch_invariant=batch_invariant, temperature=0.8, **cfg)


def loss_call(pool: Pool, order, packed: bool, impl: str, fn: str, cfg: dict, batch_invariant=True):
    """The loss on the arranged rows; returns (the loss and its metrics, per sequence (d hidden or d logits,))."""
    args, kwargs = _loss_arguments(pool, order, packed, impl, fn, cfg, batch_invariant)
    loss, metrics = getattr(gk, fn)(*args, **kwargs)
    loss.backward()
    return (loss.detach(), {k: v for k, v in metrics.items()}), [_per_sequence(args[0].grad, order, pool, packed)]


# (impl, function, config) -> the path the planner takes with the option: every family of paths is covered
LOSS_PATHS = {("torch", "fused_linear_grpo_loss"): {"dapo-num-items": "head.torch", "gspo": "head.torch"},
              ("torch", "grpo_loss"): {"dapo-num-items": "logits.torch", "gspo": "logits.torch"},
              ("triton", "fused_linear_grpo_loss"): {"dapo-num-items": "head.fast", "gspo": "head.light"},
              ("triton", "grpo_loss"): {"dapo-num-items": "logits.fast", "gspo": "logits.sweep"}}
# The case whose checks the default path passes by construction at these sizes: logits.fast computes each row in
# one program, its gradient known once the row is swept (num_items_in_batch given), and its loss is an fp64 sum of
# fp32 terms, exact for a few dozen tokens whatever the order (the option's tree sums keep it exact at any size:
# test_the_tree_sums_are_the_same_padded_or_packed_where_a_plain_sum_is_not). Every other case fails without it:
# the head cases on their gradients, the other logits cases (per-row gradients at this vocabulary) on their sums.
LOSS_BY_CONSTRUCTION = {("triton", "grpo_loss", "dapo-num-items")}


@pytest.mark.parametrize("config", list(LOSS_CONFIGS))
@pytest.mark.parametrize("fn", ["fused_linear_grpo_loss", "grpo_loss"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_losses_are_batch_invariant_and_the_same_padded_or_packed(impl, fn, config, blocks, knobs):
    """Each sequence's gradient bitwise the same in every arrangement (its reduction weight is the same: a given
    num_items_in_batch), and the loss and every metric bitwise the same for the same sequences padded or packed.
    The case of ``LOSS_BY_CONSTRUCTION`` runs every arrangement with the option off and one with it on (the same
    gradients); the paths each case takes: ``test_the_losses_take_their_batch_invariant_paths``."""
    knobs(fast_path_min_rows=1)  # the gradient-in-forward paths at these sizes
    pool = _pool(torch.float32)
    orders = HEAD_ARRANGEMENTS[impl]
    runs = [(True, order) for order in orders]
    if (impl, fn, config) in LOSS_BY_CONSTRUCTION:
        runs = [(False, order) for order in orders] + [(True, orders[1])]
    results, totals = [], {}
    for on, order in runs:
        for packed in (False, True):
            total, grads = loss_call(pool, order, packed, impl, fn, LOSS_CONFIGS[config], on)
            results.append((_label(order, packed, batch_invariant=on), grads))
            totals.setdefault((on, order), []).append(total)
    assert_invariant(results, f"{fn} ({impl}, {config})")
    for (on, order), ((loss_p, metrics_p), (loss_k, metrics_k)) in totals.items():
        assert torch.equal(loss_p, loss_k), f"{order}: padded {loss_p.item()!r} != packed {loss_k.item()!r}"
        for key in metrics_p:
            assert torch.equal(metrics_p[key], metrics_k[key]), f"{order}: metric {key} padded != packed"


@pytest.mark.parametrize("config", list(LOSS_CONFIGS))
@pytest.mark.parametrize("fn", ["fused_linear_grpo_loss", "grpo_loss"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_losses_take_their_batch_invariant_paths(impl, fn, config, blocks, knobs):
    """The plan of every arrangement of the loss test (nothing runs): the path of ``LOSS_PATHS`` and a
    batch-invariant plan, that is the option reaching the planner (this is the test the forced-off run fails
    without any number to compare)."""
    knobs(fast_path_min_rows=1)
    pool = _pool(torch.float32)
    for order in HEAD_ARRANGEMENTS[impl]:
        for packed in (False, True):
            args, kwargs = _loss_arguments(pool, order, packed, impl, fn, LOSS_CONFIGS[config])
            plan = plan_call(getattr(gk, fn), *args, **kwargs)
            assert plan.batch_invariant, f"{_label(order, packed)}: the plan is not batch-invariant"
            assert plan.path == LOSS_PATHS[(impl, fn)][config], f"{_label(order, packed)}: path {plan.path}"


def _old_logps_without_gradients(pool: Pool, fn: str, impl: str, batch_invariant=True, block=None) -> dict:
    """Per sequence, the log-probs of no-gradient calls of one token each (the old / reference log-probs a sampler
    computes at its decoding steps, in other batches than the loss's: on the CPU GEMMs of one row, which its BLAS
    computes with another kernel than a GEMM of more rows)."""
    order = tuple(range(len(LENGTHS)))
    x, _ = _arrange(pool, order, "hidden" if fn == "fused_linear_grpo_loss" else "logits", True)
    ids, _ = _arrange(pool, order, "ids", True)

    def call(x, ids):
        if fn == "fused_linear_grpo_loss":
            return gk.linear_token_logprobs(x, pool.weight, ids, temperature=0.8, impl=impl,
                                            batch_invariant=batch_invariant, invariant_block_rows=block)
        return gk.token_logprobs(x, ids, temperature=0.8, impl=impl, batch_invariant=batch_invariant,
                                 invariant_block_rows=block)

    with torch.no_grad():
        logp = torch.cat([call(x[r:r + 1], ids[r:r + 1]) for r in range(x.shape[0])])
    return _per_sequence(logp, order, pool, True)


def _loss_at(pool: Pool, fn: str, impl: str, order, cfg: dict, old: dict | None, nudge: bool = False,
            batch_invariant: bool = True, block=None):
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
    loss, _ = getattr(gk, fn)(*args, ids, adv, old_logps=old_t, cu_seqlens=cu, impl=impl,
                              batch_invariant=batch_invariant, temperature=0.8, invariant_block_rows=block,
                              **{**cfg, "beta": 0.0})  # no reference: the ratio alone
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("config", list(LOSS_CONFIGS))
@pytest.mark.parametrize("fn", ["fused_linear_grpo_loss", "grpo_loss"])
@pytest.mark.parametrize("impl, dtype", impl_dtypes())
def test_old_logps_without_gradients_give_a_ratio_of_exactly_one(impl, fn, config, dtype, blocks, knobs):
    """The old log-probs of no-gradient calls in other batches (one token per call, a sampler's decoding steps; the
    head's no-gradient logits are torch GEMMs on both impls, head.torch's tiles and head.no_grad's chunks, here of
    one row) equal the loss's own log-probs bitwise, on every path (head.no_grad = head.fast = head.light's forward;
    logits.sweep = the logits loss paths): the loss and its gradient are bitwise those of the ratio-exactly-1 call
    (old_logps=None), on batches of 3 and 2 sequences and, from the head, of one sequence of 1, 2 and 3 tokens
    (GEMMs of 1 to 3 rows, which the CPU BLAS, like cuBLAS, computes with other kernels than a many-row GEMM). The
    comparison can fail: old log-probs one ulp off change the loss.

    From the head (fused_linear_grpo_loss) the option is what makes them agree. From logits (grpo_loss) it holds by
    construction: each row's log-prob comes from its row alone in the no-gradient sweep and in every logits loss
    path, so it is checked with the option off as well as on (the shape where logits.torch's reductions follow the
    batch: ``test_a_token_alone_is_the_same_as_in_a_batch_on_the_torch_logits_path``)."""
    knobs(fast_path_min_rows=1)
    pool = _pool(dtype)
    for on in (False, True) if fn == "grpo_loss" else (True,):
        old = _old_logps_without_gradients(pool, fn, impl, on)
        # (the one- to three-token batches are for the head's GEMMs: the logits paths have none)
        for order in ((2, 0, 3), (5, 0)) + (((1,), (6,), (4,)) if fn == "fused_linear_grpo_loss" else ()):
            exact = _loss_at(pool, fn, impl, order, LOSS_CONFIGS[config], None, batch_invariant=on)
            ours = _loss_at(pool, fn, impl, order, LOSS_CONFIGS[config], old, batch_invariant=on)
            label = f"{order}{'' if on else ' option off'}"
            assert torch.equal(ours[0], exact[0]), (f"{label}: loss {ours[0].item()!r} != {exact[0].item()!r} "
                                                    "(ratio != 1)")
            assert torch.equal(ours[1], exact[1]), f"{label}: the gradient differs from the ratio-1 call's"
            if on:  # (once per order: the comparison's own check)
                nudged = _loss_at(pool, fn, impl, order, LOSS_CONFIGS[config], old, nudge=True)
                assert not torch.equal(nudged[0], exact[0]), "a one-ulp change of the old log-probs went unseen"


def test_the_tree_sums_are_the_same_padded_or_packed_where_a_plain_sum_is_not():
    """The option's loss and metric sums (``sequences.token_sums`` with ``tree``): the same bits for the same
    sequences padded or packed, on fp32 terms spanning 24 decades, whose fp64 sum rounds; the plain fp64 sum of the
    default paths differs between the two layouts on them (which is why the test can fail)."""
    g = torch.Generator().manual_seed(4)
    lengths = LENGTHS * 8
    terms = [(torch.randn(n, 3, generator=g) * torch.logspace(-12, 12, n)[:, None]).float() for n in lengths]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    T = max(lengths) + 1
    grid = torch.zeros(len(lengths), T, 3)
    for b, t in enumerate(terms):
        grid[b, : t.shape[0]] = t
    sums = {tree: (token_sums(torch.cat(terms), (1, int(cu[-1])), cu, tree),
                   token_sums(grid.reshape(-1, 3), (len(lengths), T), None, tree)) for tree in (False, True)}
    assert not torch.equal(*sums[False]), "the plain fp64 sums agree padded and packed: the terms do not round"
    assert torch.equal(*sums[True]), f"tree sums: packed {sums[True][0].tolist()} != padded {sums[True][1].tolist()}"


# A block the caller chooses (``invariant_block_rows``, no knob): single sequences of 7 / 8 / 9 rows and batches of
# 15 / 16 / 17 rows cross its edges, each sequence at several positions; the 1-, 2- and 3-token sequences alone are
# GEMMs of 1 to 3 rows (the CPU BLAS's other kernels: without the option they differ from the same rows in a batch)
CHOSEN_BLOCK = 8
CHOSEN_ORDERS = [(1,), (3,), (7,), (2,), (0, 2, 1), (5, 0), (2, 3, 1), (7, 3), (3, 7, 1), (6,), (4,)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_chosen_block_is_batch_invariant_at_its_size(impl, plans):
    """invariant_block_rows=8: every sequence's log-probs, entropy and gradient bitwise the same in every arrangement
    (padded or packed; the one-token sequence alone among them) with that block, on the head (head.torch /
    head.light and head.no_grad under the interpreter) and the logits (logits.torch; the Triton logits paths have no
    row blocks); every plan has 8-row blocks (the option reaches the planner, not the device's 256)."""
    pool = _pool(torch.float32)
    orders = CHOSEN_ORDERS if impl == "torch" else CHOSEN_ORDERS[:6]  # (the interpreter: the one-token one, edges)
    head = [(_label(order, packed), linear_token_logprobs_call(pool, order, packed, impl, block=CHOSEN_BLOCK))
            for order in orders for packed in (False, True)]
    assert_invariant(head, f"linear_token_logprobs ({impl}, invariant_block_rows={CHOSEN_BLOCK})")
    if impl == "torch":
        logits = [(_label(order, packed), token_logprobs_call(pool, order, packed, impl, block=CHOSEN_BLOCK))
                  for order in orders for packed in (False, True)]
        assert_invariant(logits, f"token_logprobs ({impl}, invariant_block_rows={CHOSEN_BLOCK})")
    assert plans and all(p.batch_invariant and p.chunk_rows == CHOSEN_BLOCK for p in plans), \
        f"the chosen block did not reach the plan: {sorted({(p.path, p.batch_invariant, p.chunk_rows) for p in plans})}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_a_chosen_block_gives_a_ratio_of_exactly_one(impl, knobs):
    """Old log-probs of no-gradient calls in other batches with the same chosen block (one token per call, a
    sampler's decoding steps: GEMMs of one row, which the CPU BLAS computes with another kernel than a many-row GEMM,
    so only the option makes them agree): the loss and its gradient are bitwise the ratio-1 call's (head.torch;
    head.no_grad against head.fast under the interpreter)."""
    knobs(fast_path_min_rows=1)
    pool = _pool(torch.float32)
    fn, cfg = "fused_linear_grpo_loss", LOSS_CONFIGS["dapo-num-items"]
    old = _old_logps_without_gradients(pool, fn, impl, block=CHOSEN_BLOCK)
    for order in ((2, 0, 3), (5, 0), (1,), (6,), (4,)):  # and one sequence of 1 to 3 tokens (GEMMs of 1-3 rows)
        exact = _loss_at(pool, fn, impl, order, cfg, None, block=CHOSEN_BLOCK)
        ours = _loss_at(pool, fn, impl, order, cfg, old, block=CHOSEN_BLOCK)
        assert torch.equal(ours[0], exact[0]), f"{order}: loss {ours[0].item()!r} != {exact[0].item()!r} (ratio != 1)"
        assert torch.equal(ours[1], exact[1]), f"{order}: the gradient differs from the ratio-1 call's"
