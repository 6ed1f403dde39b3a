"""The fused head's ``head.torch`` path: tiled eager PyTorch (the CPU default, and ``impl="torch"``).

Tiles of ``tile_rows`` x ``TORCH_HEAD_TILE_VOCAB`` logits (rows from the plan, so that the tile temporaries fit the
memory budget) with an online logsumexp; the backward recomputes each tile. Never holds an N x V tensor.
"""
from __future__ import annotations

import torch

# Vocab columns per tile (the tile's row count follows from the memory budget, ``planner.plan_head``).
TORCH_HEAD_TILE_VOCAB = 4096
# fp32 (or fp64) temporaries of one tile, in tile-sized units, and per-row values beside them (the plan's figure).
TORCH_HEAD_TEMPS = 4


def accumulation_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _tile_logits(h, weight, bias, v0, v1, inv_t, acc):
    """One (rows x vocab-tile) block of z = (h W^T + b) / tau in the accumulation dtype."""
    z = h @ weight[v0:v1].to(acc).T
    if bias is not None:
        z += bias[v0:v1].to(acc)
    return z.mul_(inv_t)


def torch_linear_logprobs_forward(hidden, weight, bias, ids, temperature, tile_rows: int):
    """Tiled eager forward: hidden (N, H), weight (V, H), bias (V,) | None, ids (N,) -> fp32 (logp, lse, entropy)."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden)
    inv_t = 1.0 / temperature
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
            z = _tile_logits(h, weight, bias, v0, v1, inv_t, acc)
            # online logsumexp; `a` carries sum exp(z - m) z for the entropy
            m_new = torch.maximum(m, z.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
            alpha = torch.exp(m - m_safe)
            e = torch.exp(z - m_safe.unsqueeze(-1))
            s = s * alpha + e.sum(-1)
            a = a * alpha + torch.where(e > 0, e * z, 0.0).sum(-1)
            m = m_new
            inside = (tgt >= v0) & (tgt < v1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            z_target += torch.where(inside, z.gather(-1, local).squeeze(-1), 0.0)
        chunk_lse = m + torch.log(s)
        lse[r0:r0 + n] = chunk_lse
        entropy[r0:r0 + n] = chunk_lse - a / s
        logp[r0:r0 + n] = z_target - chunk_lse
    return logp, lse, entropy


def torch_linear_logprobs_backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy, temperature,
                                   need_hidden, need_weight, need_bias, tile_rows: int):
    """Tiled eager backward (always deterministic): recompute each tile, form dz, accumulate dh, dW, db in the
    accumulation dtype (fp32 accumulators for half-precision inputs, counted by the plan)."""
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
        if grad_entropy is not None:
            g_h = grad_entropy[r0:r0 + n].to(acc).unsqueeze(-1)
            row_h = entropy[r0:r0 + n].unsqueeze(-1)
        for v0 in range(0, V, TORCH_HEAD_TILE_VOCAB):
            v1 = min(v0 + TORCH_HEAD_TILE_VOCAB, V)
            log_p = _tile_logits(h, weight, bias, v0, v1, inv_t, acc) - row_lse
            p = torch.exp(log_p)
            dz = -g * p
            inside = ((tgt >= v0) & (tgt < v1)).unsqueeze(-1)
            local = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(-1)
            dz.scatter_add_(-1, local, torch.where(inside, g, 0.0))
            if grad_entropy is not None:
                dz -= torch.where(p > 0, g_h * p * (log_p + row_h), 0.0)
            dz.mul_(inv_t)
            if need_hidden:
                d_hidden[r0:r0 + n] += dz @ weight[v0:v1].to(acc)
            if need_weight:
                d_weight[v0:v1] += dz.T @ h
            if need_bias:
                d_bias[v0:v1] += dz.sum(0)
    return (None if d_hidden is None else d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype))
