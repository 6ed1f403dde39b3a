"""Liger-Kernel 0.8.5's JSD maths, from Liger's own torch code, as the truth and the middle term of the three-way rule
for ``grpo_kernels.liger``'s JSD entry points (tests/hf/test_liger_jsd_numerics.py).

- ``LigerFusedLinearJSDFunction.distillation_loss_fn`` (liger_kernel.chunked_loss.jsd_loss): the divergence of
  (already temperature-divided) logits summed over the valid tokens; Liger's fused Triton kernel and its tests' torch
  ``JSD`` compute the same sum (its tests check that), divided by the valid-token count (BT without labels, 0 when
  none is valid).
- ``LigerFusedLinearDistillationBase._compute_loss`` (liger_kernel.chunked_loss.fused_linear_distillation): the
  chunked loss of one chunk, hard and soft, in the inputs' dtype: with the whole batch as one chunk it is Liger's
  chunked module's loss, eager.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss.fused_linear_distillation import LigerFusedLinearDistillationBase
from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction

soft_sum = LigerFusedLinearJSDFunction.distillation_loss_fn


@dataclass(frozen=True)
class JSDCase:
    name: str
    n: int  # tokens (BT)
    hs: int  # student width
    ht: int  # teacher width
    v: int  # vocabulary (the teacher's; ``v_student`` smaller: Liger's padding)
    beta: float
    temperature: float
    ignored: str = "some"  # "none" | "some" | "all"
    bias: bool = False
    weights: tuple = (0.5, 0.5)  # (weight_hard_loss, weight_soft_loss)
    ignore_index: int = -100
    v_student: int | None = None
    spread: float = 1.0  # the logits' standard deviation


def make_inputs(case: JSDCase, dtype, seed: int = 0) -> dict:
    """Student / teacher hidden states, weights, biases (``case.bias``) and labels (``ignore_index`` where
    ``case.ignored`` says) in ``dtype``; weights scaled so that the logits' spread is about ``case.spread``."""
    g = torch.Generator().manual_seed(seed)
    vs = case.v_student or case.v

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    out = {"si": rand(case.n, case.hs), "sw": rand(vs, case.hs, scale=case.spread / case.hs ** 0.5),
           "ti": rand(case.n, case.ht), "tw": rand(case.v, case.ht, scale=case.spread / case.ht ** 0.5),
           "sb": rand(vs) if case.bias else None, "tb": rand(case.v) if case.bias else None}
    labels = torch.randint(0, vs, (case.n,), generator=g)
    drop = {"none": torch.zeros(case.n, dtype=torch.bool), "all": torch.ones(case.n, dtype=torch.bool),
            "some": torch.rand(case.n, generator=g) < 0.3}[case.ignored]
    out["labels"] = torch.where(drop, case.ignore_index, labels)
    return out


def student_leaves(inputs: dict, dtype) -> list:
    """Fresh copies of the student's tensors in ``dtype`` (input, weight[, bias]) requiring grad."""
    return [inputs[k].detach().to(dtype).requires_grad_(True) for k in ("si", "sw", "sb") if inputs[k] is not None]


def _logits(h, w, b, dtype):
    x = h.to(dtype) @ w.to(dtype).T
    return x if b is None else x + b.to(dtype)


def fused_loss(leaves, inputs, case: JSDCase, dtype, with_labels: bool = True):
    """Liger's fused JSD loss with logits computed in ``dtype`` (no bias: Liger's fused JSD has none) and the
    divergence in float64 for float64 logits, fp32 otherwise (Liger's kernel: fp32 from the logits on)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    zs = _logits(leaves[0], leaves[1], None, dtype).to(acc) / case.temperature
    with torch.no_grad():
        zt = _logits(inputs["ti"], inputs["tw"], None, dtype).to(acc) / case.temperature
    labels = inputs["labels"] if with_labels else None
    n = case.n if labels is None else int((labels != case.ignore_index).sum())
    total = soft_sum(zs, zt, beta=case.beta, target=labels, ignore_index=case.ignore_index)
    return total / n if n else total * 0.0


def chunked_loss_in_dtype(leaves, inputs, case: JSDCase):
    """Liger's chunked loss (loss, soft, hard) as its module computes it, in the inputs' own dtype, the whole batch
    one chunk (``_compute_loss``)."""
    bias = leaves[2] if len(leaves) > 2 else None
    loss, (soft, hard, _, _) = LigerFusedLinearDistillationBase._compute_loss(
        leaves[0], leaves[1], inputs["ti"], inputs["tw"], inputs["labels"], bias, inputs["tb"],
        distillation_loss_fn=soft_sum, full_target=inputs["labels"], ignore_index=case.ignore_index,
        weight_hard_loss=case.weights[0], weight_soft_loss=case.weights[1], compute_ce_loss=True,
        temperature=case.temperature, beta=case.beta)
    return loss, soft, hard


def chunked_loss_float64(leaves, inputs, case: JSDCase):
    """The same maths in float64 (Liger's code computes its cross-entropy in fp32 whatever the dtype, so the hard
    loss is written out here: ``F.cross_entropy`` summed over the valid labels), Liger's zero padding of the
    student's logits to a larger teacher vocabulary included."""
    bias = leaves[2] if len(leaves) > 2 else None
    xs = _logits(leaves[0], leaves[1], bias, torch.float64)
    with torch.no_grad():
        xt = _logits(inputs["ti"], inputs["tw"], inputs["tb"], torch.float64)
    labels = inputs["labels"]
    n = (labels != case.ignore_index).sum().clamp(min=1)
    hard = F.cross_entropy(xs, labels, ignore_index=case.ignore_index, reduction="sum") / n
    zs = F.pad(xs, (0, xt.shape[-1] - xs.shape[-1])) / case.temperature
    soft = soft_sum(zs, xt / case.temperature, beta=case.beta, target=labels, ignore_index=case.ignore_index) / n
    return case.weights[0] * hard + case.weights[1] * soft, soft, hard
