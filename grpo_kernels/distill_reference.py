"""The eager reference of the two-head distillation divergence (docs/DESIGN.md, "Distillation"): the one definition
of its maths, plain differentiable PyTorch, valid in float64.

Per token, each model's raw logits x = h W^T + b become ``z = cap * tanh(scale * r(x) / cap) / T``
(``model_logits``), p = softmax(z_student), q = softmax(z_teacher), and the divergence is TRL 1.16's:

- beta == 0: the forward KL(q || p) = sum q (log q - log p);
- beta == 1: the reverse KL(p || q) = sum p (log p - log q);
- 0 < beta < 1: the generalized JSD, beta KL(q || m) + (1 - beta) KL(p || m), m = (1 - beta) p + beta q, with
  log m = logaddexp(log(1 - beta) + log p, log beta + log q) (no underflow of m where p and q are tiny).

The student's entropy is -sum p log p of the same tempered distribution. Terms whose weight is an exact 0 (a -inf
logit: a banned token) add 0 (the convention 0 log 0 = 0), as a sum over the tokens that can occur; a NaN anywhere
stays NaN. The teacher is detached: it gets no gradient, whatever its tensors require.

The loss reduction is TRL's ``_chunked_divergence_loss``: ``sum(D) / num_items_in_batch`` when given, else the mean
over the valid tokens (``sum(D) / max(n_valid, 1)``), written as per-token weights w with ``loss = sum(w D)``
(``distill_weights``), the form the gradient-in-forward paths use.
"""
from __future__ import annotations

import math

import torch

from .distill_config import FORWARD_KL, REVERSE_KL, DistillLossConfig, ModelTransform, divergence_mode
from .reference import round_logits, soft_cap
from .sequences import Sequences


def model_logits(x: torch.Tensor, t: ModelTransform) -> torch.Tensor:
    """One model's transformed logits ``soft_cap(scale * round(x)) / temperature`` (differentiable; the rounding is
    straight-through)."""
    return soft_cap(round_logits(x, t.round_logits) * t.scale, t.softcap) / t.temperature


def _weighted(weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``weight * value`` with an exact 0 where the weight is an exact 0 (0 log 0 = 0); NaN stays NaN."""
    return torch.where(weight == 0, 0.0, weight * value)


def divergence_from_logits(zs: torch.Tensor, zt: torch.Tensor, beta: float):
    """(divergence, student entropy) (...,) of transformed logits zs, zt (..., V) (``model_logits``)."""
    log_p = torch.log_softmax(zs, dim=-1)
    log_q = torch.log_softmax(zt, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    mode = divergence_mode(beta)
    if mode == FORWARD_KL:
        div = _weighted(q, log_q - log_p).sum(-1)
    elif mode == REVERSE_KL:
        div = _weighted(p, log_p - log_q).sum(-1)
    else:
        log_m = torch.logaddexp(log_p + math.log(1.0 - beta), log_q + math.log(beta))
        div = beta * _weighted(q, log_q - log_m).sum(-1) + (1.0 - beta) * _weighted(p, log_p - log_m).sum(-1)
    entropy = -_weighted(p, log_p).sum(-1)
    return div, entropy


def token_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                     config: DistillLossConfig | None = None):
    """Per-token (divergence, student entropy) from both models' raw logits (..., V): float64 for float64 student
    logits, else fp32. Differentiable to the student's logits only; the entropy is returned detached (TRL's)."""
    cfg = config or DistillLossConfig()
    dtype = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    zs = model_logits(student_logits.to(dtype), cfg.student)
    zt = model_logits(teacher_logits.detach().to(dtype), cfg.teacher)
    div, entropy = divergence_from_logits(zs, zt, cfg.beta)
    return div, entropy.detach()


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype) -> torch.Tensor:
    """Raw logits ``hidden @ weight.T + bias`` in ``dtype`` (the whole N x V: reference only)."""
    x = hidden.to(dtype) @ weight.to(dtype).T
    return x if bias is None else x + bias.to(dtype)


def reference_token_divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias=None,
                               teacher_bias=None, config: DistillLossConfig | None = None):
    """``token_divergence`` of both heads' full logits, computed in float64 for float64 student inputs, else fp32."""
    dtype = torch.float64 if student_hidden.dtype == torch.float64 else torch.float32
    xs = head_logits(student_hidden, student_weight, student_bias, dtype)
    with torch.no_grad():
        xt = head_logits(teacher_hidden, teacher_weight, teacher_bias, dtype)
    return token_divergence(xs, xt, config)


def distill_weights(mask_f: torch.Tensor, num_items_in_batch, seqs: Sequences | None = None) -> torch.Tensor:
    """The per-token weights w of the reduction, ``loss = sum(w D)`` (mask_f: the float mask on the tokens' grid):
    ``mask / num_items_in_batch`` when given, else ``mask / max(n_valid, 1)``."""
    if num_items_in_batch is None:
        n = mask_f.sum() if seqs is None else seqs.total(mask_f)
        return mask_f / n.clamp(min=1)
    if isinstance(num_items_in_batch, torch.Tensor):
        return mask_f / num_items_in_batch.to(device=mask_f.device, dtype=mask_f.dtype).reshape(())
    return mask_f / float(num_items_in_batch)


def loss_from_divergence(divergence: torch.Tensor, entropy: torch.Tensor, mask=None, num_items_in_batch=None,
                         seqs: Sequences | None = None):
    """(loss, metrics) from per-token divergences and student entropies on the tokens' grid: the loss
    ``sum(w D)`` (``distill_weights``), and the detached metrics ``divergence`` and ``entropy`` (masked means over
    the valid tokens), ``entropy_sum`` and ``num_tokens`` (what TRL's trainer all-reduces). Positions the mask drops
    add exactly 0 whatever they hold. ``seqs``: the grid's sequences, whose ``total`` sums in the batch-invariant
    order when asked."""
    seqs = seqs or Sequences.rows(1, divergence.numel())
    grid = seqs.grid
    div = divergence.reshape(grid)
    ent = entropy.reshape(grid)
    keep = torch.ones(grid, dtype=torch.bool, device=div.device) if mask is None else mask.reshape(grid) != 0
    mask_f = keep.to(div.dtype)
    w = distill_weights(mask_f, num_items_in_batch, seqs)
    loss = seqs.total(torch.where(keep, w * div, 0.0))
    with torch.no_grad():
        n = seqs.total(mask_f)
        div_sum = seqs.total(torch.where(keep, div, 0.0))
        ent_sum = seqs.total(torch.where(keep, ent, 0.0))
        metrics = {"divergence": div_sum / n.clamp(min=1), "entropy": ent_sum / n.clamp(min=1),
                   "entropy_sum": ent_sum, "num_tokens": n}
    return loss, {k: v.detach() for k, v in metrics.items()}


def reference_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, mask=None,
                           student_bias=None, teacher_bias=None, num_items_in_batch=None,
                           config: DistillLossConfig | None = None):
    """(loss, metrics) of ``fused_linear_distill_loss`` through both heads' full logits: the ground truth of the
    tests (in float64 for float64 inputs)."""
    lead = student_hidden.shape[:-1]
    div, ent = reference_token_divergence(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                          student_bias, teacher_bias, config)
    seqs = Sequences.rows(*lead) if len(lead) == 2 else Sequences.rows(1, lead[0])
    return loss_from_divergence(div.reshape(seqs.grid), ent.reshape(seqs.grid), mask, num_items_in_batch, seqs)
