"""Packed sequences (docs/api.md, "Packed sequences"): a packed call (N tokens of S sequences in one row,
``cu_seqlens``) gives the padded (S, Tmax) call's loss, metrics and gradients on the same tokens, for every loss
type and option; bad ``cu_seqlens`` raise a ValueError naming it.

Packing a padded batch: sequence s keeps its first ``kept[s]`` positions (its valid tokens, and for some sequences
a few unscored ones after them, mask 0 in the packed row too); the rest of its row is padding, dropped. Ragged
lengths with a 1-token sequence, a sequence whose tokens are all unscored and an empty one."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import logprobs_and_entropy, loss_from_logps

from ..support.cases import CASES, make_inputs
from ..support.tolerances import gamma

PER_TOKEN = ("old_logps", "ref_logps", "sampling_logps")


def packing(mask: torch.Tensor, extra=(0, 2, 1, 0, 3)):
    """(kept lengths (S,), cu_seqlens (S + 1,), flat positions (N,) of the kept tokens in the (S, T) grid)."""
    S, T = mask.shape
    valid = mask.sum(-1)
    kept = torch.clamp(valid + torch.tensor(extra[:S]), max=T)
    cu = torch.zeros(S + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(kept, 0)
    positions = torch.cat([torch.arange(int(k)) + s * T for s, k in enumerate(kept.tolist())])
    return kept, cu, positions


def packed_inputs(inputs: dict, positions, cu, V=None):
    """The padded inputs' kept tokens in one packed row (advantages and a per-row is_ratio per sequence)."""
    flat = lambda t: t.reshape(-1, *t.shape[2:]).index_select(0, positions)  # noqa: E731
    out = {"cu_seqlens": cu, "advantages": inputs["advantages"], "ids": flat(inputs["ids"]),
           "mask": flat(inputs["mask"])}
    for k in ("logits", "hidden") + PER_TOKEN:
        if k in inputs:
            out[k] = flat(inputs[k])
    if "is_ratio" in inputs:
        isr = inputs["is_ratio"]
        out["is_ratio"] = isr if isr.dim() == 1 else flat(isr)
    for k in ("num_items_in_batch", "weight"):
        if k in inputs:
            out[k] = inputs[k]
    return out


def _config(case, T):
    cfg = case.config
    if cfg.loss_type == "dr_grpo" and cfg.max_completion_length is None:
        cfg = cfg.replace(max_completion_length=T)  # the padded call's default, which a packed one must be given
    return cfg


def _padded_batch(case, extra, seed=0):
    inputs = make_inputs(case, B=5, T=7, V=37, dtype=torch.float64, seed=seed)
    kept, cu, positions = packing(inputs["mask"], extra)
    if "is_ratio" in inputs and inputs["is_ratio"].dim() == 2:
        # TRL pads is_ratio with 1 (vespo folds every position of a padded row, and log 1 = 0)
        beyond = torch.arange(7).unsqueeze(0) >= kept.unsqueeze(1)
        inputs["is_ratio"] = torch.where(beyond, 1.0, inputs["is_ratio"].double())
    return inputs, kept, cu, positions


REFERENCE_CASES = [c for c in CASES if not c.adv_2d]


@pytest.mark.parametrize("extra", [(0, 2, 1, 0, 3), (0, 0, 0, 0, 0)], ids=["unscored-tokens", "valid-only"])
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: c.id)
def test_reference_packed_equals_padded(case, extra):
    """The eager reference, float64: loss, metrics, d logp and d entropy at the kept tokens (exact up to the
    order of float64 sums: ``_close``'s derived bound)."""
    inputs, kept, cu, positions = _padded_batch(case, extra)
    cfg = _config(case, 7)
    logp, ent = logprobs_and_entropy(inputs["logits"], inputs["ids"], cfg.temperature)
    logp, ent = logp.detach().requires_grad_(True), ent.detach().requires_grad_(True)
    rest = {k: inputs[k] for k in PER_TOKEN + ("is_ratio", "num_items_in_batch") if k in inputs}
    loss, metrics = loss_from_logps(logp, inputs["advantages"], inputs["mask"], entropy=ent, config=cfg, **rest)
    g_logp, g_ent = torch.autograd.grad(loss, [logp, ent], allow_unused=True)
    packed = packed_inputs(inputs, positions, cu)
    p_logp = logp.detach().reshape(-1)[positions].requires_grad_(True)
    p_ent = ent.detach().reshape(-1)[positions].requires_grad_(True)
    p_rest = {k: packed[k] for k in PER_TOKEN + ("is_ratio", "num_items_in_batch") if k in packed}
    p_loss, p_metrics = loss_from_logps(p_logp, packed["advantages"], packed["mask"], entropy=p_ent, config=cfg,
                                        cu_seqlens=cu, **p_rest)
    pg_logp, pg_ent = torch.autograd.grad(p_loss, [p_logp, p_ent], allow_unused=True)
    _close(p_loss, loss, p_metrics, metrics, pg_logp, g_logp.reshape(-1)[positions], torch.float64)
    if g_ent is not None:
        _close_relative(pg_ent, g_ent.reshape(-1)[positions], torch.float64)
    # the padding the packed call dropped gets no gradient in the padded one
    dropped = torch.ones(logp.numel(), dtype=torch.bool)
    dropped[positions] = False
    assert (g_logp.reshape(-1)[dropped] == 0).all()


# ------------------------------------------------------------------------------------------------ the functions

# (config case id, impl, grad_in_forward) -> the path the planner picks at these shapes (knobs below)
PATH_CASES = [("dapo-token", "triton", True), ("grpo-beta-kl", "triton", True), ("is-ratio-row", "triton", True),
              ("grpo-sequence", "triton", True), ("vespo-is-ratio", "triton", True),
              ("off-policy-mask", "triton", True), ("everything", "triton", True), ("bnpo-token", "triton", False),
              ("sapo-sequence", "triton", False), ("entropy-bonus", "torch", True), ("dr_grpo-token", "torch", True),
              ("luspo-sequence", "torch", True), ("cispo-token", "triton", True)]


def _case(case_id):
    return next(c for c in CASES if c.id == case_id)


def _rest(x):
    return {k: x[k] for k in PER_TOKEN + ("is_ratio", "num_items_in_batch") if k in x}


def _with_float64(cases):
    """Each case in fp32, and the PyTorch impl's ones in float64 too (the Triton kernels take fp32 / bf16 / fp16)."""
    return [(*c, torch.float32) for c in cases] + [(*c, torch.float64) for c in cases if c[1] == "torch"]


@pytest.mark.parametrize("case_id,impl,grad_in_forward,dtype", _with_float64(PATH_CASES), ids=lambda v: str(v))
def test_grpo_loss_packed_equals_padded(case_id, impl, grad_in_forward, dtype, plans):
    """grpo_loss on packed (N, V) logits against the padded (S, Tmax, V) call in the same dtype: the same path,
    loss, metrics and d logits at the kept tokens, to the rounding of sums taken in another order (``_close``)."""
    case = _case(case_id)
    inputs, kept, cu, positions = _padded_batch(case, (0, 2, 1, 0, 3), seed=1)
    inputs = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    cfg = _config(case, 7).replace(grad_in_forward=grad_in_forward)
    x = inputs["logits"].clone().requires_grad_(True)
    loss, metrics = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=cfg, impl=impl,
                                 **_rest(inputs))
    loss.backward()
    padded_path = plans[-1].path
    packed = packed_inputs(inputs, positions, cu)
    xp = packed["logits"].clone().requires_grad_(True)
    p_loss, p_metrics = gk.grpo_loss(xp, packed["ids"], packed["advantages"], packed["mask"], config=cfg, impl=impl,
                                     cu_seqlens=cu, **_rest(packed))
    p_loss.backward()
    assert plans[-1].path == padded_path
    _close(p_loss, loss, p_metrics, metrics, xp.grad, x.grad.reshape(-1, x.shape[-1])[positions], dtype)


# bound: sums in another order: n terms of magnitude <= m summed in two orders differ by at most 2 gamma(n) n m
#   (each within gamma(n) of the sum of |terms| <= n m), so a mean of them by 2 gamma(n) m; n <= 40 tokens here,
#   and the terms (log ratios ~0.3, advantages ~1, their products and exponentials) at most 1 + |value|, which
#   atol + rtol |value| covers; a gradient relative to its largest value
def _sum_order_slack(dtype) -> float:
    return 2 * gamma(40, dtype)


def _close(p_loss, loss, p_metrics, metrics, p_grad, grad, dtype=torch.float32):
    """Loss, metrics and a gradient of two calls whose sums run in another order (``_sum_order_slack``)."""
    tol = dict(rtol=_sum_order_slack(dtype), atol=_sum_order_slack(dtype))
    torch.testing.assert_close(p_loss, loss, **tol)
    assert set(p_metrics) == set(metrics)
    for k in metrics:
        torch.testing.assert_close(p_metrics[k], metrics[k], msg=k, **tol)
    _close_relative(p_grad, grad, dtype)


def _close_relative(p_grad, grad, dtype):
    """Relative to the gradient's largest value (``_sum_order_slack``)."""
    slack = _sum_order_slack(dtype)
    scale = grad.abs().max().clamp(min=1e-30)
    torch.testing.assert_close(p_grad / scale, grad / scale, rtol=slack, atol=slack)


HEAD_CASES = [("dapo-token", "triton", True), ("grpo-beta-kl", "triton", True), ("grpo-sequence", "triton", True),
              ("vespo-is-ratio", "triton", True), ("top-entropy", "triton", True), ("bnpo-token", "triton", False),
              ("is-ratio-row", "torch", True), ("sapo-sequence", "torch", True), ("dr_grpo-token", "triton", True),
              ("off-policy-mask", "triton", True)]


@pytest.mark.parametrize("case_id,impl,grad_in_forward,dtype", _with_float64(HEAD_CASES), ids=lambda v: str(v))
def test_fused_linear_loss_packed_equals_padded(case_id, impl, grad_in_forward, dtype, plans, knobs):
    """fused_linear_grpo_loss on packed (N, H) hidden states against the padded (S, Tmax, H) call: same path,
    loss, metrics, d hidden at the kept tokens and d weight."""
    knobs(fast_path_min_rows=1)
    case = _case(case_id)
    g = torch.Generator().manual_seed(2)
    inputs, kept, cu, positions = _padded_batch(case, (0, 2, 1, 0, 3), seed=2)
    inputs = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    inputs["hidden"] = torch.randn(5, 7, 16, generator=g).to(dtype)
    inputs["weight"] = (torch.randn(37, 16, generator=g) / 4).to(dtype)
    cfg = _config(case, 7).replace(grad_in_forward=grad_in_forward)
    h, w = inputs["hidden"].clone().requires_grad_(True), inputs["weight"].clone().requires_grad_(True)
    loss, metrics = gk.fused_linear_grpo_loss(h, w, inputs["ids"], inputs["advantages"], inputs["mask"], config=cfg,
                                              impl=impl, **_rest(inputs))
    loss.backward()
    padded_path = plans[-1].path
    packed = packed_inputs(inputs, positions, cu)
    hp, wp = packed["hidden"].clone().requires_grad_(True), inputs["weight"].clone().requires_grad_(True)
    p_loss, p_metrics = gk.fused_linear_grpo_loss(hp, wp, packed["ids"], packed["advantages"], packed["mask"],
                                                  config=cfg, impl=impl, cu_seqlens=cu, **_rest(packed))
    p_loss.backward()
    assert plans[-1].path == padded_path
    _close(p_loss, loss, p_metrics, metrics, hp.grad, h.grad.reshape(-1, 16)[positions], dtype)
    _close_relative(wp.grad, w.grad, dtype)  # d weight: sums over the N <= 40 tokens in another order


def test_no_sequence_by_length_tensor_on_the_packed_path(knobs):
    """No (S, Tmax)-shaped tensor is made by a packed call (a dispatch mode records every op's output shapes):
    with S = 5 and Tmax = 17 chosen apart from every other size (N = 26, 21 valid, V = 37, H = 8, 2S + 1 = 11), no
    shape with a 17 may appear."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.seen.add(tuple(t.shape))
            return out

    knobs(fast_path_min_rows=1)
    g = torch.Generator().manual_seed(3)
    lengths = [17, 1, 4, 0, 4]
    cu = torch.tensor([0, 17, 18, 22, 22, 26])
    N = 26
    ids, mask = torch.randint(0, 37, (N,), generator=g), torch.ones(N, dtype=torch.bool)
    mask[[0, 1, 5, 20, 25]] = False
    adv, old = torch.randn(5, generator=g), torch.randn(N, generator=g) - 3
    for cfg in ({"loss_type": "grpo"}, {"loss_type": "grpo", "importance_sampling_level": "sequence"},
                {"loss_type": "vespo"}, {"loss_type": "dapo", "top_entropy_quantile": 0.5}):
        for impl in ("triton", "torch"):
            mode = Shapes()
            with mode:
                x = torch.randn(N, 37, generator=g).requires_grad_(True)
                gk.grpo_loss(x, ids, adv, mask, old_logps=old, impl=impl, cu_seqlens=cu, **cfg)[0].backward()
                h = torch.randn(N, 8, generator=g).requires_grad_(True)
                w = torch.randn(37, 8, generator=g).requires_grad_(True)
                gk.fused_linear_grpo_loss(h, w, ids, adv, mask, old_logps=old, impl=impl, cu_seqlens=cu,
                                          **cfg)[0].backward()
            assert not [s for s in mode.seen if 17 in s], (cfg, impl, sorted(mode.seen))
    assert sum(lengths) == N


BAD_CU = {
    "not-from-0": (torch.tensor([1, 3, 6]), "cu_seqlens must start at 0"),
    "decreasing": (torch.tensor([0, 4, 3]), "cu_seqlens must be non-decreasing"),
    "last-not-N": (torch.tensor([0, 3, 5]), "cu_seqlens must end at the number of packed tokens N = 6"),
    "float": (torch.tensor([0.0, 3.0, 6.0]), "cu_seqlens must be an int32 or int64 tensor"),
    "S-mismatch": (torch.tensor([0, 2, 4, 6]), r"cu_seqlens must have shape \(S \+ 1,\) = \(3,\)"),
    "2-d": (torch.tensor([[0, 3, 6]]), r"cu_seqlens must have shape"),
}


@pytest.mark.parametrize("name", list(BAD_CU))
@pytest.mark.parametrize("fn", ["grpo_loss", "fused_linear_grpo_loss"])
def test_bad_cu_seqlens_is_named(fn, name):
    cu, message = BAD_CU[name]
    ids, adv = torch.zeros(6, dtype=torch.long), torch.zeros(2)
    with pytest.raises(ValueError, match=message):
        if fn == "grpo_loss":
            gk.grpo_loss(torch.randn(6, 5), ids, adv, cu_seqlens=cu)
        else:
            gk.fused_linear_grpo_loss(torch.randn(6, 4), torch.randn(5, 4), ids, adv, cu_seqlens=cu)


def test_packed_shapes_and_dr_grpo_are_checked():
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match=r"advantages must have shape \(S,\)"):
        gk.grpo_loss(torch.randn(6, 5), torch.zeros(6, dtype=torch.long), torch.zeros(2, 3), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"old_logps must have shape \(6,\)"):
        gk.grpo_loss(torch.randn(6, 5), torch.zeros(6, dtype=torch.long), torch.zeros(2), cu_seqlens=cu,
                     old_logps=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="max_completion_length"):
        gk.grpo_loss(torch.randn(6, 5), torch.zeros(6, dtype=torch.long), torch.zeros(2), cu_seqlens=cu,
                     loss_type="dr_grpo")


def test_explain_shows_a_packed_plan():
    cu = torch.tensor([0, 2, 6], device="meta")
    text = gk.explain(torch.randn(6, 8, device="meta"), torch.randn(37, 8, device="meta"),
                      torch.zeros(6, dtype=torch.long, device="meta"), torch.zeros(2, device="meta"), cu_seqlens=cu)
    assert "packed: 2 sequences over 6 tokens" in text
