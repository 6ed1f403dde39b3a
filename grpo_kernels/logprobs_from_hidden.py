"""``linear_token_logprobs``: per-token log-prob and entropy straight from hidden states and the lm_head weight.

logits = hidden @ weight.T (+ bias) are never written to memory: the Triton launchers of
``kernels/linear_forward_kernels.py`` / ``linear_backward_kernels.py`` keep each logit tile on chip; the PyTorch path here (CPU default) streams tiles of
TORCH_TILE_ROWS x TORCH_TILE_VOCAB with an online logsumexp and recomputes them in the backward, so its extra
memory is O(N + tile) on top of the gradient buffers.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _checks
from .inputs import HeadInputs
from .sharded_head import check_head_options, gathered, gathered_dtensor_head

TORCH_TILE_ROWS = 128
TORCH_TILE_VOCAB = 4096


def _acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _tile_logits(h, weight, bias, v0, v1, inv_t, acc):
    """One (rows x vocab-tile) block of z = (h W^T + b) / tau in the accumulation dtype."""
    z = h @ weight[v0:v1].to(acc).T
    if bias is not None:
        z += bias[v0:v1].to(acc)
    return z.mul_(inv_t)


def torch_linear_logprobs_forward(hidden, weight, bias, ids, temperature):
    """Tiled eager forward: hidden (N, H), weight (V, H), bias (V,) | None, ids (N,) -> fp32 (logp, lse, entropy)."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden)
    inv_t = 1.0 / temperature
    logp, lse, entropy = (torch.empty(N, dtype=acc, device=hidden.device) for _ in range(3))
    for r0 in range(0, N, TORCH_TILE_ROWS):
        h = hidden[r0:r0 + TORCH_TILE_ROWS].to(acc)
        tgt = ids[r0:r0 + TORCH_TILE_ROWS]
        n = h.shape[0]
        m = torch.full((n,), float("-inf"), dtype=acc, device=h.device)
        s = torch.zeros(n, dtype=acc, device=h.device)
        a = torch.zeros(n, dtype=acc, device=h.device)
        z_target = torch.zeros(n, dtype=acc, device=h.device)
        for v0 in range(0, V, TORCH_TILE_VOCAB):
            v1 = min(v0 + TORCH_TILE_VOCAB, V)
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
                                   need_hidden, need_weight, need_bias, deterministic=True, chunk_bytes=None):
    """Tiled eager backward (always deterministic): recompute each tile, form dz, accumulate dh, dW, db.

    Its scratch is one TORCH_TILE_ROWS x TORCH_TILE_VOCAB tile whatever ``chunk_bytes`` (a Triton-path option)."""
    N, V = hidden.shape[0], weight.shape[0]
    acc = _acc_dtype(hidden)
    inv_t = 1.0 / temperature
    d_hidden = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    d_bias = torch.zeros(V, dtype=acc, device=weight.device) if need_bias else None
    for r0 in range(0, N, TORCH_TILE_ROWS):
        h = hidden[r0:r0 + TORCH_TILE_ROWS].to(acc)
        n = h.shape[0]
        tgt = ids[r0:r0 + n]
        g = grad_logp[r0:r0 + n].to(acc).unsqueeze(-1)
        row_lse = lse[r0:r0 + n].unsqueeze(-1)
        if grad_entropy is not None:
            g_h = grad_entropy[r0:r0 + n].to(acc).unsqueeze(-1)
            row_h = entropy[r0:r0 + n].unsqueeze(-1)
        for v0 in range(0, V, TORCH_TILE_VOCAB):
            v1 = min(v0 + TORCH_TILE_VOCAB, V)
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


def _launchers(impl, grad=True):
    if impl == "triton" and not grad:
        # no gradient to come: per row chunk, cuBLAS logits (fp32) + one fold kernel (2NHV, no recompute)
        from .kernels.linear_epilogue_kernels import head_logprobs_chunked
        return head_logprobs_chunked, None
    if impl == "triton":
        from .kernels.linear_backward_kernels import linear_logprobs_backward
        from .kernels.linear_forward_kernels import linear_logprobs_forward
        return linear_logprobs_forward, linear_logprobs_backward
    return torch_linear_logprobs_forward, torch_linear_logprobs_backward


class _LinearTokenLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight, bias, ids) -> (logp, entropy, lse); saves inputs plus two fp32 values per token.

    gather_head (None or a zero-argument callable returning a context manager): entered again around the
    backward's use of weight / bias, which a ZeRO-3 partitioned head needs (``sharded_head.py``); the caller
    runs the forward inside it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, impl, deterministic, chunk_bytes, gather_head):
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        forward_fn, _ = _launchers(impl, grad)
        with torch.autocast(hidden.device.type, enabled=False):  # the tiles keep their fp32 accumulation
            logp, lse, entropy = forward_fn(hidden, weight, bias, ids, temperature)
        ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.temperature, ctx.impl, ctx.deterministic, ctx.chunk_bytes = temperature, impl, deterministic, chunk_bytes
        ctx.gather_head = gather_head
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return (None,) * 9
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype).contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.to(lse.dtype).contiguous()
        _, backward_fn = _launchers(ctx.impl)
        # Why gather again: a ZeRO-3 partition was emptied when the forward's gather context exited.
        with gathered(ctx.gather_head), torch.autocast(hidden.device.type, enabled=False):
            d_hidden, d_weight, d_bias = backward_fn(
                hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy, ctx.temperature,
                need_h, need_w, need_b and bias is not None, ctx.deterministic, ctx.chunk_bytes)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None


def head_token_logprobs(inputs: HeadInputs, deterministic: bool = True, row_mask=None, chunk_bytes=None,
                        gather_head=None):
    """(logp, entropy, lse) shaped like the caller's ids, from validated inputs.

    row_mask (like ids, optional): only rows where it is non-zero are computed (the others get 0 and no
    gradient). The valid rows are gathered into a compact (N_valid, H) batch first, so padding costs neither
    the N x V x H matmuls nor their backward; the loss passes its mask here. chunk_bytes: the deterministic
    Triton backward's d-logits chunk (None: 1% of the N x V fp32 logits). gather_head: see
    ``_LinearTokenLogprobs`` (the caller already holds it open around this call)."""
    hidden, ids, shape = inputs.hidden, inputs.ids, inputs.shape
    rows = None
    if row_mask is not None:
        rows = row_mask.reshape(-1).nonzero().squeeze(1)  # one host sync: the compact batch's size
        if rows.numel() == ids.numel():
            rows = None
        else:
            hidden, ids = hidden.index_select(0, rows), ids.index_select(0, rows)
    logp, entropy, lse = _LinearTokenLogprobs.apply(hidden, inputs.weight, inputs.bias, ids, inputs.temperature,
                                                    inputs.impl, bool(deterministic), chunk_bytes, gather_head)
    if rows is not None:
        # scatter back into zeros; index_copy is differentiable w.r.t. the compact values
        logp, entropy, lse = (torch.zeros(shape.numel(), dtype=t.dtype, device=t.device).index_copy(0, rows, t)
                              for t in (logp, entropy, lse))
    return logp.view(shape), entropy.view(shape), lse.view(shape)


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, bias=None,
                          temperature: float = 1.0, return_entropy: bool = False, impl: str = "auto",
                          deterministic: bool = True, mask: torch.Tensor | None = None, process_group=None,
                          vocab_start: int | None = None, gather_head=None):
    """Per-token log-prob of ``ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``.

    hidden: (B, T, H) or (N, H); weight: (V, H) in hidden's dtype; bias: (V,) or None; ids: (B, T) or (N,)
    with one id per hidden row, values in [0, V). Returns float32 logp shaped like ids (and the entropy when
    ``return_entropy``). Differentiable w.r.t. hidden, weight and bias, each only when it requires grad; under
    ``torch.no_grad()`` it is the one-sweep old/reference-policy path. Never holds an N x V tensor. With ``mask``
    (shaped like ids) only the rows where it is non-zero are computed; the others are 0. Under ``torch.autocast``
    the head runs in the autocast dtype, like ``nn.Linear``.

    Vocab-parallel (``process_group``, a torch.distributed group): ``weight`` / ``bias`` are this rank's contiguous
    shard (V_r, H) / (V_r,) of the vocabulary, starting at full-vocabulary id ``vocab_start`` (None: the sum of
    the lower ranks' shard sizes); hidden, ids and mask are the same on every rank and ids lie in the full
    vocabulary. Every rank gets the full-vocabulary logp / entropy, its own dW / dbias and the all-reduced
    d hidden (``grpo_kernels/vocab_parallel.py``).

    A head sharded for data parallelism is gathered for the call (``grpo_kernels/sharded_head.py``): a DTensor
    ``weight`` / ``bias`` (FSDP2: Shard(0) on one mesh dimension, Replicate on any other) is all-gathered and its
    gradient reduce-scattered back averaged over the mesh; for DeepSpeed ZeRO-3 pass
    ``gather_head=grpo_kernels.zero3_gather_head(weight, bias)`` (any zero-argument callable returning a context
    manager under which weight and bias hold their full values): it is entered around the forward and again in the
    backward (ZeRO-3 empties the partition in between). With gradients, call it inside the model's forward, where
    ZeRO-3 reduces the head's gradient; a bare ``deepspeed.zero.GatheredParameters`` fails there (README,
    "Sharded lm_head without tensor parallelism").
    """
    check_head_options(weight, bias, process_group, vocab_start, gather_head)
    if process_group is not None:
        from .vocab_parallel import vocab_parallel_token_logprobs
        return vocab_parallel_token_logprobs(hidden, weight, ids, bias, temperature, return_entropy, impl,
                                             deterministic, mask, process_group, vocab_start)
    weight, bias = gathered_dtensor_head(weight, bias)
    with gathered(gather_head):
        inputs = HeadInputs.validate(hidden, weight, ids, bias, temperature, impl)
        if mask is not None:
            _checks.tensor("mask", mask)
            if tuple(mask.shape) != tuple(ids.shape):
                raise ValueError(f"mask must have the shape of ids {tuple(ids.shape)}, got {tuple(mask.shape)}")
        logp, entropy, _ = head_token_logprobs(inputs, deterministic, row_mask=mask, gather_head=gather_head)
    return (logp, entropy) if return_entropy else logp
