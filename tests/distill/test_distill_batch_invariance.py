"""Batch invariance of the distillation functions (``DistillLossConfig.batch_invariant``, docs/numerics.md "Batch
invariance"): a sequence's per-token divergence, student entropy and d student hidden, from
``linear_token_divergence`` (with and without a gradient) and the d student hidden of ``fused_linear_distill_loss``,
bitwise the same (``torch.equal``) alone and in batches at other positions, padded with a mask or packed, across the
fixed row blocks' edges; the loss of the same sequences bitwise the same padded and packed. Blocks of 4 rows (the
``invariant_rows`` knob) and a block the caller chooses (``invariant_block_rows=8``, no knob); both impls (Triton
under the interpreter: distill.light, distill.no_grad, distill.fast; PyTorch: distill.torch, distill.torch_fast);
the option's way in: a bad block, ``explain``, ``FusedLinearDistillLoss``, ``patch_trl`` into TRL's
DistillationTrainer seams.

Every test here that credits the option fails without it: tests/api/test_invariance_forced_off.py runs this module
with ``GRPO_KERNELS_TEST_FORCE_VARIANT=1`` (every call ignores ``batch_invariant``). Where the batch enters on the
CPU: the BLAS computes a GEMM of one to three rows with other kernels than a GEMM of more rows, so the pool holds
sequences of 1, 2 and 3 tokens and each is seen alone (both impls make their logits and d hidden with torch GEMMs).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.distill_config import DistillLossConfig

from ..support.distill_cases import ALL_OPTIONS
from ..support.invariance_checks import assert_invariant, lay_out, split_back

pytestmark = pytest.mark.usefixtures("poisoned_outputs")
V, HS, HT = 37, 16, 24  # V = 37 crosses the interpreter's 16-column blocks; the teacher wider than the student
LENGTHS = (5, 1, 9, 3, 2, 7)  # the pool's sequences (ragged; 1, 2 and 3 tokens: GEMMs of 1-3 rows alone)
KNOB_BLOCK, CHOSEN_BLOCK = 4, 8
NUM_ITEMS = 16.0  # the loss's num_items_in_batch: each token's weight the same in any batch
CFG = DistillLossConfig(beta=0.5, batch_invariant=True, **ALL_OPTIONS)
# The hidden features' scales, 2^-3 .. 2^3 (as tests/api/test_batch_invariance.py: sums that round)
FEATURE_SCALE = 2.0 ** torch.linspace(-3, 3, HS)

# Orders of the pool's sequences: the 1- to 3-token ones alone, and batches whose rows (padded: the valid ones,
# compacted) cross the 4-row blocks' edges (3 / 4 / 5, 7 / 8 / 9, 11 / 12 / 13 rows) ...
KNOB_ORDERS = {"torch": [(1,), (3,), (4,), (3, 1), (4, 3), (5,), (0, 1, 4), (3, 0, 1), (2, 1, 4), (4, 3, 0, 1),
                         (5, 4, 1, 3)],
               "triton": [(1,), (4,), (0, 1), (3, 0, 1)]}
# ... and the 8-row blocks' (7 / 8 / 9, 15 / 16 / 17 rows); under the interpreter (seconds a call) fewer
CHOSEN_ORDERS = {"torch": [(1,), (3,), (5,), (5, 4), (0, 3), (2, 4, 1), (3, 2, 4, 1), (5, 3, 0, 1), (2, 0, 1, 4)],
                 "triton": [(1,), (5, 4), (0, 3), (5, 0, 3, 1)]}
IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def _pool(seed=0):
    """Per sequence: student hidden (L, HS), teacher hidden (L, HT), per-token weights of the per-token function's
    test loss (L,); both heads' weights and biases."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, HS, generator=g) * FEATURE_SCALE, torch.randn(n, HT, generator=g),
             torch.rand(n, generator=g) + 0.5) for n in LENGTHS]
    heads = dict(sw=torch.randn(V, HS, generator=g) * 0.4, sb=torch.randn(V, generator=g) * 0.5,
                 tw=torch.randn(V, HT, generator=g) * 0.6, tb=torch.randn(V, generator=g) * 0.5)
    return seqs, heads


POOL = _pool()


def _arrange(order, k: int, packed: bool):
    """Field ``k`` of the sequences ``order`` as one call's input: packed (N, ...) rows, or padded (B, T, ...) rows
    with T one more than the longest (a masked position in every row); and the mask (padded only)."""
    data, _, mask = lay_out([POOL[0][i][k] for i in order], packed)
    return data, mask


def _per_sequence(t, order, packed: bool) -> dict:
    return split_back(t, order, [LENGTHS[i] for i in order], packed)


def _student_head():
    return POOL[1]["sw"].clone().requires_grad_(True), POOL[1]["sb"].clone().requires_grad_(True)


def divergence_call(order, packed: bool, impl: str, cfg=CFG, **kw) -> list:
    """linear_token_divergence on the arranged hiddens, the backward of sum(w D): per sequence (divergence, entropy,
    d student hidden); then the same call without a gradient (distill.no_grad on Triton): its (divergence,
    entropy)."""
    sh, mask = _arrange(order, 0, packed)
    th, _ = _arrange(order, 1, packed)
    w, _ = _arrange(order, 2, packed)
    x = sh.clone().requires_grad_(True)
    sw, sb = _student_head()
    h = POOL[1]
    div, ent = gk.linear_token_divergence(x, sw, th, h["tw"], student_bias=sb, teacher_bias=h["tb"], mask=mask,
                                          config=cfg, impl=impl, **kw)
    (grad,) = torch.autograd.grad((w * div).sum(), [x])
    with torch.no_grad():
        div_ng, ent_ng = gk.linear_token_divergence(sh, h["sw"], th, h["tw"], student_bias=h["sb"],
                                                    teacher_bias=h["tb"], mask=mask, config=cfg, impl=impl, **kw)
    return [_per_sequence(t, order, packed) for t in (div.detach(), ent.detach(), grad, div_ng, ent_ng)]


def loss_call(order, packed: bool, impl: str, cfg=CFG, module=False, **kw):
    """(loss, metrics, per sequence d student hidden) of fused_linear_distill_loss (or ``FusedLinearDistillLoss``)
    on the arranged hiddens, packed with cu_seqlens or padded with the mask; num_items_in_batch fixed."""
    sh, mask = _arrange(order, 0, packed)
    th, _ = _arrange(order, 1, packed)
    cu = torch.tensor([0, *itertools.accumulate(LENGTHS[i] for i in order)]) if packed else None
    x = sh.clone().requires_grad_(True)
    sw, sb = _student_head()
    h = POOL[1]
    fn = gk.FusedLinearDistillLoss(cfg, impl=impl, **kw) if module else \
        lambda *a, **k: gk.fused_linear_distill_loss(*a, config=cfg, impl=impl, **kw, **k)
    loss, metrics = fn(x, sw, th, h["tw"], mask, student_bias=sb, teacher_bias=h["tb"], num_items_in_batch=NUM_ITEMS,
                       cu_seqlens=cu)
    (grad,) = torch.autograd.grad(loss, [x])
    return loss.detach(), metrics, _per_sequence(grad, order, packed)



def _check_arrangements(orders, impl: str, what: str, **kw):
    """The per-token function and the loss on every order, padded and packed: each sequence's numbers the same in
    every call; each order's loss and metrics the same padded and packed (the per-sequence tree sums)."""
    results = []
    for order in orders:
        losses = {}
        for packed in (False, True):
            label = f"{order} {'packed' if packed else 'padded'}"
            losses[packed] = loss_call(order, packed, impl, **kw)
            results.append((label, divergence_call(order, packed, impl, **kw) + [losses[packed][2]]))
        (loss_a, m_a, _), (loss_b, m_b, _) = losses[False], losses[True]
        assert torch.equal(loss_a, loss_b), f"{what} {order}: loss padded {loss_a.item()!r} != packed {loss_b.item()!r}"
        for name in ("divergence", "entropy_sum"):
            assert torch.equal(m_a[name], m_b[name]), f"{what} {order}: metric {name} padded != packed"
    # the no-gradient call's values beside the gradient call's: outputs 3, 4 are outputs 0, 1 of the same calls
    results += [(f"{label} no grad", [outputs[3], outputs[4]]) for label, outputs in results]
    assert_invariant(results, what)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_sequence_is_the_same_alone_and_in_any_batch(impl, knobs, plans):
    """Blocks of 4 rows (the knob): every sequence's divergence, entropy and d hidden (per token, with and without a
    gradient) and its d hidden from the loss bitwise the same in every arrangement; every plan batch-invariant
    with 4-row chunks."""
    knobs(invariant_rows=KNOB_BLOCK)
    _check_arrangements(KNOB_ORDERS[impl], impl, f"distillation ({impl}, blocks of {KNOB_BLOCK})")
    assert plans and all(p.batch_invariant and p.chunk_rows == KNOB_BLOCK for p in plans), \
        f"not batch-invariant plans: {sorted({(p.path, p.batch_invariant, p.chunk_rows) for p in plans})}"
    want = {"torch": {"distill.torch", "distill.torch_fast"},
            "triton": {"distill.light", "distill.no_grad", "distill.fast"}}[impl]
    assert {p.path for p in plans} == want


@pytest.mark.parametrize("impl", IMPLS)
def test_a_chosen_block_is_batch_invariant_at_its_size(impl, plans):
    """invariant_block_rows=8 (no knob): the same guarantee at that block, the 1-token to 3-token sequences alone
    and batches of 7 to 17 rows; every plan has 8-row blocks (the option reaches the planner, not the device's
    256)."""
    _check_arrangements(CHOSEN_ORDERS[impl], impl, f"distillation ({impl}, invariant_block_rows={CHOSEN_BLOCK})",
                        invariant_block_rows=CHOSEN_BLOCK)
    assert plans and all(p.batch_invariant and p.chunk_rows == CHOSEN_BLOCK for p in plans), \
        f"the chosen block did not reach the plan: {sorted({(p.path, p.batch_invariant, p.chunk_rows) for p in plans})}"


def test_the_module_takes_the_option():
    """FusedLinearDistillLoss(config with batch_invariant and a block of 2 rows): a 1-token sequence's d hidden
    bitwise the same alone and after others."""
    cfg = CFG.replace(invariant_block_rows=2)
    alone = loss_call((1,), True, "torch", cfg, module=True)[2]
    batched = loss_call((0, 3, 1), True, "torch", cfg, module=True)[2]
    assert torch.equal(alone[1], batched[1]), \
        f"FusedLinearDistillLoss: d hidden of the 1-token sequence alone != after others ({alone[1]} vs {batched[1]})"


def _tensors():
    h = POOL[1]
    return POOL[0][0][0], h["sw"], POOL[0][0][1], h["tw"]


@pytest.mark.parametrize("value", [0, -4, 2.0, True, "8"])
def test_a_bad_block_names_the_option(value):
    """invariant_block_rows: an int >= 1 on every distillation entry point, else a ValueError naming it (GRPO's
    rule and message, ``_checks.invariant_block_rows``)."""
    sh, sw, th, tw = _tensors()
    calls = [lambda: DistillLossConfig(batch_invariant=True, invariant_block_rows=value),
             lambda: gk.linear_token_divergence(sh, sw, th, tw, batch_invariant=True, invariant_block_rows=value),
             lambda: gk.fused_linear_distill_loss(sh, sw, th, tw, batch_invariant=True, invariant_block_rows=value),
             lambda: gk.FusedLinearDistillLoss(batch_invariant=True, invariant_block_rows=value),
             lambda: gk.explain(gk.fused_linear_distill_loss, sh, sw, th, tw, batch_invariant=True,
                                invariant_block_rows=value)]
    for call in calls:
        with pytest.raises(ValueError, match="invariant_block_rows must be None or an int number of rows >= 1"):
            call()


def test_a_block_without_batch_invariant_is_refused():
    sh, sw, th, tw = _tensors()
    calls = [lambda: DistillLossConfig(invariant_block_rows=8),
             lambda: gk.linear_token_divergence(sh, sw, th, tw, invariant_block_rows=8),
             lambda: gk.fused_linear_distill_loss(sh, sw, th, tw, config=CFG, batch_invariant=False,
                                                  invariant_block_rows=8)]
    for call in calls:
        with pytest.raises(ValueError, match="invariant_block_rows=8 sets the rows per block of batch_invariant=True"):
            call()


def test_explain_shows_the_chosen_block():
    sh, sw, th, tw = _tensors()
    for fn in (gk.fused_linear_distill_loss, gk.linear_token_divergence):
        text = gk.explain(fn, sh, sw, th, tw, batch_invariant=True, invariant_block_rows=4)
        assert "every block has 4 rows" in text, f"the chosen block did not reach the plan:\n{text}"
        default = gk.explain(fn, sh, sw, th, tw, batch_invariant=True)
        assert "every block has 256 rows" in default, f"the device's block did not reach the plan:\n{default}"


# ---------------------------------------------------------------------------- patch_trl: TRL's distillation seams


def _trl_calls():
    """(probe alone, probe after others) results through TRL's two patched seams (the trainer module's globals):
    ChunkedDivergenceFunction.apply, the backward of sum(w D) -> (D, entropy, d hidden) of the probe (the 1-token
    sequence); _chunked_divergence_loss with num_items_in_batch -> d hidden of the probe."""
    import trl.trainer.distillation_trainer as trl_distill_trainer

    h = POOL[1]
    options = (CFG.beta, CFG.temperature, CFG.student_logit_scale, CFG.student_softcap, CFG.teacher_logit_scale,
               CFG.teacher_softcap)
    outs = []
    for order in ((1,), (0, 3, 1)):
        sh, th, w = (_arrange(order, k, True)[0] for k in range(3))
        x = sh.clone().requires_grad_(True)
        sw, sb = _student_head()
        div, ent = trl_distill_trainer.ChunkedDivergenceFunction.apply(x, sw, sb, th, h["tw"], h["tb"], *options)
        (grad,) = torch.autograd.grad((w * div).sum(), [x])
        x2 = sh.clone().requires_grad_(True)
        loss, _, _ = trl_distill_trainer._chunked_divergence_loss(
            x2[None], th[None], sw, h["tw"], torch.ones(1, x2.shape[0], dtype=torch.long), CFG.beta,
            num_items_in_batch=NUM_ITEMS, student_lm_head_bias=sb, teacher_lm_head_bias=h["tb"],
            student_logit_scale=CFG.student_logit_scale, teacher_logit_scale=CFG.teacher_logit_scale,
            student_final_logit_softcapping=CFG.student_softcap,
            teacher_final_logit_softcapping=CFG.teacher_softcap, temperature=CFG.temperature)
        (loss_grad,) = torch.autograd.grad(loss, [x2])
        outs.append((div.detach()[-1:], ent.detach()[-1:], grad[-1:], loss_grad[-1:]))
    return outs


@pytest.mark.usefixtures("unpatched_trl")
def test_patch_trl_makes_the_distillation_calls_batch_invariant(knobs, plans):
    """patch_trl(batch_invariant=True): TRL's ChunkedDivergenceFunction and _chunked_divergence_loss, as the
    DistillationTrainer calls them, give a 1-token sequence the same bits alone and after others."""
    pytest.importorskip("trl", reason="TRL is in the test extra")
    knobs(invariant_rows=KNOB_BLOCK)
    gk.patch_trl(batch_invariant=True)
    alone, batched = _trl_calls()
    for name, a, b in zip(("divergence", "entropy", "d hidden", "the loss's d hidden"), alone, batched):
        assert torch.equal(a, b), f"patch_trl: {name} of the 1-token sequence alone != after others ({a} vs {b})"
    assert len(plans) == 4 and all(p.batch_invariant for p in plans)


@pytest.mark.usefixtures("unpatched_trl")
def test_patch_trl_passes_the_chosen_block_to_the_distillation_calls(plans):
    pytest.importorskip("trl", reason="TRL is in the test extra")
    report = gk.patch_trl(batch_invariant=True, invariant_block_rows=4)
    assert report.invariant_block_rows == 4 and "invariant_block_rows=4" in str(report)
    _trl_calls()
    assert len(plans) == 4 and all(p.batch_invariant and p.chunk_rows == 4 for p in plans), \
        f"the chosen block did not reach the plan: {[(p.path, p.batch_invariant, p.chunk_rows) for p in plans]}"
    gk.unpatch_trl()
    assert gk.integrations.trl._STATE["invariant_block_rows"] is None
