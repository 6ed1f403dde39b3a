"""The Triton paths of fused_linear_grpo_loss chosen by the planner: gradient in the forward (head.fast,
head.fast_sequence: cuBLAS-shaped row chunks + the row-sweep epilogue) and the memory-light recompute path.

Runs the Triton kernels under TRITON_INTERPRET=1 on CPU (conftest.py); the interpreter's row block is 16, so V=37
crosses the epilogue's main-loop / tail boundary. Ground truth: float64 full logits through TRL's _compute_loss
(tests/support/oracles.py) and the reference.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import logprobs_and_entropy
from grpo_kernels.loss_types import per_token_gradient_known

from ..support.cases import CASES, make_inputs, optional_inputs
from ..support.heads import (HIDDEN, assert_head_three_way, fast_path_budget, head_call, head_plan, head_same_dtype,
                             linear_truth)
from ..support.tolerances import assert_three_way, grad_scale, naive_logprobs_entropy

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_outputs")]


TOKEN_LOCAL = [c for c in CASES if per_token_gradient_known(c.config)]
METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


_KIND = {"head.fast": "fast", "head.fast_sequence": "sequence", "head.light": "light"}


def _paths(plans):
    """(kind, size) per call: ('fast', rows per chunk), ('sequence', chunks) or ('light', d-logits chunk bytes)."""
    return [(_KIND[p.path], {"fast": p.chunk_rows, "sequence": p.sequence_chunks, "light": p.chunk_bytes}[_KIND[p.path]])
            for p in plans if p.path in _KIND]


@pytest.mark.parametrize("case", TOKEN_LOCAL, ids=lambda c: c.id)
def test_grad_in_forward_matches_trl_and_light_path(case, knobs, plans):
    """Every token-level configuration, with bias: the fast path equals TRL's loss in float64 and the light
    path (grad_in_forward=False; its d logits from GEMM logits + the row-sweep epilogue, two 32-column chunks),
    loss, gradients and metrics; chunks of 3 rows split sequences (T = 7)."""
    knobs(fast_path_min_rows=1, dlogits_by_gemm=True)
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=21)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(3)) * 0.2
    fast_budget, light_budget = fast_path_budget(inputs, case, 3, bias), _light_budget(inputs, case, 32, bias)
    plans.clear()
    loss, grads, metrics = head_call(inputs, case, "triton", bias=bias, memory_budget=fast_budget)
    l_loss, l_grads, l_metrics = head_call(inputs, case, "triton", bias=bias, grad_in_forward=False,
                                       memory_budget=light_budget)
    seen = _paths(plans)
    assert [p for p, _ in seen] == ["fast", "light"] and seen[0][1] == 3
    _assert_agree((loss, grads, metrics), (l_loss, l_grads, l_metrics), inputs, case, bias)


def _light_budget(inputs, case, cols, bias=None):
    """The memory_budget whose light-path backward uses d-logits chunks of ``cols`` columns (one row block)."""
    plan = head_plan(inputs, case, bias, grad_in_forward=False)
    dl = dict(plan.transient)["d logits chunk"]
    n_valid = plan.rows
    return plan.transient_bytes - dl + n_valid * cols * 4


def _assert_agree(fast, light, inputs, case, bias):
    """The in-forward path's and the light path's (loss, (d hidden, d weight, d bias), metrics) against TRL in float64
    by the three-way rule (TRL in fp32 the middle term): both within it, so within twice it of each other. Metrics
    TRL does not log (cispo_clip_ratio) are checked against the reference in float64 and fp32."""
    trl64, trl32 = (linear_truth(inputs, case.config, bias=bias, dtype=d, oracle="trl")
                    for d in (torch.float64, torch.float32))
    ref64, ref32 = (linear_truth(inputs, case.config, bias=bias, dtype=d) for d in (torch.float64, torch.float32))
    for name, result in (("fast", fast), ("light", light)):
        assert_head_three_way(result, trl32, trl64, torch.float32, name, metrics=METRICS)
        assert_head_three_way(result, ref32, ref64, torch.float32, f"{name} (reference)", metrics=result[2])


SEQUENCE_LOCAL = [c for c in CASES if not per_token_gradient_known(c.config) and c.config.top_entropy_quantile == 1]
SEQUENCE_LOCAL.append(dataclasses.replace(
    next(c for c in CASES if c.id == "sequence-beta"), id="sequence-entropy-bonus-temperature",
    overrides={"loss_type": "dr_grpo", "beta": 0.04, "importance_sampling_level": "sequence", "entropy_coef": 0.03,
               "temperature": 0.8, "delta": 1.2}))


@pytest.mark.parametrize("case", SEQUENCE_LOCAL, ids=lambda c: c.id)
def test_sequence_level_grad_in_forward_matches_trl_and_light_path(case, knobs, plans):
    """GSPO (sequence-level ratios), vespo and the off-policy mask: chunks of whole sequences (at most 10 rows,
    so 1-2 sequences of T = 7 per chunk), gradients through the reference on each chunk's sequences; equal to
    TRL in float64 and to the light path, with bias."""
    knobs(fast_path_min_rows=1)
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=22)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4)) * 0.2
    budget = fast_path_budget(inputs, case, 10, bias)
    plans.clear()
    loss, grads, metrics = head_call(inputs, case, "triton", bias=bias, memory_budget=budget)
    l_loss, l_grads, l_metrics = head_call(inputs, case, "triton", bias=bias, grad_in_forward=False)
    seen = _paths(plans)
    assert [p for p, _ in seen] == ["sequence", "light"] and len(seen[0][1]) >= 2
    _assert_agree((loss, grads, metrics), (l_loss, l_grads, l_metrics), inputs, case, bias)


def test_sequence_level_paths_fall_back_to_the_light_path(knobs, plans):
    """A sequence longer than the budget's chunk, the top-entropy mask (a batch-wide quantile) and
    grad_in_forward=False take the memory-light path."""
    knobs(fast_path_min_rows=1)
    gspo = next(c for c in CASES if c.id == "grpo-sequence")
    inputs = make_inputs(gspo, hidden_size=HIDDEN, seed=2)
    longest = int(inputs["mask"].sum(-1).max())
    V = inputs["weight"].shape[0]
    plan = head_plan(inputs, gspo)
    assert plan.path == "head.fast_sequence"
    fits = plan.transient_bytes - dict(plan.transient)["fp32 logits chunk (d logits written in place)"]
    plans.clear()
    head_call(inputs, gspo, "triton", memory_budget=fits + (longest - 1) * 4 * V)
    head_call(inputs, gspo, "triton", grad_in_forward=False)
    top = next(c for c in CASES if c.id == "top-entropy")
    head_call(make_inputs(top, hidden_size=HIDDEN, seed=2), top, "triton")
    assert [p for p, _ in _paths(plans)] == ["light"] * 3


def test_memory_budget_selects_the_path_and_sizes_the_chunks(knobs, plans, monkeypatch):
    """Default budget: fast path in one chunk; a budget with room for 5 rows beside the accumulators: chunks of at
    most 5 rows, never above the budget; below min(N, fast_path_min_rows) rows: the light path, within the budget."""
    import grpo_kernels.kernels.linear_epilogue_kernels as epilogue
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=5)
    N, V = int(inputs["mask"].sum()), 37
    chunks = []
    real_alloc = epilogue.alloc
    monkeypatch.setattr(epilogue, "alloc", lambda shape, *a: (chunks.append(tuple(shape)), real_alloc(shape, *a))[1])
    head_call(inputs, case, "triton")
    assert _paths(plans)[-1] == ("fast", N)
    knobs(fast_path_min_rows=4)
    chunks.clear()
    budget = fast_path_budget(inputs, case, 5) + 3
    plans.clear()
    head_call(inputs, case, "triton", memory_budget=budget)
    assert _paths(plans)[-1][0] == "fast" and _paths(plans)[-1][1] <= 5 and plans[-1].transient_bytes <= budget
    assert max(r * c for r, c in (s for s in chunks if len(s) == 2 and s[1] == V)) <= 5 * V
    budget = fast_path_budget(inputs, case, 3)
    plans.clear()
    head_call(inputs, case, "triton", memory_budget=budget)
    assert _paths(plans)[-1][0] == "light" and plans[-1].transient_bytes <= budget
    with pytest.raises(ValueError, match="memory_budget"):
        head_call(inputs, case, "triton", memory_budget=64)


def test_light_path_chunk_and_no_half_precision_dh_temporary(monkeypatch, plans):
    """The deterministic light backward: its d-logits chunk stays within the plan (one BLOCK_V-wide column block at
    least), the fp32 dh accumulator is the only (N, H) scratch, and the plan's figure stays within the budget."""
    import grpo_kernels.kernels.linear_backward_kernels as lbk
    case = next(c for c in CASES if c.id == "dapo-token")
    inputs = make_inputs(case, B=3, T=5, V=300, hidden_size=40, dtype=torch.bfloat16, seed=4)
    N_valid = int(inputs["mask"].sum())
    allocs = []
    real_alloc = lbk.alloc
    monkeypatch.setattr(lbk, "alloc", lambda shape, *a: (allocs.append(tuple(shape)), real_alloc(shape, *a))[1])
    budget = _light_budget(inputs, case, 64)
    loss, grads, _ = head_call(inputs, case, "triton", grad_in_forward=False, memory_budget=budget)
    assert plans[-1].path == "head.light" and plans[-1].transient_bytes <= budget and plans[-1].row_block == N_valid
    dl = [s for s in allocs if s[0] == N_valid and s[1] not in (40,)]
    assert dl and all(r * c * 2 <= N_valid * 64 * 2 for r, c in dl), dl
    assert allocs.count((N_valid, 40)) == 1, "one (N, H) buffer: the returned d hidden, no half temporary"
    assert_head_three_way((loss, grads), head_same_dtype(inputs, case.config), linear_truth(inputs, case.config),
                          torch.bfloat16, "light")


def test_light_path_row_blocks_when_the_dh_accumulator_does_not_fit(plans):
    """A budget below the fp32 d hidden of every row: the backward runs in row blocks, each within the budget, and
    the gradients still match float64 (d weight summed over the blocks)."""
    case = next(c for c in CASES if c.id == "dapo-token")
    inputs = make_inputs(case, B=4, T=6, V=300, hidden_size=40, dtype=torch.bfloat16, seed=11)
    n_valid = int(inputs["mask"].sum())
    full = head_plan(inputs, case, grad_in_forward=False)
    backward = ("d logits chunk", "fp32 d hidden of a row block", "fp32 d bias")
    fixed = sum(b for what, b in full.transient if what not in backward)
    rows = n_valid // 3
    budget = fixed + 4 * rows * 40 + rows * 64 * 2  # the fp32 d hidden of a third of the rows, 64-column chunks
    plans.clear()
    loss, grads, _ = head_call(inputs, case, "triton", grad_in_forward=False, memory_budget=budget)
    plan = plans[-1]
    assert plan.path == "head.light" and plan.row_block < n_valid and plan.transient_bytes <= budget
    assert_head_three_way((loss, grads), head_same_dtype(inputs, case.config), linear_truth(inputs, case.config),
                          torch.bfloat16, "light, row blocks")


@pytest.mark.parametrize("grad_in_forward", [True, False], ids=["grad-in-forward", "light"])
def test_frozen_head_does_no_weight_work(grad_in_forward, monkeypatch):
    """weight.requires_grad False: no dW GEMM (fast path) and no dW matmul (light path); d hidden still right."""
    import grpo_kernels.kernels.linear_backward_kernels as lbk
    import grpo_kernels.kernels.linear_epilogue_kernels as epilogue
    calls, light_needs = [], []
    real, real_bwd = epilogue.addmm_f32_, lbk.linear_logprobs_backward
    monkeypatch.setattr(epilogue, "addmm_f32_", lambda acc, a, b: (calls.append(acc.shape), real(acc, a, b))[1])
    monkeypatch.setattr(lbk, "linear_logprobs_backward",
                        lambda *a, **k: (light_needs.append(tuple(a[6])), real_bwd(*a, **k))[1])
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=6)
    h = inputs["hidden"].clone().requires_grad_(True)
    w = inputs["weight"].clone()
    loss, _ = gk.fused_linear_grpo_loss(h, w, inputs["ids"], inputs["advantages"], inputs["mask"],
                                        config=case.config, impl="triton", grad_in_forward=grad_in_forward,
                                        **optional_inputs(inputs))
    loss.backward()
    assert w.grad is None and not [s for s in calls if tuple(s) == tuple(w.shape)]
    # the light path's backward is asked for d hidden only (its d weight GEMM is then never run)
    assert light_needs == ([] if grad_in_forward else [(True, False, False)])
    _, t_grads, _ = linear_truth(inputs, case.config, dtype=torch.float64)
    _, n_grads, _ = linear_truth(inputs, case.config, dtype=torch.float32)
    assert_three_way(h.grad, n_grads[0], t_grads[0], torch.float32, "d hidden", scale=grad_scale(t_grads[0]))


@pytest.mark.parametrize("where", ["hidden", "weight"])
@pytest.mark.parametrize("grad_in_forward,case_id", [(True, "grpo-token"), (True, "sapo-token"),
                                                     (True, "grpo-sequence"), (False, "grpo-sequence")])
def test_nan_at_a_valid_row_reaches_the_loss(where, grad_in_forward, case_id):
    """A NaN at a valid row (advantage 0 there: the policy term alone would drop it) makes the loss NaN."""
    case = next(c for c in CASES if c.id == case_id)
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=7)
    hidden, weight = inputs["hidden"].clone(), inputs["weight"].clone()
    inputs["advantages"][0] = 0.0
    inputs["mask"][0, 0] = True
    if where == "hidden":
        hidden[0, 0, 3] = float("nan")
    else:
        weight[5, 2] = float("nan")
    loss, _ = gk.fused_linear_grpo_loss(hidden, weight, inputs["ids"], inputs["advantages"], inputs["mask"],
                                        config=case.config, impl="triton", grad_in_forward=grad_in_forward,
                                        **optional_inputs(inputs))
    assert torch.isnan(loss)


def test_grad_in_forward_is_bitwise_reproducible_and_scales_by_grad_output(knobs):
    knobs(fast_path_min_rows=1)
    case = next(c for c in CASES if c.id == "is-ratio-token")
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=8, dtype=torch.bfloat16)
    runs = [head_call(inputs, case, "triton", memory_budget=fast_path_budget(inputs, case, 4)) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)
    h = inputs["hidden"].clone().float().requires_grad_(True)
    loss, _ = gk.fused_linear_grpo_loss(h, inputs["weight"].float(), inputs["ids"], inputs["advantages"],
                                        inputs["mask"], config=case.config, impl="triton", **optional_inputs(inputs))
    (g1,) = torch.autograd.grad(loss, h, retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_in_forward=False"):
        torch.autograd.grad(loss, h)  # the gradients were handed out (scaled in place) by the first backward
    loss3, _ = gk.fused_linear_grpo_loss(h, inputs["weight"].float(), inputs["ids"], inputs["advantages"],
                                         inputs["mask"], config=case.config, impl="triton", **optional_inputs(inputs))
    (g3,) = torch.autograd.grad(3.0 * loss3, h)
    # grad_output scales the finished fp32 gradient (one multiplication, rounded once, as 3.0 * g1 is): the same bits
    assert torch.equal(g3, 3.0 * g1)


def test_no_grad_logprobs_use_gemm_and_fold_in_several_chunks(monkeypatch, knobs):
    """linear_token_logprobs under no_grad: row chunks of fp32 logits + the fold kernel, vs float64."""
    import grpo_kernels.kernels.linear_epilogue_kernels as epilogue
    knobs(no_grad_chunk_cap=3 * 4 * 41)
    seen = []
    real = epilogue.fold_chunk
    monkeypatch.setattr(epilogue, "fold_chunk", lambda z, *a: (seen.append(z.shape[0]), real(z, *a))[1])
    g = torch.Generator().manual_seed(9)
    h, w, b = torch.randn(7, 16, generator=g), torch.randn(41, 16, generator=g) / 3, torch.randn(41, generator=g)
    b[4] = float("-inf")  # a banned token
    ids = torch.randint(0, 41, (7,), generator=g) % 4
    with torch.no_grad():
        logp, ent = gk.linear_token_logprobs(h, w, ids, bias=b, temperature=0.8, return_entropy=True, impl="triton")
    assert seen and max(seen) <= 3 and sum(seen) == 7
    t_logp, t_ent = logprobs_and_entropy(h.double() @ w.double().T + b.double(), ids, 0.8)
    n_logp, n_ent = naive_logprobs_entropy(h @ w.T + b, ids, 0.8)
    assert_three_way(logp, n_logp, t_logp, torch.float32, "logp")
    assert_three_way(ent, n_ent, t_ent, torch.float32, "entropy")
