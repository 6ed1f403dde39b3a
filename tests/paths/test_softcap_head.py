"""Soft-capped logits (Gemma 2's ``final_logit_softcapping``) on every Triton path of the fused head: head.fast,
head.fast_sequence, head.light (deterministic through the tile kernel or through GEMM logits + the row epilogue,
and atomic), head.no_grad, and ``linear_token_logprobs`` with and without gradients.

Ground truth: the float64 reference on full logits ``h @ W.T + b`` with ``config.softcap`` (``reference.soft_cap``:
``z = c tanh(x / c) / temperature``), gradients by autograd; the pass rule is the three-way one
(tests/support/tolerances.py) with a same-dtype PyTorch term that applies the cap too. The kernels run under
TRITON_INTERPRET=1 (conftest.py) with poisoned outputs; V = 37 crosses the interpreter's row block (16) and tile (32)
boundaries.

Semantics pinned here (docs/numerics.md, "Soft-capped logits"): a raw logit of -inf (a -inf bias entry, a "banned"
token) is capped to -c like ``torch.tanh`` does, i.e. a finite logit with a small probability and a zero gradient
through the cap, not probability 0; the kernels agree with the reference on it.
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.explain import plan_call
from grpo_kernels.reference import logprobs_and_entropy, loss_from_logps, reference_grpo_loss, soft_cap

from ..support.tolerances import assert_three_way, grad_scale, naive_logprobs_entropy

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_outputs")]

B, T, H, V = 3, 5, 16, 37
CAP = 2.5  # raw logits have a standard deviation of ~2: the cap bends most of them (tanh(1) = 0.76)
TEMPERATURE = 0.8
BANNED = 5  # the bias entry set to -inf


@pytest.fixture
def launched(monkeypatch):
    """Names of the Triton kernels launched by the fused head's kernel modules during the test."""
    from grpo_kernels.kernels import linear_backward_kernels, linear_epilogue_kernels, linear_forward_kernels
    names = []
    for module in (linear_backward_kernels, linear_epilogue_kernels, linear_forward_kernels):
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda kernel, *a, _real=real, **k: (
            names.append(getattr(kernel, "__name__", getattr(getattr(kernel, "fn", None), "__name__", "?"))),
            _real(kernel, *a, **k))[1])
    return names


def make_batch(seed: int = 0, scale: float = 1.0) -> dict:
    """float64 inputs (cast by the tests): a ragged mask with a fully masked row, a token whose id is the banned
    one at a valid position, both signs of advantages, old / ref log-probs near the policy's."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64) * 0.7 * scale
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    bias[BANNED] = float("-inf")
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, 1] = BANNED
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    logp, _ = logprobs_and_entropy(hidden @ weight.T + bias, ids, TEMPERATURE, CAP)
    return {"hidden": hidden, "weight": weight, "bias": bias, "ids": ids, "mask": mask,
            "advantages": torch.tensor([0.7, -0.4, -1.1], dtype=torch.float64),
            "old_logps": (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float(),
            "ref_logps": (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()}


def _config(**overrides) -> GRPOLossConfig:
    base = dict(loss_type="grpo", beta=0.04, entropy_coef=0.03, temperature=TEMPERATURE, softcap=CAP)
    return GRPOLossConfig(**{**base, **overrides})


def _leaves(x: dict, dtype, trainable: bool = True):
    h = x["hidden"].to(dtype).requires_grad_(True)
    w = x["weight"].to(dtype).requires_grad_(trainable)
    b = x["bias"].to(dtype).requires_grad_(trainable)
    return h, w, b


def _loss_rest(x: dict, dtype=None) -> dict:
    return {k: x[k] if dtype is None else x[k].to(dtype) for k in ("old_logps", "ref_logps")}


def truth_loss(x: dict, cfg: GRPOLossConfig, trainable: bool = True):
    """(loss, metrics, grads of hidden[, weight, bias]) from the float64 reference on full logits."""
    h, w, b = _leaves(x, torch.float64, trainable)
    loss, metrics = reference_grpo_loss(h @ w.T + b, x["ids"], x["advantages"], x["mask"], config=cfg,
                                        **_loss_rest(x, torch.float64))
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t.requires_grad])
    return loss.detach(), metrics, grads


def d_hidden_without_cap_derivative(x: dict, cfg: GRPOLossConfig) -> torch.Tensor:
    """float64 d hidden of a head that forgets the cap's derivative (d loss / d capped logits, times W): the bug the
    tests must catch."""
    from dataclasses import replace
    h, w, b = _leaves(x, torch.float64)
    y = soft_cap(h @ w.T + b, cfg.softcap).detach().requires_grad_(True)
    loss, _ = reference_grpo_loss(y, x["ids"], x["advantages"], x["mask"], config=replace(cfg, softcap=None),
                                  **_loss_rest(x, torch.float64))
    (dy,) = torch.autograd.grad(loss, y)
    return dy @ w.detach()


def same_dtype_loss(x: dict, cfg: GRPOLossConfig, dtype, with_metrics=False):
    """The middle term of the three-way rule: plain PyTorch in ``dtype``, the cap included (reference.soft_cap on
    the dtype's logits), log-softmax in ``dtype``, then the reference loss stage; (loss, grads[, metrics])."""
    h, w, b = _leaves(x, dtype)
    logp, entropy = naive_logprobs_entropy(h @ w.T + b, x["ids"], cfg.temperature, cfg.softcap)
    loss, metrics = loss_from_logps(logp, x["advantages"].float(), x["mask"], entropy=entropy, config=cfg,
                                    **_loss_rest(x))
    grads = torch.autograd.grad(loss, (h, w, b))
    return (loss.detach(), grads, metrics) if with_metrics else (loss.detach(), grads)


def ours_loss(x: dict, cfg: GRPOLossConfig, dtype, trainable: bool = True, **kw):
    h, w, b = _leaves(x, dtype, trainable)
    loss, metrics = gk.fused_linear_grpo_loss(h, w, x["ids"], x["advantages"].float(), x["mask"], bias=b,
                                              config=cfg, impl="triton", **_loss_rest(x), **kw)
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t.requires_grad])
    return loss.detach(), metrics, grads


def _fast_budget(x: dict, cfg: GRPOLossConfig, dtype, rows: int) -> int:
    """A memory_budget leaving room for fp32 logits chunks of ``rows`` rows on the fast path (the planner's own
    figures, from ``plan_call``)."""
    h, w, b = _leaves(x, dtype)
    plan = plan_call(gk.fused_linear_grpo_loss, h, w, x["ids"], x["advantages"].float(), x["mask"], bias=b,
                     config=cfg, impl="triton", **_loss_rest(x))
    assert plan.path in ("head.fast", "head.fast_sequence"), plan.path
    return plan.transient_bytes - dict(plan.transient)["fp32 logits chunk (d logits written in place)"] + rows * 4 * V


# path id -> (config overrides, testing knobs, extra call arguments, path the planner must take, kernels that must run)
PATHS = {
    "fast": ({}, dict(fast_path_min_rows=1), {"rows": 4}, "head.fast", {"head_loss_grad_kernel"}),
    "fast_sequence": (dict(importance_sampling_level="sequence"), dict(fast_path_min_rows=1), {"rows": 5},
                      "head.fast_sequence", {"head_fold_kernel", "head_dlogits_kernel"}),
    # chunk_bytes: 9 valid rows x 32 columns of bf16 (fp32: one 32-column tile block), so V = 37 takes two chunks
    "light_tiles": (dict(grad_in_forward=False), dict(dlogits_by_gemm=False, chunk_bytes=9 * 32 * 2), {},
                    "head.light", {"linear_fwd_partial_kernel", "linear_dlogits_kernel"}),
    "light_gemm": (dict(grad_in_forward=False), dict(dlogits_by_gemm=True, chunk_bytes=9 * 32 * 2), {},
                   "head.light", {"linear_fwd_partial_kernel", "head_dlogits_kernel"}),
    "light_atomic": (dict(grad_in_forward=False, deterministic=False), {}, {}, "head.light",
                     {"linear_fwd_partial_kernel", "linear_bwd_atomic_kernel"}),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("path", PATHS)
def test_every_head_path_applies_the_cap(path, dtype, knobs, plans, launched):
    """Loss, entropy metric and d hidden / d weight / d bias of each Triton path against float64, with temperature
    0.8, an entropy bonus, KL, a -inf bias entry (one target is that token), a padded tail and a fully masked row;
    several vocab chunks (light) or row chunks (fast)."""
    overrides, knob_values, extra, expected, kernels = PATHS[path]
    knobs(**knob_values)
    x = make_batch(seed=1)
    cfg = _config(**overrides)
    kw = {}
    if "rows" in extra:
        kw["memory_budget"] = _fast_budget(x, cfg, dtype, extra["rows"])
    plans.clear()
    loss, metrics, grads = ours_loss(x, cfg, dtype, **kw)
    assert [p.path for p in plans] == [expected]
    assert kernels <= set(launched), launched
    t_loss, t_metrics, t_grads = truth_loss(x, cfg)
    d_loss, d_grads, d_metrics = same_dtype_loss(x, cfg, dtype, with_metrics=True)
    assert_three_way(loss, d_loss, t_loss, dtype, "loss")
    assert_three_way(metrics["entropy"], d_metrics["entropy"], t_metrics["entropy"], dtype, "entropy")
    for name, g, d, t in zip(("d hidden", "d weight", "d bias"), grads, d_grads, t_grads):
        assert g.dtype == dtype, name
        assert_three_way(g, d, t, dtype, name, scale=grad_scale(t))
    assert torch.all(grads[0][~x["mask"]] == 0), "padded rows get exact zeros"
    # the cap's derivative at a -inf raw logit is 0: tanh(-inf) = -1 exactly, so y = -c and 1 - (y / c)^2 = 0 in any
    # precision; the float64 truth has it exactly too
    assert grads[2][BANNED] == 0 and t_grads[2][BANNED] == 0
    # the test can fail: d hidden with the cap's derivative dropped is far outside the tolerance above
    dropped = d_hidden_without_cap_derivative(x, cfg)
    # bound: not a tolerance: a dropped derivative moves d hidden by O(itself), the three-way bound is ~1e-5
    assert ((dropped - t_grads[0]).abs().max() / t_grads[0].abs().max()).item() > 0.05


@pytest.mark.parametrize("path", ["fast", "light_tiles"])
def test_frozen_head_gets_d_hidden_through_the_cap(path, knobs, plans):
    """weight and bias without grad: d hidden alone, equal to float64 (fp32)."""
    overrides, knob_values, extra, expected, _ = PATHS[path]
    knobs(**knob_values)
    x = make_batch(seed=2)
    cfg = _config(**overrides, loss_type="dapo")
    plans.clear()
    loss, _, (dh,) = ours_loss(x, cfg, torch.float32, trainable=False)
    assert plans[-1].path == expected
    t_loss, _, (t_dh,) = truth_loss(x, cfg, trainable=False)
    d_loss, (d_dh, _, _) = same_dtype_loss(x, cfg, torch.float32)
    assert_three_way(loss, d_loss, t_loss, torch.float32, "loss")
    assert_three_way(dh, d_dh, t_dh, torch.float32, "d hidden", scale=grad_scale(t_dh))


@pytest.mark.parametrize("path", ["fast", "fast_sequence", "light_atomic"])
def test_logits_far_beyond_the_cap(path, knobs, plans):
    """Raw logits up to ~1e3 with the cap at 2.5 (|x| >> c: tanh saturates, its derivative underflows to ~0):
    finite results equal to float64, no overflow in the cap's exponential."""
    overrides, knob_values, *_ = PATHS[path]
    knobs(**knob_values)
    x = make_batch(seed=3, scale=200.0)
    assert (x["hidden"] @ x["weight"].T).abs().max() > 500
    cfg = _config(**overrides)
    loss, _, grads = ours_loss(x, cfg, torch.float32)
    t_loss, _, t_grads = truth_loss(x, cfg)
    d_loss, d_grads = same_dtype_loss(x, cfg, torch.float32)
    assert_three_way(loss, d_loss, t_loss, torch.float32, "loss")
    for name, g, d, t in zip(("d hidden", "d weight", "d bias"), grads, d_grads, t_grads):
        assert_three_way(g, d, t, torch.float32, name, scale=grad_scale(t))


@pytest.mark.parametrize("path", ["fast", "fast_sequence", "light_tiles"])
def test_nan_at_a_valid_row_reaches_the_loss(path, knobs):
    """NaN hidden at a valid row: the capped logit is NaN (tanh does not hide it), so the loss is NaN."""
    overrides, knob_values, *_ = PATHS[path]
    knobs(**knob_values)
    x = make_batch(seed=4)
    x["hidden"][2, 3, 0] = float("nan")
    loss, _, _ = ours_loss(x, _config(**overrides), torch.float32)
    assert torch.isnan(loss)


def _logprob_truth(x, grad_logp, grad_entropy, dtype=torch.float64):
    """(logp, entropy, grads of a weighted sum) of the capped logits on full logits: the reference in float64 (the
    truth), plain PyTorch in fp32 (the middle term of the three-way rule)."""
    h, w, b = _leaves(x, dtype)
    if dtype == torch.float64:
        logp, ent = logprobs_and_entropy(h @ w.T + b, x["ids"], TEMPERATURE, CAP)
    else:
        logp, ent = naive_logprobs_entropy(h @ w.T + b, x["ids"], TEMPERATURE, CAP)
    keep = x["mask"]
    grads = torch.autograd.grad((logp * grad_logp * keep).sum() + (ent * grad_entropy * keep).sum(), (h, w, b))
    return logp.detach() * keep, ent.detach() * keep, grads


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_linear_token_logprobs_with_grad(deterministic, plans, launched):
    """head.light for log-probs: logp and entropy of the capped logits, and the gradients of a weighted sum of both,
    against float64; rows outside ``mask`` are 0 and get no gradient."""
    x = make_batch(seed=5)
    g = torch.Generator().manual_seed(6)
    grad_logp, grad_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    h, w, b = _leaves(x, torch.float32)
    plans.clear()
    logp, ent = gk.linear_token_logprobs(h, w, x["ids"], bias=b, temperature=TEMPERATURE, return_entropy=True,
                                         impl="triton", mask=x["mask"], deterministic=deterministic, softcap=CAP)
    assert [p.path for p in plans] == ["head.light"]
    grads = torch.autograd.grad((logp * grad_logp).sum() + (ent * grad_ent).sum(), (h, w, b))
    assert ("linear_dlogits_kernel" if deterministic else "linear_bwd_atomic_kernel") in launched
    t_logp, t_ent, t_grads = _logprob_truth(x, grad_logp.double(), grad_ent.double())
    n_logp, n_ent, n_grads = _logprob_truth(x, grad_logp, grad_ent, torch.float32)
    assert_three_way(logp, n_logp, t_logp, torch.float32, "logp")
    assert_three_way(ent, n_ent, t_ent, torch.float32, "entropy")
    assert torch.all(logp[~x["mask"]] == 0) and torch.all(grads[0][~x["mask"]] == 0)
    for name, got, n, t in zip(("d hidden", "d weight", "d bias"), grads, n_grads, t_grads):
        assert_three_way(got, n, t, torch.float32, name, scale=grad_scale(t))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_linear_token_logprobs_no_grad(dtype, knobs, plans, launched):
    """head.no_grad (GEMM chunks of at most 3 rows + the fold kernel): capped log-probs and entropy against float64,
    the banned token's log-prob finite (its logit is -c); a NaN hidden row gives NaN for that token only."""
    knobs(no_grad_chunk_cap=3 * 4 * V)
    x = make_batch(seed=7)
    x["hidden"][2, 4, 1] = float("nan")
    h, w, b = (t.to(dtype) for t in (x["hidden"], x["weight"], x["bias"]))
    plans.clear()
    with torch.no_grad():
        logp, ent = gk.linear_token_logprobs(h, w, x["ids"], bias=b, temperature=TEMPERATURE, return_entropy=True,
                                             impl="triton", mask=x["mask"], softcap=CAP)
    assert [p.path for p in plans] == ["head.no_grad"] and plans[0].chunk_rows <= 3
    assert launched.count("head_fold_kernel") >= 3
    keep = x["mask"].clone()
    assert torch.isnan(logp[2, 4]) and torch.isnan(ent[2, 4])
    keep[2, 4] = False
    t_logp, t_ent = logprobs_and_entropy(h.double() @ w.double().T + b.double(), x["ids"], TEMPERATURE, CAP)
    # middle term: plain PyTorch in fp32 on the (exactly upcast) inputs, what the GEMM chunks + fold compute
    n_logp, n_ent = naive_logprobs_entropy(h.float() @ w.float().T + b.float(), x["ids"], TEMPERATURE, CAP)
    assert torch.isfinite(logp[0, 1]), "the banned token's logit is capped to -c, a finite log-prob"
    assert_three_way(logp[keep], n_logp[keep], t_logp[keep], torch.float32, "logp")
    assert_three_way(ent[keep], n_ent[keep], t_ent[keep], torch.float32, "entropy")
    assert torch.all(logp[~x["mask"]] == 0)


def test_a_new_cap_value_does_not_recompile():
    """softcap is a runtime fp32 argument: two cap values give the same compiled signature and constexprs (only
    the SOFTCAP flag, on or off, selects a variant)."""
    pytest.importorskip("tools.aot")
    from tools.aot import signature_of

    from grpo_kernels.kernels.launch import recording
    from grpo_kernels.kernels.linear_backward_kernels import linear_logprobs_backward
    from grpo_kernels.kernels.linear_epilogue_kernels import head_logprobs_chunked
    from grpo_kernels.kernels.linear_forward_kernels import linear_logprobs_forward
    from grpo_kernels.config import LogitTransform
    from grpo_kernels.inputs import LogprobGrads
    from grpo_kernels.kernels.linear_tiles import aot_inputs

    def signatures(softcap):
        hidden, weight, bias, ids = aot_inputs(torch.bfloat16, True)
        stats = torch.zeros(hidden.shape[0])
        with recording(90) as records:
            head_logprobs_chunked(hidden, weight, bias, ids, 0.7, softcap=softcap)
            linear_logprobs_forward(hidden, weight, bias, ids, 0.7, softcap=softcap)
            for deterministic in (True, False):
                linear_logprobs_backward(hidden, weight, bias, ids, LogprobGrads(stats, stats, stats, stats),
                                         LogitTransform(0.7, softcap), (True, True, True), deterministic)
        return [(r.kernel, signature_of(r.kernel, r.args, r.kwargs)) for r in records], records

    (on, on_records), (other, _), (off, _) = signatures(30.0), signatures(7.5), signatures(None)
    assert on == other
    assert [s for _, s in on] != [s for _, s in off]
    assert all(r.kwargs["SOFTCAP"] and r.kwargs["softcap"] == 30.0 for r in on_records if "SOFTCAP" in r.kwargs)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fused_module_caps_the_reference_log_probs_from_ref_input(impl):
    """FusedLinearGRPOLoss with ref_input (Liger's API: reference log-probs computed inside): the reference policy's
    log-probs get the same cap as the policy's, so the KL term compares two capped distributions."""
    g = torch.Generator().manual_seed(12)
    hidden, ref_hidden = torch.randn(2, B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    ids, adv = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
    cfg = _config(beta=0.5, loss_type="grpo")
    h = hidden.clone().requires_grad_(True)
    loss, _ = gk.FusedLinearGRPOLoss(cfg, impl=impl)(hidden=h, weight=weight, ids=ids, advantages=adv,
                                                     ref_input=ref_hidden)
    w64 = weight.double()
    ref, _ = logprobs_and_entropy(ref_hidden.double() @ w64.T, ids, cfg.temperature, cfg.softcap)
    truth, _ = reference_grpo_loss(hidden.double() @ w64.T, ids, adv, ref_logps=ref, config=cfg)
    uncapped_ref, _ = logprobs_and_entropy(ref_hidden.double() @ w64.T, ids, cfg.temperature)
    wrong, _ = reference_grpo_loss(hidden.double() @ w64.T, ids, adv, ref_logps=uncapped_ref, config=cfg)
    # bound: not a tolerance: an uncapped reference moves the KL term by O(beta)
    assert abs(truth.item() - wrong.item()) > 1e-2, "the test needs a cap that changes the reference log-probs"
    ref32, _ = logprobs_and_entropy(ref_hidden @ weight.T, ids, cfg.temperature, cfg.softcap)
    same, _ = reference_grpo_loss(hidden @ weight.T, ids, adv, ref_logps=ref32, config=cfg)  # the middle term, fp32
    assert_three_way(loss.detach(), same.detach(), truth, torch.float32, "loss with ref_input")


def test_torch_head_keeps_two_tiles_with_the_cap():
    """head.torch with the cap and the entropy bonus (its heaviest backward), several row tiles and a partial vocab
    tile: the traced transient memory is the plan's two tiles (planner.plan_head), not a third for the cap's
    derivative (torch_chunks.dlogits_)."""
    from grpo_kernels.paths import HEAD_TORCH

    from ..support.memory_trace import transient_peak

    g = torch.Generator().manual_seed(13)
    hidden = torch.randn(8, 8, 32, generator=g).requires_grad_(True)
    weight = (torch.randn(9000, 32, generator=g) * 0.3).requires_grad_(True)
    ids, adv = torch.randint(0, 9000, (8, 8), generator=g), torch.randn(8, generator=g)
    options = dict(config=_config(beta=0.0, entropy_coef=0.01), impl="torch", memory_budget=600_000)
    plan = plan_call(gk.fused_linear_grpo_loss, hidden, weight, ids, adv, **options)
    assert plan.path == HEAD_TORCH and plan.chunk_rows < 64

    def run():
        loss, metrics = gk.fused_linear_grpo_loss(hidden, weight, ids, adv, **options)
        loss.backward()
        return [loss, *metrics.values(), hidden.grad, weight.grad]
    traced = transient_peak(run)
    assert traced <= 1.10 * plan.transient_bytes, f"planned {plan.transient_bytes} B ({plan.transient}), traced {traced}"


def test_explain_says_where_the_cap_is_applied():
    """explain's plan names the cap and where it runs; without one there is no such line, and the cap changes no
    path or byte count."""
    hidden = torch.empty(4, 64, 32, device="meta", requires_grad=True)
    weight = torch.empty(1000, 32, device="meta", requires_grad=True)
    ids, adv = torch.zeros(4, 64, dtype=torch.long, device="meta"), torch.zeros(4, device="meta")
    capped, plain = plan_call(hidden, weight, ids, adv, softcap=30.0), plan_call(hidden, weight, ids, adv)
    assert any(n.startswith("soft cap 30: ") and "Triton kernels" in n for n in capped.notes)
    assert not any("soft cap" in n for n in plain.notes)
    assert (capped.path, capped.transient) == (plain.path, plain.transient)
    text = gk.explain(gk.token_logprobs, torch.zeros(2, 3, 50), torch.zeros(2, 3, dtype=torch.long), softcap=2.5,
                      impl="torch")
    assert "note: soft cap 2.5: " in text and "PyTorch chunk" in text
