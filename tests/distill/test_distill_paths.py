"""Each distillation path as the planner picks it (forced by impl, grad_in_forward and memory_budget) against the
float64 reference by the three-way rule: distill.torch / distill.torch_fast (PyTorch row chunks), distill.fast
(gradient in the forward), distill.light over the whole vocabulary and over vocabulary tiles (recompute),
distill.no_grad; bf16 inputs; awkward shapes (V = 37 crosses the interpreter's 16-column blocks, one token, masked
rows, every row masked); packed rows equal to padded ones. Batch invariance: test_distill_batch_invariance.py.

Triton runs under the interpreter with its buffers poisoned by NaN (a row or column a kernel skips shows up). One
case per Triton path runs in the fast set, the others in the slow one.
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.distill_config import DistillLossConfig
from grpo_kernels.explain import plan_call

from ..support.distill_cases import (ALL_OPTIONS, CASE_IDS, CASES, assert_loss_three_way,
                                     assert_token_three_way, make_heads, ours_loss, ours_token, truth_loss,
                                     truth_token)

pytestmark = pytest.mark.usefixtures("poisoned_outputs")
F32, F64 = torch.float32, torch.float64
HEAVY = "jsd-0.7-all"  # every transform and both biases: the Triton paths' fast-set case
# The PyTorch path in the fast set, the Triton one (the interpreter, seconds a call) in the slow set
IMPLS = ["torch", pytest.param("triton", marks=[pytest.mark.interpreter, pytest.mark.slow])]


def _cases(fast_ids=(HEAVY,)):
    return [c if c.id in fast_ids else pytest.param(c, marks=pytest.mark.slow) for c in CASES]


def _plan(heads, cfg, fn=gk.fused_linear_distill_loss, impl="triton", **kw):
    sh, sw = heads["sh"].clone().requires_grad_(True), heads["sw"].clone().requires_grad_(True)
    sb = None if heads["sb"] is None else heads["sb"].clone().requires_grad_(True)
    extra = {"mask": heads["mask"]} if fn is gk.linear_token_divergence else {}
    args = (sh, sw, heads["th"], heads["tw"]) + ((heads["mask"],) if fn is gk.fused_linear_distill_loss else ())
    return plan_call(fn, *args, student_bias=sb, teacher_bias=heads["tb"], config=cfg, impl=impl, **extra, **kw)


def tile_budget(heads, cfg, cols: int, fn=gk.fused_linear_distill_loss, **kw) -> int:
    """The memory_budget whose distill.light plan tiles the vocabulary ``cols`` columns at a time (fp32 heads), from
    the planner's own figure at the whole vocabulary."""
    plan = _plan(heads, cfg, fn, grad_in_forward=False, **kw)
    items = dict(plan.transient)
    tiles = items["both heads' fp32 logits tiles (d student logits written in place)"]
    return plan.transient_bytes - tiles + 8 * plan.chunk_rows * cols


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["torch_fast", "torch"])
def test_torch_paths(case, grad_in_forward, plans):
    """The loss on the PyTorch path with the gradient in the forward, and recomputed in the backward, in chunks of
    3 rows (a memory_budget from the planner's figure)."""
    heads = make_heads(bias=case.bias, seed=5)
    cfg = case.cfg.replace(grad_in_forward=grad_in_forward)
    full = _plan(heads, cfg, impl="torch")
    budget = full.transient_bytes - (full.chunk_rows - 3) * (dict(full.transient)[
        "both heads' logits chunks and their temporaries"] // full.chunk_rows)
    plans.clear()
    ours = ours_loss(heads, cfg, impl="torch", memory_budget=budget)
    assert [(p.path, p.chunk_rows) for p in plans] == [("distill.torch_fast" if grad_in_forward else "distill.torch",
                                                        3)]
    assert_loss_three_way(ours, truth_loss(heads, cfg, F32), truth_loss(heads, cfg), F32, case.id)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", _cases(), ids=CASE_IDS)
def test_fast_path_in_chunks(case, knobs, plans):
    """distill.fast in chunks of 3 rows (the padded rows of no chunk), the gradient made in the forward."""
    knobs(fast_path_min_rows=1)
    heads = make_heads(bias=case.bias, seed=6)
    plan = _plan(heads, case.cfg)
    chunk = dict(plan.transient)["both heads' fp32 logits chunks (d student logits written in place)"]
    plans.clear()
    ours = ours_loss(heads, case.cfg, impl="triton", memory_budget=plan.transient_bytes - chunk + 3 * 8 * 37)
    assert [(p.path, p.chunk_rows) for p in plans] == [("distill.fast", 3)]
    assert_loss_three_way(ours, truth_loss(heads, case.cfg, F32), truth_loss(heads, case.cfg), F32, case.id)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", _cases(("revkl",)), ids=CASE_IDS)
def test_light_path_over_vocabulary_tiles(case, plans):
    """distill.light over tiles of 16 columns (V = 37: two full tiles and a 5-column one; the JSD a second pass):
    the per-token function and the loss with grad_in_forward=False."""
    heads = make_heads(bias=case.bias, seed=7)
    budget = tile_budget(heads, case.cfg, 16)
    token_budget = tile_budget(heads, case.cfg, 16, gk.linear_token_divergence)
    plans.clear()
    token = ours_token(heads, case.cfg, impl="triton", memory_budget=token_budget)
    loss = ours_loss(heads, case.cfg.replace(grad_in_forward=False), impl="triton", memory_budget=budget)
    assert [(p.path, p.vocab_tile) for p in plans] == [("distill.light", 16)] * 2
    assert_token_three_way(token, truth_token(heads, case.cfg, F32), truth_token(heads, case.cfg), F32, case.id)
    assert_loss_three_way(loss, truth_loss(heads, case.cfg, F32), truth_loss(heads, case.cfg), F32, case.id)


@pytest.mark.interpreter
def test_no_grad_path_equals_the_light_forward(plans):
    """Under torch.no_grad the per-token function takes distill.no_grad: the same row kernel, the same numbers as
    the light path's forward (bitwise), and against float64."""
    case = next(c for c in CASES if c.id == HEAVY)
    heads = make_heads(bias=True, seed=8)
    (div, ent), _ = ours_token(heads, case.cfg, impl="triton")
    with torch.no_grad():
        div0, ent0 = gk.linear_token_divergence(heads["sh"], heads["sw"], heads["th"], heads["tw"],
                                                student_bias=heads["sb"], teacher_bias=heads["tb"],
                                                mask=heads["mask"], config=case.cfg, impl="triton")
    assert [p.path for p in plans] == ["distill.light", "distill.no_grad"]
    assert torch.equal(div0, div) and torch.equal(ent0, ent)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_inputs(impl, knobs):
    """bf16 heads: the loss (fast path on Triton, d logits rounded to bf16 in place) and the per-token function
    against float64, the middle term plain PyTorch in bf16."""
    knobs(fast_path_min_rows=1)
    cfg = DistillLossConfig(beta=0.4, **ALL_OPTIONS)
    heads = make_heads(bias=True, seed=9, dtype=torch.bfloat16)
    loss = ours_loss(heads, cfg, impl=impl)
    token = ours_token(heads, cfg, impl=impl)
    bf16 = torch.bfloat16
    assert_loss_three_way(loss, truth_loss(heads, cfg, bf16), truth_loss(heads, cfg), bf16, f"{impl} loss")
    assert_token_three_way(token, truth_token(heads, cfg, bf16), truth_token(heads, cfg), bf16, f"{impl} token")


@pytest.mark.parametrize("impl", IMPLS)
def test_round_logits(impl, knobs):
    """round_logits="bf16": both heads' raw logits rounded before the scale (the loss and its straight-through
    gradients against the float64 reference, which rounds the same float64 logits)."""
    knobs(fast_path_min_rows=1)
    cfg = DistillLossConfig(beta=0.6, round_logits="bf16", **ALL_OPTIONS)
    heads = make_heads(bias=True, seed=13)
    assert_loss_three_way(ours_loss(heads, cfg, impl=impl), truth_loss(heads, cfg, F32), truth_loss(heads, cfg), F32,
                          "round_logits")


@pytest.mark.parametrize("impl", IMPLS)
def test_one_token_and_every_token_masked(impl, knobs):
    """N = 1 (a (1, 1) grid); every token masked: loss 0 with zero gradients, num_tokens 0 (TRL's clamp)."""
    knobs(fast_path_min_rows=1)
    cfg = DistillLossConfig(beta=0.5)
    one = make_heads(shape=(1, 1), bias=True, seed=10, masked=False)
    assert_loss_three_way(ours_loss(one, cfg, impl=impl), truth_loss(one, cfg, F32), truth_loss(one, cfg), F32,
                          "one token")
    none = make_heads(bias=True, seed=10)
    none["mask"] = torch.zeros_like(none["mask"])
    loss, grads, metrics = ours_loss(none, cfg, impl=impl)
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)
    assert metrics["num_tokens"].item() == 0 and metrics["entropy"].item() == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_rows_equal_padded_rows(impl, knobs):
    """Three sequences packed with cu_seqlens (their valid tokens only) give the loss, metrics and gradients of the
    padded (3, 5) call: the same per-token maths, summed in another order (within two floors of each other)."""
    from ..support.tolerances import assert_same_maths, grad_scale

    knobs(fast_path_min_rows=1)
    cfg = DistillLossConfig(beta=0.3, **ALL_OPTIONS)
    heads = make_heads(shape=(3, 5), bias=True, seed=11)
    lengths = [5, 3, 4]
    heads["mask"] = torch.tensor([[i < n for i in range(5)] for n in lengths])
    padded = ours_loss(heads, cfg, impl=impl)
    keep = heads["mask"].reshape(-1)
    packed_heads = dict(heads, sh=heads["sh"].reshape(15, -1)[keep], th=heads["th"].reshape(15, -1)[keep],
                        mask=torch.ones(sum(lengths), dtype=torch.bool))
    cu = torch.tensor([0, 5, 8, 12])
    packed = ours_loss(packed_heads, cfg, impl=impl, cu_seqlens=cu)
    assert_same_maths(packed[0], padded[0], F32, "loss")
    for name in ("entropy_sum", "num_tokens", "divergence"):
        assert_same_maths(packed[2][name], padded[2][name], F32, name)
    d_packed = torch.zeros(15, padded[1][0].shape[-1]).index_copy(0, keep.nonzero().squeeze(1), packed[1][0])
    assert_same_maths(d_packed.view_as(padded[1][0]), padded[1][0], F32, "d hidden", scale=grad_scale(padded[1][0]))
    assert_same_maths(packed[1][1], padded[1][1], F32, "d weight", scale=grad_scale(padded[1][1]))
