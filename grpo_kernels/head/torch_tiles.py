"""The fused head's ``head.torch`` path: tiled eager PyTorch (the CPU default, and ``impl="torch"``).

Tiles of ``tile_rows`` x ``TORCH_HEAD_TILE_VOCAB`` logits (rows from the plan, so that the tile temporaries fit the
memory budget) with an online logsumexp; the backward recomputes each tile. Never holds an N x V tensor. A soft cap
(``softcap``) is applied to each tile in place, before the temperature (``torch_chunks.soft_cap_``), and its derivative
multiplies the tile's d logits in the backward.

The extra statistics (``config.TokenExtras``: log sum p^2, the mean logit, is_top1) are folded from the same tiles
(``_TileExtras``) with no further tile-sized temporary: per tile one more row reduction for the mean (``sum``), a
row dot product ``e . e`` for sum p^2, and ``max`` with its (first) index in place of ``amax`` for is_top1.
"""
from __future__ import annotations

import torch

from ..config import TokenExtras
from ..invariance import padded
from ..torch_chunks import NEG_BIG, dlogits_, round_, soft_cap_

# Vocab columns per tile (the tile's row count follows from the memory budget, ``planner.plan_head``).
TORCH_HEAD_TILE_VOCAB = 4096
# Tile-sized temporaries alive at once (the plan's figure: ``planner.plan_head``).
TORCH_HEAD_TEMPS = 2


def accumulation_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _weight_tile(weight, v0, v1, acc):
    """weight[v0:v1] in the accumulation dtype: a view for fp32 / fp64 weights, a (Vt, H) copy for half ones."""
    return weight[v0:v1].to(acc)


def _tile_raw_logits(h, w_tile, bias, v0, v1, acc):
    """One (rows x vocab-tile) block of raw logits h W^T + b in the accumulation dtype (one new tile)."""
    z = h @ w_tile.T
    if bias is not None:
        z += bias[v0:v1].to(acc)
    return z


def torch_linear_logprobs_forward(hidden, weight, bias, ids, transform, tile_rows: int,
                                  extras: TokenExtras | None = None, fixed_rows: bool = False):
    """Tiled eager forward: hidden (N, H), weight (V, H), bias (V,) | None, ids (N,) -> fp32 (logp, lse, entropy)
    of the logits under ``transform`` (temperature, soft cap); with ``extras``, a fourth item
    (log_sum_sq_probs | None, mean_logits | None, is_top1 | None) (N,) (``reference.token_extras``).

    At most two (tile_rows, TORCH_HEAD_TILE_VOCAB) temporaries at a time (the logits tile and its exponentials),
    plus, for half-precision inputs, the weight tile and the hidden rows in the accumulation dtype. ``fixed_rows``
    (batch invariance): every tile has exactly tile_rows rows, the last one zero-padded (``invariance.padded``), so
    every GEMM and reduction has the same shape whatever N is."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden)
    inv_t, softcap = transform.inv_temperature, transform.softcap
    logp, lse, entropy = (torch.empty(N, dtype=acc, device=hidden.device) for _ in range(3))
    out_extras = _TileExtras.outputs(N, acc, hidden.device, extras)
    for r0 in range(0, N, tile_rows):
        r1 = min(N, r0 + tile_rows)
        rows = tile_rows if fixed_rows else r1 - r0
        h = padded(hidden, r0, r1, rows).to(acc)
        tgt = padded(ids, r0, r1, rows)
        n = rows
        m = torch.full((n,), float("-inf"), dtype=acc, device=h.device)
        s = torch.zeros(n, dtype=acc, device=h.device)
        a = torch.zeros(n, dtype=acc, device=h.device)
        z_target = torch.zeros(n, dtype=acc, device=h.device)
        extra = _TileExtras(tgt, acc, extras) if extras else None
        for v0 in range(0, V, TORCH_HEAD_TILE_VOCAB):
            v1 = min(v0 + TORCH_HEAD_TILE_VOCAB, V)
            z = soft_cap_(round_(_tile_raw_logits(h, _weight_tile(weight, v0, v1, acc), bias, v0, v1, acc),
                                 transform.round_logits), softcap)
            z.mul_(inv_t)
            # online logsumexp; `a` carries sum exp(z - m) (z - m) for the entropy, relative to the running max so
            # that H = log s - a / s never subtracts two large numbers (low temperatures)
            m_new = torch.maximum(m, z.amax(-1) if extra is None else extra.fold_logits(z, v0, v1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            alpha = torch.exp(m - m_safe)
            inside = (tgt >= v0) & (tgt < v1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            z_target += torch.where(inside, z.gather(-1, local).squeeze(-1), 0.0)
            shift = torch.where(s > 0, (m - m_safe) * s, 0.0)  # moving a's reference from m to m_new
            z.sub_(m_safe.unsqueeze(-1))
            e = z.exp()
            if extra is not None:
                extra.fold_exp(e, alpha)
            s_tile = e.sum(-1)
            a = alpha * (a + shift) + e.mul_(z.clamp_(min=NEG_BIG)).sum(-1)
            s = s * alpha + s_tile
            m = m_new
            del z, e
        log_s = torch.log(s)
        keep = r1 - r0  # the real rows of a padded tile
        lse[r0:r1] = (m + log_s)[:keep]
        entropy[r0:r1] = (log_s - a / s)[:keep]
        logp[r0:r1] = (z_target - (m + log_s))[:keep]
        if extra is not None:
            extra.finish(out_extras, slice(r0, r1), V, z_target[:keep], m[:keep], log_s[:keep], logp[r0:r1], keep)
    return (logp, lse, entropy) if not extras else (logp, lse, entropy, out_extras)


class _TileExtras:
    """The extra statistics of one block of rows, folded tile by tile (``config.TokenExtras``).

    log sum p^2: ``s2 = sum e^2`` with ``e = exp(z - m)``, rescaled by alpha^2 like s by alpha, so that
    ``log sum p^2 = log s2 - 2 log s``. mean: the plain sum of z. is_top1: the largest z over the tiles wholly before
    the target's tile, and whether the target is its own tile's first maximum (``max``'s index is the first one),
    so that ``is_top1 = z_t >= m & z_t > max_before & first`` (``reference.token_extras``)."""

    def __init__(self, tgt, acc, extras: TokenExtras):
        n, dev = tgt.shape[0], tgt.device
        self.tgt, self.extras = tgt, extras
        self.s2 = torch.zeros(n, dtype=acc, device=dev) if extras.log_sum_sq_probs else None
        self.z_sum = torch.zeros(n, dtype=acc, device=dev) if extras.mean_logits else None
        if extras.is_top1:
            self.max_before = torch.full((n,), float("-inf"), dtype=acc, device=dev)
            self.first = torch.zeros(n, dtype=torch.bool, device=dev)

    @staticmethod
    def outputs(N: int, acc, device, extras: TokenExtras | None) -> tuple:
        if not extras:
            return None, None, None
        return (torch.empty(N, dtype=acc, device=device) if extras.log_sum_sq_probs else None,
                torch.empty(N, dtype=acc, device=device) if extras.mean_logits else None,
                torch.empty(N, dtype=torch.bool, device=device) if extras.is_top1 else None)

    def fold_logits(self, z, v0: int, v1: int):
        """Fold a tile of transformed logits z (n, v1 - v0) before the online logsumexp shifts it; returns its row
        maxima (NaN where the tile holds a NaN)."""
        if self.z_sum is not None:
            self.z_sum += z.sum(-1)
        if not self.extras.is_top1:
            return z.amax(-1)
        tile_max, first_index = z.max(-1)
        self.max_before = torch.where(self.tgt >= v1, torch.maximum(self.max_before, tile_max), self.max_before)
        here = (self.tgt >= v0) & (self.tgt < v1)
        self.first = torch.where(here, first_index == self.tgt - v0, self.first)
        return tile_max

    def fold_exp(self, e, alpha) -> None:
        """Fold the tile's e = exp(z - m_new) (n, Vt); alpha = exp(m_old - m_new) rescales the running sum."""
        if self.s2 is not None:
            self.s2 = self.s2 * (alpha * alpha) + (e.unsqueeze(-2) @ e.unsqueeze(-1)).view(-1)

    def finish(self, out: tuple, rows: slice, V: int, z_target, m, log_s, logp, keep: int) -> None:
        """The outputs of the block's first ``keep`` rows (a padded block's real ones) into ``out`` at ``rows``."""
        sq, mean, top1 = out
        if sq is not None:
            sq[rows] = torch.log(self.s2[:keep]) - 2.0 * log_s
        if mean is not None:
            mean[rows] = self.z_sum[:keep] / V
        if top1 is not None:
            top1[rows] = (z_target >= m) & (z_target > self.max_before[:keep]) & self.first[:keep] & ~torch.isnan(logp)


def torch_linear_logprobs_backward(hidden, weight, bias, ids, stats, transform, needs: tuple, tile_rows: int,
                                   fixed_rows: bool = False):
    """Tiled eager backward (always deterministic): recompute each tile, form dz in place, accumulate dh, dW, db
    in the accumulation dtype (fp32 accumulators for half-precision inputs, counted by the plan). Two tiles at a
    time, as in the forward, with or without a soft cap (``torch_chunks.dlogits_``). stats: an
    ``inputs.LogprobGrads``; transform: the logits transform; needs: (d hidden, d weight, d bias) wanted.
    ``fixed_rows``: as the forward's (the padded rows' gradients are 0: their d logits are zeros)."""
    lse, entropy, grad_logp, grad_entropy = stats.lse, stats.entropy, stats.grad_logp, stats.grad_entropy
    need_hidden, need_weight, need_bias = needs
    temperature, softcap = transform.temperature, transform.softcap
    N, V = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden)
    inv_t = 1.0 / temperature
    d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    d_bias = torch.zeros(V, dtype=acc, device=weight.device) if need_bias else None
    for r0 in range(0, N, tile_rows):
        r1 = min(N, r0 + tile_rows)
        rows = tile_rows if fixed_rows else r1 - r0

        def at(t):
            return padded(t, r0, r1, rows)

        h = at(hidden).to(acc)
        n = rows
        tgt = at(ids)
        g = at(grad_logp).to(acc).unsqueeze(-1)
        row_lse = at(lse).unsqueeze(-1)
        g_h = row_h = None
        if grad_entropy is not None:
            g_h = at(grad_entropy).to(acc).unsqueeze(-1)
            row_h = at(entropy).unsqueeze(-1)
        dh_rows = None if d_hidden is None else (d_hidden[r0:r1] if rows == r1 - r0 else
                                                 torch.zeros((rows, d_hidden.shape[1]), dtype=acc, device=h.device))
        for v0 in range(0, V, TORCH_HEAD_TILE_VOCAB):
            v1 = min(v0 + TORCH_HEAD_TILE_VOCAB, V)
            w_tile = _weight_tile(weight, v0, v1, acc)
            inside = ((tgt >= v0) & (tgt < v1)).unsqueeze(-1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            raw = round_(_tile_raw_logits(h, w_tile, bias, v0, v1, acc), transform.round_logits)
            dz = dlogits_(raw, row_lse, row_h, g, g_h, inv_t, softcap, local, inside)
            if need_hidden:
                dh_rows.addmm_(dz, w_tile)
            if need_weight:
                d_weight[v0:v1].addmm_(dz.T, h)
            if need_bias:
                d_bias[v0:v1] += dz.sum(0)
            del dz
        if dh_rows is not None and rows != r1 - r0:
            d_hidden[r0:r1] = dh_rows[: r1 - r0]
    return (None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype))
