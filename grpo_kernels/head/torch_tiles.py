"""The fused head's ``head.torch`` path: tiled eager PyTorch (the CPU default, and ``impl="torch"``).

Tiles of ``tile_rows`` x ``TORCH_HEAD_TILE_VOCAB`` logits (rows from the plan, so that the tile temporaries fit the
memory budget) with an online logsumexp; the backward recomputes each tile. Never holds an N x V tensor. A soft cap
(``softcap``) is applied to each tile in place, before the temperature (``torch_chunks.soft_cap_``), and its derivative
multiplies the tile's d logits in the backward.
"""
from __future__ import annotations

import torch

from ..torch_chunks import NEG_BIG, dlogits_, soft_cap_

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


def torch_linear_logprobs_forward(hidden, weight, bias, ids, transform, tile_rows: int):
    """Tiled eager forward: hidden (N, H), weight (V, H), bias (V,) | None, ids (N,) -> fp32 (logp, lse, entropy)
    of the logits under ``transform`` (temperature, soft cap).

    At most two (tile_rows, TORCH_HEAD_TILE_VOCAB) temporaries at a time (the logits tile and its exponentials),
    plus, for half-precision inputs, the weight tile and the hidden rows in the accumulation dtype."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden)
    inv_t, softcap = transform.inv_temperature, transform.softcap
    logp, lse, entropy = (torch.empty(N, dtype=acc, device=hidden.device) for _ in range(3))
    for r0 in range(0, N, tile_rows):
        h = hidden[r0:r0 + tile_rows].to(acc)
        tgt = ids[r0:r0 + tile_rows]
        n = h.shape[0]
        m = torch.full((n,), float("-inf"), dtype=acc, device=h.device)
        s = torch.zeros(n, dtype=acc, device=h.device)
        a = torch.zeros(n, dtype=acc, device=h.device)
        z_target = torch.zeros(n, dtype=acc, device=h.device)
        for v0 in range(0, V, TORCH_HEAD_TILE_VOCAB):
            v1 = min(v0 + TORCH_HEAD_TILE_VOCAB, V)
            z = soft_cap_(_tile_raw_logits(h, _weight_tile(weight, v0, v1, acc), bias, v0, v1, acc), softcap)
            z.mul_(inv_t)
            # online logsumexp; `a` carries sum exp(z - m) (z - m) for the entropy, relative to the running max so
            # that H = log s - a / s never subtracts two large numbers (low temperatures)
            m_new = torch.maximum(m, z.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            alpha = torch.exp(m - m_safe)
            inside = (tgt >= v0) & (tgt < v1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            z_target += torch.where(inside, z.gather(-1, local).squeeze(-1), 0.0)
            shift = torch.where(s > 0, (m - m_safe) * s, 0.0)  # moving a's reference from m to m_new
            z.sub_(m_safe.unsqueeze(-1))
            e = z.exp()
            s_tile = e.sum(-1)
            a = alpha * (a + shift) + e.mul_(z.clamp_(min=NEG_BIG)).sum(-1)
            s = s * alpha + s_tile
            m = m_new
            del z, e
        log_s = torch.log(s)
        lse[r0:r0 + n] = m + log_s
        entropy[r0:r0 + n] = log_s - a / s
        logp[r0:r0 + n] = z_target - (m + log_s)
    return logp, lse, entropy


def torch_linear_logprobs_backward(hidden, weight, bias, ids, stats, transform, needs: tuple, tile_rows: int):
    """Tiled eager backward (always deterministic): recompute each tile, form dz in place, accumulate dh, dW, db
    in the accumulation dtype (fp32 accumulators for half-precision inputs, counted by the plan). Two tiles at a
    time, as in the forward, with or without a soft cap (``torch_chunks.dlogits_``). stats: an
    ``inputs.LogprobGrads``; transform: the logits transform; needs: (d hidden, d weight, d bias) wanted."""
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
        h = hidden[r0:r0 + tile_rows].to(acc)
        n = h.shape[0]
        tgt = ids[r0:r0 + n]
        g = grad_logp[r0:r0 + n].to(acc).unsqueeze(-1)
        row_lse = lse[r0:r0 + n].unsqueeze(-1)
        g_h = row_h = None
        if grad_entropy is not None:
            g_h = grad_entropy[r0:r0 + n].to(acc).unsqueeze(-1)
            row_h = entropy[r0:r0 + n].unsqueeze(-1)
        for v0 in range(0, V, TORCH_HEAD_TILE_VOCAB):
            v1 = min(v0 + TORCH_HEAD_TILE_VOCAB, V)
            w_tile = _weight_tile(weight, v0, v1, acc)
            inside = ((tgt >= v0) & (tgt < v1)).unsqueeze(-1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            dz = dlogits_(_tile_raw_logits(h, w_tile, bias, v0, v1, acc), row_lse, row_h, g, g_h, inv_t, softcap,
                          local, inside)
            if need_hidden:
                d_hidden[r0:r0 + n].addmm_(dz, w_tile)
            if need_weight:
                d_weight[v0:v1].addmm_(dz.T, h)
            if need_bias:
                d_bias[v0:v1] += dz.sum(0)
            del dz
    return (None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype))
