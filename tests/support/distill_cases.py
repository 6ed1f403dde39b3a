"""The distillation tests' cases, inputs, calls and truths (tests/distill/): our two functions, the float64 reference
(``grpo_kernels.distill_reference``) and TRL 1.16's own ``ChunkedDivergenceFunction`` / ``_chunked_divergence_loss``
on their CPU path, with the three-way pass rule (``tolerances.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import grpo_kernels as gk
from grpo_kernels.distill_config import DistillLossConfig
from grpo_kernels.distill_reference import (divergence_from_logits, loss_from_divergence, model_logits,
                                            reference_token_divergence)
from grpo_kernels.sequences import Sequences

from .tolerances import assert_three_way, grad_scale

# Every transform at once: temperature, both scales, both soft caps (the student's tight enough to bend its logits).
ALL_OPTIONS = dict(temperature=0.7, student_logit_scale=1.6, student_softcap=2.5, teacher_logit_scale=0.6,
                   teacher_softcap=4.0)


@dataclass(frozen=True)
class DistillCase:
    """A configuration and whether both heads carry biases."""

    id: str
    cfg: DistillLossConfig
    bias: bool = False


CASES = [DistillCase("fwdkl", DistillLossConfig(beta=0.0)),
         DistillCase("revkl", DistillLossConfig(beta=1.0)),
         DistillCase("jsd-0.3", DistillLossConfig(beta=0.3)),
         DistillCase("jsd-0.5", DistillLossConfig(beta=0.5)),
         DistillCase("fwdkl-all", DistillLossConfig(beta=0.0, **ALL_OPTIONS), bias=True),
         DistillCase("revkl-all", DistillLossConfig(beta=1.0, **ALL_OPTIONS), bias=True),
         DistillCase("jsd-0.7-all", DistillLossConfig(beta=0.7, **ALL_OPTIONS), bias=True)]
CASE_IDS = [c.id for c in CASES]


def make_heads(shape=(2, 5), Hs: int = 8, Ht: int = 12, V: int = 37, dtype=torch.float32, seed: int = 0,
               bias: bool = False, masked: bool = True) -> dict:
    """Both heads' tensors (student and teacher of different widths) and a mask that drops a few tokens. The
    weights are scaled so that the logits spread over a few units (distributions neither flat nor one-hot)."""
    g = torch.Generator().manual_seed(seed)
    lead = tuple(shape)
    out = {"sh": torch.randn(*lead, Hs, generator=g), "sw": torch.randn(V, Hs, generator=g) * 0.8,
           "th": torch.randn(*lead, Ht, generator=g), "tw": torch.randn(V, Ht, generator=g) * 0.6,
           "sb": torch.randn(V, generator=g) * 0.5 if bias else None,
           "tb": torch.randn(V, generator=g) * 0.5 if bias else None}
    out = {k: None if v is None else v.to(dtype) for k, v in out.items()}
    mask = torch.ones(lead, dtype=torch.bool)
    if masked and mask.numel() > 2:
        mask.view(-1)[1] = False
        mask.view(-1)[-1] = False
    out["mask"] = mask
    out["weights"] = torch.rand(lead, generator=g) + 0.5  # per-token weights of the per-token function's test loss
    return out


def _student(heads, dtype=None):
    """Fresh leaf copies of the student's tensors (requiring grad), in ``dtype`` when given."""
    return tuple(None if t is None else (t if dtype is None else t.to(dtype)).clone().requires_grad_(True)
                 for t in (heads["sh"], heads["sw"], heads["sb"]))


def _teacher(heads, dtype=None):
    return tuple(None if t is None else (t if dtype is None else t.to(dtype)) for t in (heads["th"], heads["tw"],
                                                                                      heads["tb"]))


def ours_token(heads, cfg, impl="auto", **kw):
    """((divergence, entropy), (d student hidden, weight[, bias]) of sum(weights * divergence)) of
    ``linear_token_divergence``."""
    sh, sw, sb = _student(heads)
    th, tw, tb = _teacher(heads)
    div, ent = gk.linear_token_divergence(sh, sw, th, tw, student_bias=sb, teacher_bias=tb, mask=heads["mask"],
                                          config=cfg, impl=impl, **kw)
    grads = torch.autograd.grad((div * heads["weights"]).sum(), [t for t in (sh, sw, sb) if t is not None])
    return (div.detach(), ent.detach()), grads


def ours_loss(heads, cfg, impl="auto", num_items_in_batch=None, **kw):
    """(loss, (d student hidden, weight[, bias]), metrics) of ``fused_linear_distill_loss``."""
    sh, sw, sb = _student(heads)
    th, tw, tb = _teacher(heads)
    loss, metrics = gk.fused_linear_distill_loss(sh, sw, th, tw, heads["mask"], student_bias=sb, teacher_bias=tb,
                                                 num_items_in_batch=num_items_in_batch, config=cfg, impl=impl, **kw)
    grads = torch.autograd.grad(loss, [t for t in (sh, sw, sb) if t is not None])
    return loss.detach(), grads, metrics


def _naive_divergence(heads, cfg, dtype):
    """Per-token (divergence, entropy) and the student's leaf tensors, everything in ``dtype``: through the
    reference in float64 (the ground truth); for another dtype the plain computation in it, both heads' full
    logits and their softmax in ``dtype`` (the middle term of the three-way rule)."""
    sh, sw, sb = _student(heads, dtype)
    th, tw, tb = _teacher(heads, dtype)
    if dtype == torch.float64:
        div, ent = reference_token_divergence(sh, sw, th, tw, sb, tb, cfg)
    else:
        zs = model_logits(sh @ sw.T + (0 if sb is None else sb), cfg.student)
        zt = model_logits(th @ tw.T + (0 if tb is None else tb), cfg.teacher)
        div, ent = divergence_from_logits(zs, zt.detach(), cfg.beta)
    return div, ent, (sh, sw, sb)


def truth_token(heads, cfg, dtype=torch.float64):
    """``ours_token``'s values and gradients through both heads' full logits in ``dtype`` (``_naive_divergence``),
    masked positions 0."""
    div, ent, student = _naive_divergence(heads, cfg, dtype)
    keep = heads["mask"]
    div, ent = torch.where(keep, div, 0.0), torch.where(keep, ent, 0.0)
    grads = torch.autograd.grad((div * heads["weights"].to(div.dtype)).sum(),
                                [t for t in student if t is not None])
    return (div.detach().float(), ent.detach().float()), grads


def truth_loss(heads, cfg, dtype=torch.float64, num_items_in_batch=None):
    """``ours_loss`` through both heads' full logits in ``dtype``, the reduction ``loss_from_divergence``."""
    div, ent, student = _naive_divergence(heads, cfg, dtype)
    loss, metrics = loss_from_divergence(div, ent.detach(), heads["mask"], num_items_in_batch,
                                         _grid(heads["mask"]))
    grads = torch.autograd.grad(loss, [t for t in student if t is not None])
    return loss.detach(), grads, metrics


def _grid(mask):
    shape = tuple(mask.shape)
    return Sequences.rows(*shape) if len(shape) == 2 else Sequences.rows(1, shape[0])


def _trl_args(cfg: DistillLossConfig) -> tuple:
    return (float(cfg.beta), float(cfg.temperature), float(cfg.student_logit_scale), cfg.student_softcap,
            float(cfg.teacher_logit_scale), cfg.teacher_softcap)


def trl_token(heads, cfg):
    """``ours_token`` by TRL's ``ChunkedDivergenceFunction`` (its CPU path: the tiles folded in torch), on the valid
    tokens (TRL's trainer compacts them the same way)."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    sh, sw, sb = _student(heads)
    th, tw, tb = _teacher(heads)
    keep = heads["mask"].reshape(-1)
    hs, ht = sh.reshape(-1, sh.shape[-1])[keep], th.reshape(-1, th.shape[-1])[keep]
    div_v, ent_v = ChunkedDivergenceFunction.apply(hs, sw, sb, ht, tw, tb, *_trl_args(cfg))
    div = torch.zeros(keep.shape).index_put((keep.nonzero().squeeze(1),), div_v).view(heads["mask"].shape)
    ent = torch.zeros(keep.shape).index_put((keep.nonzero().squeeze(1),), ent_v).view(heads["mask"].shape)
    grads = torch.autograd.grad((div * heads["weights"]).sum(), [t for t in (sh, sw, sb) if t is not None])
    return (div.detach(), ent.detach()), grads


def trl_loss(heads, cfg, num_items_in_batch=None):
    """``ours_loss`` by TRL's ``_chunked_divergence_loss``: (loss, grads, {"entropy_sum", "num_tokens"})."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    sh, sw, sb = _student(heads)
    th, tw, tb = _teacher(heads)
    beta, temperature, s_scale, s_cap, t_scale, t_cap = _trl_args(cfg)
    lead = heads["mask"].shape
    as3 = (lambda t: t.reshape(1, *t.shape)) if len(lead) == 1 else (lambda t: t)  # noqa: E731
    loss, entropy_sum, n_valid = _chunked_divergence_loss(
        as3(sh), as3(th), sw, tw, as3(heads["mask"]).long(), beta, num_items_in_batch=num_items_in_batch,
        student_lm_head_bias=sb, teacher_lm_head_bias=tb, student_logit_scale=s_scale, teacher_logit_scale=t_scale,
        student_final_logit_softcapping=s_cap, teacher_final_logit_softcapping=t_cap, temperature=temperature)
    grads = torch.autograd.grad(loss, [t for t in (sh, sw, sb) if t is not None])
    return loss.detach(), grads, {"entropy_sum": entropy_sum.detach(), "num_tokens": n_valid}


def assert_token_three_way(ours, middle, truth, dtype, what: str):
    """Per-token values and gradients of ``ours`` against float64 ``truth`` by the three-way rule, ``middle`` the
    plain computation (or TRL) in the same precision; gradients relative to their own largest value."""
    (div, ent), grads = ours
    (div_m, ent_m), grads_m = middle
    (div_t, ent_t), grads_t = truth
    assert_three_way(div, div_m, div_t, dtype, f"{what}: divergence")
    assert_three_way(ent, ent_m, ent_t, dtype, f"{what}: entropy")
    for name, g, g_m, g_t in zip(("d hidden", "d weight", "d bias"), grads, grads_m, grads_t):
        assert_three_way(g, g_m, g_t, dtype, f"{what}: {name}", scale=grad_scale(g_t))


def assert_loss_three_way(ours, middle, truth, dtype, what: str, metrics=("entropy_sum", "num_tokens")):
    """The loss, its gradients and the named metrics of ``ours`` against ``truth`` by the three-way rule."""
    loss, grads, m = ours
    loss_m, grads_m, m_m = middle
    loss_t, grads_t, m_t = truth
    assert_three_way(loss, loss_m, loss_t, dtype, f"{what}: loss")
    for name, g, g_m, g_t in zip(("d hidden", "d weight", "d bias"), grads, grads_m, grads_t):
        assert_three_way(g, g_m, g_t, dtype, f"{what}: {name}", scale=grad_scale(g_t))
    for name in metrics:
        assert_three_way(m[name], m_m[name], m_t[name], dtype, f"{what}: metric {name}")
