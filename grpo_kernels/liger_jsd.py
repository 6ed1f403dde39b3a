"""Liger-Kernel 0.8.5's JSD distillation entry points on the two-head divergence (``fused_linear_distill_loss``),
re-exported by ``grpo_kernels.liger``: change the import, keep the code.

    from liger_kernel.transformers import LigerFusedLinearJSD                   # before
    from liger_kernel.transformers.functional import liger_fused_linear_jsd     # before
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss               # before
    from grpo_kernels.liger import LigerFusedLinearJSD, liger_fused_linear_jsd, LigerFusedLinearJSDLoss  # after

Liger's beta is TRL's (checked against Liger's kernel and its tests' torch definitions): 0 is KL(teacher || student),
1 is KL(student || teacher), in between the generalized JSD with mixture ``(1 - beta) p_student + beta p_teacher``;
both models' logits are divided by the temperature and the divergence is not multiplied by T^2. Where Liger's
numbers differ (it rounds both models' logits to the input dtype; the fused kernel's CUDA path keeps them in fp32),
ours keep the logits in fp32: docs/api.md "Coming from Liger-Kernel" lists every difference.
"""
from __future__ import annotations

import torch
from torch import nn

from . import _checks
from .distill import fused_linear_distill_loss
from .distill_config import DistillLossConfig
from .logprobs import linear_token_logprobs


def _beta(name: str, value) -> float:
    """Liger's JSD beta (named ``jsd_beta`` by the fused module, ``beta`` by the chunked one), in [0, 1]."""
    _checks.finite(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] (0: KL(teacher || student), 1: KL(student || teacher), else the "
                         f"generalized JSD), got {_checks.shown(value)}")
    return float(value)


def _ignore_index(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ignore_index must be an int, got {value!r}")
    return value


def _accum_dtype(value) -> None:
    """Liger's dtype of the weight-gradient accumulator: accepted; ours accumulates in fp32 whatever it is."""
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"accum_dtype must be None or a floating torch.dtype, got {value!r}")


def _labels(name: str, labels, hidden, ignore_index: int):
    """The valid-token mask ``labels != ignore_index``, labels shaped like the hidden's leading dims (Liger's (BT,))."""
    if labels is None:
        return None
    _checks.tensor(name, labels, integer=True)
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{name} must have shape {tuple(hidden.shape[:-1])} (student_input's leading dims, Liger's "
                         f"(BT,)), got {tuple(labels.shape)}")
    return labels != ignore_index


def _config(beta: float, temperature, extras: dict) -> DistillLossConfig:
    """The divergence's options (a ValueError names a bad temperature), with grpo_kernels' keyword-only additions
    ``round_logits`` and ``batch_invariant``."""
    _checks.temperature(temperature)
    return DistillLossConfig(beta=beta, temperature=temperature, round_logits=extras.get("round_logits"),
                             batch_invariant=extras.get("batch_invariant", False))


def liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels=None,
                           jsd_beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0,
                           accum_dtype=None, *, round_logits: str | None = None, batch_invariant: bool = False,
                           impl: str = "auto"):
    """Liger's ``liger_kernel.transformers.functional.liger_fused_linear_jsd`` (0.8.5), on
    ``fused_linear_distill_loss``.

    student_input (BT, H_s), student_weight (V, H_s), teacher_input (BT, H_t), teacher_weight (V, H_t) (no biases:
    Liger's fused JSD has none); shift_labels (BT,) or None: only a mask, the tokens whose label is ``ignore_index``
    are left out (their gradient is 0). Returns a 0-dim fp32 loss: the per-token divergence (``jsd_beta``, as
    above, at ``temperature``) summed over the valid tokens and divided by their number (by BT without labels; 0
    when every token is ignored). Differentiable with respect to the student's input and weight; the teacher gets
    no gradient. ``accum_dtype`` is accepted and does nothing: the weight gradient is accumulated in fp32 and
    returned in the weight's dtype. ``round_logits`` ("bf16" / "fp16", keyword-only): round both models' logits as
    Liger's CPU path does (``DistillLossConfig.round_logits``); ``batch_invariant``, ``impl``: as
    ``fused_linear_distill_loss``.
    """
    beta = _beta("jsd_beta", jsd_beta)
    _accum_dtype(accum_dtype)
    mask = _labels("shift_labels", shift_labels, student_input, _ignore_index(ignore_index))
    cfg = _config(beta, temperature, {"round_logits": round_logits, "batch_invariant": batch_invariant})
    loss, _ = fused_linear_distill_loss(student_input, student_weight, teacher_input, teacher_weight, mask,
                                        config=cfg, impl=impl)
    return loss.to(torch.float32)


class LigerFusedLinearJSD(nn.Module):
    """Liger's ``liger_kernel.transformers.LigerFusedLinearJSD`` (0.8.5): ``liger_fused_linear_jsd`` with its
    options fixed. The constructor takes Liger's arguments and defaults and stores them as attributes read at every
    forward, as Liger does; ``forward(student_input, student_weight, teacher_input, teacher_weight, shift_labels)``
    returns the 0-dim fp32 loss (shift_labels may be None)."""

    impl = "auto"  # grpo_kernels' implementation choice (Triton on CUDA, chunked PyTorch on CPU)

    def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0, accum_dtype: torch.dtype | None = None, *,
                 round_logits: str | None = None, batch_invariant: bool = False):
        super().__init__()
        _config(_beta("jsd_beta", jsd_beta), temperature, {"round_logits": round_logits,
                                                            "batch_invariant": batch_invariant})
        _ignore_index(ignore_index)
        _accum_dtype(accum_dtype)
        self.jsd_beta = jsd_beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.accum_dtype = accum_dtype
        self.round_logits = round_logits
        self.batch_invariant = batch_invariant

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
        return liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, shift_labels,
                                      self.jsd_beta, self.ignore_index, self.temperature, self.accum_dtype,
                                      round_logits=self.round_logits, batch_invariant=self.batch_invariant,
                                      impl=self.impl)


def _padded_student(student_weight, student_bias, teacher_vocab: int):
    """Liger's chunked loss pads the student's logits with zeros up to a larger teacher vocabulary (the same
    tokenizer, the teacher's head padded): zero weight rows (and bias entries) give exactly those logits. A
    differentiable copy of the student's head (V_t x H_s), only when the vocabularies differ."""
    pad = teacher_vocab - student_weight.shape[0]
    if pad <= 0:
        return student_weight, student_bias
    weight = torch.cat([student_weight, student_weight.new_zeros(pad, student_weight.shape[1])])
    bias = None if student_bias is None else torch.cat([student_bias, student_bias.new_zeros(pad)])
    return weight, bias


def _hard_loss(student_input, student_weight, student_bias, labels, valid, n, extras: dict):
    """Liger's hard loss: the student's cross-entropy on the valid labels at temperature 1 (Liger computes it
    before dividing the logits by the temperature), summed and divided by ``n``."""
    ids = torch.where(valid, labels, torch.zeros_like(labels))
    logp = linear_token_logprobs(student_input, student_weight, ids, student_bias, temperature=1.0, mask=valid,
                                 round_logits=extras.get("round_logits"),
                                 batch_invariant=extras.get("batch_invariant", False), impl=extras["impl"])
    return -logp.sum() / n


def chunked_liger_fused_linear_jsd(student_input, student_weight, teacher_input, teacher_weight, true_labels,
                                   student_bias=None, teacher_bias=None, weight_hard_loss: float = 0.5,
                                   weight_soft_loss: float = 0.5, beta: float = 0.5, ignore_index: int = -100,
                                   temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
                                   return_soft_hard_loss: bool = False, *, round_logits: str | None = None,
                                   batch_invariant: bool = False, impl: str = "auto"):
    """Liger's ``liger_kernel.chunked_loss.functional.liger_fused_linear_jsd`` (0.8.5; the chunked loss's
    ``LigerFusedLinearJSDFunction.apply``, arguments in its order): ``LigerFusedLinearJSDLoss``'s forward as one
    function. Import it under Liger's name:
    ``from grpo_kernels.liger import chunked_liger_fused_linear_jsd as liger_fused_linear_jsd``.

    student_input (BT, H_s), student_weight (V_s, H_s), student_bias (V_s,) | None; the teacher's (BT, H_t),
    (V_t, H_t), (V_t,) | None with V_t >= V_s (a larger teacher vocabulary: the student's logits padded with zeros,
    Liger's rule); true_labels (BT,), ``ignore_index`` marks the tokens left out. With n the number of valid tokens
    (at least 1):
    - soft loss: the divergence (``beta``: TRL's convention, as Liger's) of both models' logits divided by
      ``temperature``, summed over the valid tokens, / n (no T^2 factor);
    - hard loss: the student's cross-entropy of ``true_labels`` at temperature 1, summed over the valid tokens, / n;
      computed only when ``weight_hard_loss != 0`` or ``return_soft_hard_loss`` (as Liger).
    Returns the 0-dim fp32 ``weight_hard_loss * hard + weight_soft_loss * soft``, or ``(loss, soft, hard)`` with
    ``return_soft_hard_loss``; differentiable to the student's input, weight and bias (the parts too), none to the
    teacher. ``compiled`` and ``chunk_size`` are accepted and do nothing: the planner chooses the path and its
    chunks (``grpo_kernels.explain``). ``round_logits``, ``batch_invariant``, ``impl``: as ``liger_fused_linear_jsd``.
    """
    _checks.finite("weight_hard_loss", weight_hard_loss)
    _checks.finite("weight_soft_loss", weight_soft_loss)
    extras = {"round_logits": round_logits, "batch_invariant": batch_invariant, "impl": impl}
    cfg = _config(_beta("beta", beta), temperature, extras)
    _checks.tensor("true_labels", true_labels)
    valid = _labels("true_labels", true_labels, student_input, _ignore_index(ignore_index))
    _checks.tensor("student_weight", student_weight, dims=(2,))
    _checks.tensor("teacher_weight", teacher_weight, dims=(2,))
    n = valid.sum().clamp(min=1).to(torch.float32)
    weight, bias = _padded_student(student_weight, student_bias, teacher_weight.shape[0])
    soft, _ = fused_linear_distill_loss(student_input, weight, teacher_input, teacher_weight, valid,
                                        student_bias=bias, teacher_bias=teacher_bias, config=cfg, impl=impl)
    soft = soft.to(torch.float32)
    if weight_hard_loss == 0 and not return_soft_hard_loss:
        return weight_soft_loss * soft
    hard = _hard_loss(student_input, student_weight, student_bias, true_labels, valid, n, extras).to(torch.float32)
    loss = weight_hard_loss * hard + weight_soft_loss * soft
    return (loss, soft, hard) if return_soft_hard_loss else loss


class LigerFusedLinearJSDLoss(nn.Module):
    """Liger's ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`` (0.8.5): the soft JSD plus the hard
    cross-entropy loss (GKD-style trainers), ``chunked_liger_fused_linear_jsd`` with its options fixed. The
    constructor takes Liger's arguments and defaults and stores them as attributes read at every forward;
    ``forward(student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
    teacher_bias=None)`` returns the 0-dim fp32 loss, or ``(loss, soft_loss, hard_loss)`` with
    ``return_soft_hard_loss``."""

    impl = "auto"  # grpo_kernels' implementation choice (Triton on CUDA, chunked PyTorch on CPU)

    def __init__(self, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
                 ignore_index: int = -100, temperature: float = 1.0, compiled: bool = True, chunk_size: int = 1024,
                 return_soft_hard_loss: bool = False, *, round_logits: str | None = None,
                 batch_invariant: bool = False):
        super().__init__()
        _checks.finite("weight_hard_loss", weight_hard_loss)
        _checks.finite("weight_soft_loss", weight_soft_loss)
        _config(_beta("beta", beta), temperature, {"round_logits": round_logits, "batch_invariant": batch_invariant})
        _ignore_index(ignore_index)
        self.weight_hard_loss = weight_hard_loss
        self.weight_soft_loss = weight_soft_loss
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.compiled = compiled
        self.beta = beta
        self.chunk_size = chunk_size
        self.return_soft_hard_loss = return_soft_hard_loss
        self.round_logits = round_logits
        self.batch_invariant = batch_invariant

    def forward(self, student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias=None,
                teacher_bias=None):
        return chunked_liger_fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, true_labels, student_bias, teacher_bias,
            self.weight_hard_loss, self.weight_soft_loss, self.beta, self.ignore_index, self.temperature,
            self.compiled, self.chunk_size, self.return_soft_hard_loss, round_logits=self.round_logits,
            batch_invariant=self.batch_invariant, impl=self.impl)
