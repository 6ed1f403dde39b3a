"""The two-head divergence in chunked eager PyTorch: ``distill.torch`` (recompute) and ``distill.torch_fast``
(gradient in the forward), the CPU default and ``impl="torch"`` (docs/DESIGN.md, "Distillation").

Per chunk of R rows both models' raw logits are formed over the whole vocabulary (R x V each, in the accumulation
dtype: fp64 for fp64 inputs, else fp32), so that neither model's N x V logits ever exist; the chunk maths
(``chunk_divergence``) is docs/DESIGN.md's closed forms, formed in place in those two buffers plus at most
``TORCH_DISTILL_TEMPS`` more of their size. A half-precision weight is cast to the accumulation dtype
``TORCH_WEIGHT_TILE`` rows at a time (never a V x H copy).

The maths is ``distill_reference``'s, written without autograd: d D / d z_student is ``p - q`` (forward KL),
``p (log p - log q - D)`` (reverse KL) or ``(1 - beta) p (log p - log m - KL(p || m))`` (JSD), chained through the
temperature, the soft cap's derivative ``1 - (y / c)^2`` and the scale; the rounding is straight-through.
"""
from __future__ import annotations

import math

import torch

from ..distill_config import FORWARD_KL, JSD, REVERSE_KL, DistillLossConfig, ModelTransform
from ..invariance import padded
from ..torch_chunks import round_, soft_cap_

# Chunk-sized temporaries alive at once beside the two logits buffers, by divergence mode (the plan's figure:
# ``planner.distill``), counted from the code below and traced: the KLs' p, one difference and a boolean mask (a
# quarter of an fp32 chunk); the JSD's p, log m (its two operands while it is formed) and q.
TORCH_DISTILL_TEMPS = {FORWARD_KL: 2.25, REVERSE_KL: 2.25, JSD: 4.0}
# Rows of a half-precision weight cast to the accumulation dtype at a time.
TORCH_WEIGHT_TILE = 4096


def accumulation_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _transform_(x: torch.Tensor, t: ModelTransform) -> torch.Tensor:
    """x overwritten with ``soft_cap(scale * round(x)) / temperature`` (``distill_reference.model_logits``)."""
    round_(x, t.round_logits)
    if t.scale != 1.0:
        x.mul_(t.scale)
    return soft_cap_(x, t.softcap).mul_(t.inv_temperature)


def _weighted_sum(weight: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Row sums of ``weight * value`` with an exact 0 where the weight is 0 (0 log 0 = 0), formed in ``value``'s
    buffer (overwritten)."""
    zero = weight == 0
    return value.mul_(weight).masked_fill_(zero, 0.0).sum(-1)


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """The JSD's log m = log((1 - beta) p + beta q) = max(a, b) + log1p(exp(-|a - b|)), a = log p + log(1 - beta),
    b = log q + log beta (finite for 0 < beta < 1). Why not ``torch.logaddexp``: on the CPU its vectorized loop and
    its scalar tail round differently, so a row's log m depended on where the row's elements fell against the SIMD
    width, i.e. on its place in the chunk (not batch-invariant); exp, log1p, maximum and the exact ops give a row
    the same bits at any place. Temporaries: a (then log m), b and the gap, as logaddexp's two operands and output."""
    a = log_p + math.log(1.0 - beta)
    b = log_q + math.log(beta)
    gap = torch.sub(a, b).abs_().neg_().exp_().log1p_()
    return torch.maximum(a, b, out=a).add_(gap)


def chunk_divergence(xs: torch.Tensor, xt: torch.Tensor, cfg: DistillLossConfig, g: torch.Tensor | None = None):
    """One chunk's (divergence, entropy, lse_student, lse_teacher, aux, d raw student logits | None), all (R,)
    but d (R, V), from both models' raw logits xs, xt (R, V) in the accumulation dtype, overwritten (d is formed in
    one of the chunk's buffers). g: (R,) d loss / d divergence per row, or None (no gradient). aux: the divergence itself (KL
    modes) or KL(p || m) (JSD): the per-row scalar the gradient needs."""
    mode, beta = cfg.mode, cfg.beta
    log_p = _transform_(xs, cfg.student)
    log_q = _transform_(xt, cfg.teacher)
    lse_s = torch.logsumexp(log_p, -1)
    lse_t = torch.logsumexp(log_q, -1)
    log_p.sub_(lse_s.unsqueeze(-1))
    log_q.sub_(lse_t.unsqueeze(-1))
    p = log_p.exp()
    entropy = -_weighted_sum(p, log_p.clone())
    if mode == FORWARD_KL:
        q = log_q.exp()
        div = _weighted_sum(q, log_q - log_p)
        aux = div
    elif mode == REVERSE_KL:
        div = _weighted_sum(p, log_p - log_q)
        aux = div
    else:
        log_m = _log_mixture(log_p, log_q, beta)
        aux = _weighted_sum(p, log_p - log_m)
        q = log_q.exp()
        div = beta * _weighted_sum(q, log_q.sub_(log_m)) + (1.0 - beta) * aux
    if g is None:
        return div, entropy, lse_s, lse_t, aux, None
    zero = p == 0
    if mode == FORWARD_KL:
        d = p.sub_(q)
    elif mode == REVERSE_KL:
        d = log_q.sub_(log_p).add_(aux.unsqueeze(-1)).mul_(p).neg_().masked_fill_(zero, 0.0)
    else:
        d = log_m.sub_(log_p).add_(aux.unsqueeze(-1)).mul_(p).mul_(beta - 1.0).masked_fill_(zero, 0.0)
    del zero
    d.mul_(g.unsqueeze(-1) * cfg.student.inv_temperature)
    t = cfg.student
    if t.softcap is not None:  # the cap's derivative 1 - (y / c)^2 at y = z T = (log p + lse) T
        y = log_p.add_(lse_s.unsqueeze(-1)).mul_(t.temperature / t.softcap)
        d.mul_(y.square_().neg_().add_(1.0))
    if t.scale != 1.0:
        d.mul_(t.scale)
    return div, entropy, lse_s, lse_t, aux, d


def raw_logits(h: torch.Tensor, weight: torch.Tensor, bias, acc) -> torch.Tensor:
    """(R, V) raw logits ``h W^T + b`` in ``acc`` from h (R, H) already in ``acc``; a weight in another dtype is
    cast ``TORCH_WEIGHT_TILE`` rows at a time."""
    V = weight.shape[0]
    if weight.dtype == acc:
        x = h @ weight.T
    else:
        x = torch.empty((h.shape[0], V), dtype=acc, device=h.device)
        for v0 in range(0, V, TORCH_WEIGHT_TILE):
            v1 = min(V, v0 + TORCH_WEIGHT_TILE)
            torch.mm(h, weight[v0:v1].to(acc).T, out=x[:, v0:v1])
    if bias is not None:
        x += bias.to(acc)
    return x


def _add_grads(d, h, weight, dh_rows, dw, db) -> None:
    """dh_rows = d W, dw += d^T h, db += column sums (each when not None), the weight cast in tiles."""
    V, acc = weight.shape[0], d.dtype
    step = V if weight.dtype == acc else TORCH_WEIGHT_TILE
    for v0 in range(0, V, step):
        v1 = min(V, v0 + step)
        w = weight[v0:v1].to(acc)
        if dh_rows is not None:
            dh_rows.addmm_(d[:, v0:v1], w)
        if dw is not None:
            dw[v0:v1].addmm_(d[:, v0:v1].T, h)
    if db is not None:
        db += d.sum(0)


def torch_divergence(student, teacher, cfg: DistillLossConfig, rows: int, g=None, needs=(False, False, False),
                     fixed_rows: bool = False):
    """The chunk loop: student / teacher ``(hidden (N, H), weight (V, H), bias | None)``; per chunk of ``rows``
    rows (``fixed_rows``: every chunk exactly that many, the last zero-padded) the chunk maths, and with ``g``
    ((N,) d loss / d divergence) the student's gradients ``needs`` = (hidden, weight, bias) accumulated in the
    accumulation dtype. Returns (divergence, entropy, lse_s, lse_t, aux, d hidden | None, d weight | None,
    d bias | None), the per-token values in the accumulation dtype, the gradients in it too."""
    (sh, sw, sb), (th, tw, tb) = student, teacher
    N, acc = sh.shape[0], accumulation_dtype(sh)
    dev = sh.device
    outs = [torch.empty(N, dtype=acc, device=dev) for _ in range(5)]
    need_h, need_w, need_b = needs if g is not None else (False, False, False)
    dh = torch.zeros(sh.shape, dtype=acc, device=dev) if need_h else None
    dw = torch.zeros(sw.shape, dtype=acc, device=dev) if need_w else None
    db = torch.zeros(sw.shape[0], dtype=acc, device=dev) if need_b and sb is not None else None
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        n = rows if fixed_rows else r1 - r0
        h_s = padded(sh, r0, r1, n).to(acc)
        xs = raw_logits(h_s, sw, sb, acc)
        xt = raw_logits(padded(th, r0, r1, n).to(acc), tw, tb, acc)
        gr = None if g is None else padded(g, r0, r1, n).to(acc)
        *stats, d = chunk_divergence(xs, xt, cfg, gr)
        del xt
        for out, value in zip(outs, stats):
            out[r0:r1] = value[: r1 - r0]
        if d is not None and (dh is not None or dw is not None or db is not None):
            dh_rows = None if dh is None else (dh[r0:r1] if n == r1 - r0 else torch.zeros_like(h_s))
            _add_grads(d, h_s, sw, dh_rows, dw, db)
            if dh is not None and n != r1 - r0:
                dh[r0:r1] = dh_rows[: r1 - r0]
        del xs, d
    return (*outs, dh, dw, db)
