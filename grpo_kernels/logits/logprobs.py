"""Per-token log-prob, entropy and logsumexp from given logits: the ``logits.sweep`` (Triton kernels of
``kernels/logits_kernels.py``) and ``logits.torch`` (chunked PyTorch below) paths, behind one autograd Function.

Neither path creates a second B x T x V tensor in the forward; the backward writes one d logits buffer, or reuses
the logits buffer with ``inplace_backward=True``. The PyTorch path's rows per chunk come from the plan (its fp32
temporaries fit the memory budget). A soft cap (``softcap``: ``z = softcap * tanh(logits / softcap) / temperature``)
is applied by both paths: in the kernels' registers, and in the PyTorch path's chunk buffers (``reference.soft_cap``'s
maths, in place), with its derivative on d logits; the PyTorch path keeps its two temporaries per chunk with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from ..inputs import LogitsInputs
from ..torch_chunks import NEG_BIG, dlogits_, soft_cap_


# Tile-sized temporaries of the PyTorch path alive at once (the plan's figure: ``planner.plan_logits``).
TORCH_LOGITS_TEMPS = 2


def _torch_forward(logits: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_rows: int,
                   softcap: float | None = None):
    """Chunked eager path: fp32 out (fp64 for fp64 logits); two chunk_rows x V temporaries at a time. With
    ``softcap`` the logits are capped in the chunk's buffer before the temperature."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    flat_ids = ids.reshape(-1)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    N = x.shape[0]
    logp, lse, entropy = (torch.empty(N, dtype=acc, device=x.device) for _ in range(3))
    for start in range(0, N, chunk_rows):
        rows = slice(start, start + chunk_rows)
        z = soft_cap_(x[rows].to(acc, copy=True), softcap).mul_(1.0 / temperature)
        m = z.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        logp[rows] = z.gather(-1, flat_ids[rows].unsqueeze(-1)).squeeze(-1)
        z.sub_(m)  # z - max: the entropy as log s - sum e (z - m) / s, no cancellation of two large numbers
        e = z.exp()
        s = e.sum(-1)
        log_s = torch.log(s)
        chunk_lse = m.squeeze(-1) + log_s
        lse[rows] = chunk_lse
        entropy[rows] = log_s - e.mul_(z.clamp_(min=NEG_BIG)).sum(-1) / s
        logp[rows] -= chunk_lse
        del z, e
    return logp, lse, entropy


def _torch_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature, inplace, chunk_rows,
                    softcap: float | None = None):
    """d logits, chunk by chunk, formed in place: two chunk_rows x V temporaries at a time (with or without
    ``softcap``). ``inplace``: ``logits`` itself holds d logits on return, for any non-overlapping view."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    # Why a copy can be the output: reshape copies views that cannot be flattened (logits[:, :-1], transposes) and
    # that copy is private; each chunk reads its rows before writing them, as in place. In place, it is copied back.
    private = x.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
    out = x if inplace or private else torch.empty_like(x)
    flat_ids = ids.reshape(-1)
    acc = lse.dtype
    inv_t = 1.0 / temperature
    for start in range(0, x.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        g = grad_logp[rows].to(acc).unsqueeze(-1)
        active = g != 0
        h = g_h = None
        if grad_entropy is not None:
            h = entropy[rows].unsqueeze(-1)
            g_h = grad_entropy[rows].to(acc).unsqueeze(-1)
            active = active | (g_h != 0)
        dz = dlogits_(x[rows].to(acc, copy=True), lse[rows].unsqueeze(-1), h, g, g_h, inv_t, softcap,
                      flat_ids[rows].unsqueeze(-1))
        # Why: a token without gradient (padding) gets exact zeros, as on the Triton path, even when its logits hold
        # NaN or inf (0 * NaN would otherwise leak into d logits); a valid token's NaN still propagates.
        dz.masked_fill_(~active, 0.0)
        out[rows].copy_(dz)
        del dz
    if inplace and private:
        logits.copy_(out.view(logits.shape))
        return logits.view(logits.shape)
    return out.view(logits.shape)


@dataclass(frozen=True)
class LogitsSweepParams:
    """The non-differentiable inputs of ``_TokenLogprobs``: impl "triton" | "torch", the PyTorch path's rows per
    chunk, the rows the Triton forward may skip (``row_mask``: their outputs are 0 and get no gradient), and the
    soft cap (None: none)."""

    temperature: float
    impl: str
    inplace: bool
    chunk_rows: int | None = None
    row_mask: torch.Tensor | None = None
    softcap: float | None = None


class _TokenLogprobs(torch.autograd.Function):
    """(logits, ids) -> (logp, entropy, lse); saves logits (no copy), ids and two fp32 values per token."""

    @staticmethod
    def forward(ctx, logits, ids, params: LogitsSweepParams):
        if params.impl == "triton":
            from ..kernels.logits_kernels import logits_logprobs_forward
            logp, lse, entropy = logits_logprobs_forward(logits, ids, params.temperature, softcap=params.softcap,
                                                         row_mask=params.row_mask)
        else:
            logp, lse, entropy = _torch_forward(logits, ids, params.temperature, params.chunk_rows, params.softcap)
        ctx.save_for_backward(logits, ids, lse, entropy)
        ctx.params = params
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        shape = ids.shape
        return logp.view(shape), entropy.view(shape), lse.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        params = ctx.params
        if params.inplace:
            # The first in-place backward overwrote the saved logits (Triton writes bump no version counter).
            if getattr(ctx, "consumed", False):
                raise RuntimeError("token_logprobs(inplace_backward=True): the logits were overwritten by the first "
                                   "backward; a second backward (retain_graph=True) needs inplace_backward=False")
            ctx.consumed = True
        logits, ids, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_logp = grad_logp.reshape(-1).to(lse.dtype)
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).to(lse.dtype)
        if params.impl == "triton":
            from ..kernels.logits_kernels import logits_logprobs_backward
            dlogits = logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy,
                                               params.temperature, softcap=params.softcap, inplace=params.inplace)
        else:
            dlogits = _torch_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, params.temperature,
                                      params.inplace, params.chunk_rows, params.softcap)
        return dlogits, None, None


@custom_op("grpo_kernels::logits_logprobs", mutates_args=())
def _logits_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, impl: str,
                     chunk_rows: int, row_mask: Optional[torch.Tensor],
                     softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) flat (N,), fp32 (fp64 for fp64 logits on the PyTorch path); softcap: None or the cap."""
    if impl == "triton":
        from ..kernels.logits_kernels import logits_logprobs_forward
        logp, lse, entropy = logits_logprobs_forward(logits, ids, temperature, softcap=softcap, row_mask=row_mask)
    else:
        logp, lse, entropy = _torch_forward(logits, ids, temperature, chunk_rows, softcap)
    return logp.reshape(-1), entropy.reshape(-1), lse.reshape(-1)


@_logits_logprobs.register_fake
def _(logits, ids, temperature, impl, chunk_rows, row_mask, softcap):
    dtype = ops.acc_dtype(logits) if impl == "torch" else torch.float32
    return tuple(logits.new_empty((ids.numel(),), dtype=dtype) for _ in range(3))


@custom_op("grpo_kernels::logits_logprobs_backward", mutates_args=())
def _logits_logprobs_backward(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                              grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor], temperature: float,
                              impl: str, chunk_rows: int, softcap: Optional[float]) -> torch.Tensor:
    """d logits (a new buffer shaped like logits)."""
    if impl == "triton":
        from ..kernels.logits_kernels import logits_logprobs_backward
        return logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature,
                                        softcap=softcap, inplace=False)
    return _torch_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature, False, chunk_rows,
                           softcap)


@_logits_logprobs_backward.register_fake
def _(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature, impl, chunk_rows, softcap):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _logits_setup(ctx, inputs, output):
    logits, ids, temperature, impl, chunk_rows, _row_mask, softcap = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(logits, ids, lse, entropy)
    ctx.args = (temperature, impl, chunk_rows, softcap)


def _logits_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    logits, ids, lse, entropy = ctx.saved_tensors
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.reshape(-1).to(lse.dtype)
    grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).to(lse.dtype)
    dlogits = _logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, *ctx.args)
    return dlogits, None, None, None, None, None, None


_logits_logprobs.register_autograd(_logits_backward, setup_context=_logits_setup)


def _compiled_logprobs(logits, ids, params):
    """``_TokenLogprobs`` through the registered op (under torch.compile): (logp, entropy, lse) shaped like ids."""
    logp, entropy, lse = _logits_logprobs(logits, ids, params.temperature, params.impl, params.chunk_rows or 0,
                                          params.row_mask, params.softcap)
    shape = ids.shape
    return logp.view(shape), entropy.view(shape), lse.view(shape)


def logits_token_logprobs(inputs: LogitsInputs, plan, inplace_backward: bool = False, row_mask=None):
    """(logp, entropy, lse) shaped like the ids, from validated inputs (their ``softcap`` included) and their plan.

    row_mask (like ids, optional): the Triton path skips rows where it is 0 (their outputs are 0 and they must get
    no gradient); the loss passes its mask so padded tokens cost no logits traffic."""
    params = LogitsSweepParams(inputs.temperature, inputs.impl, bool(inplace_backward), plan.chunk_rows,
                               row_mask if inputs.impl == "triton" else None, inputs.softcap)
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op does
        return _compiled_logprobs(inputs.logits, inputs.ids, params)
    return _TokenLogprobs.apply(inputs.logits, inputs.ids, params)
