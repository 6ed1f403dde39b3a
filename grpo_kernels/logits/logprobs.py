"""Per-token log-prob, entropy and logsumexp from given logits: the ``logits.sweep`` (Triton kernels of
``kernels/logits_kernels.py``) and ``logits.torch`` (chunked PyTorch below) paths, behind one autograd Function.

Neither path creates a second B x T x V tensor in the forward; the backward writes one d logits buffer, or reuses
the logits buffer with ``inplace_backward=True`` (an eager call only: under torch.compile the registered op always
writes a new buffer). ``sweep_forward`` / ``sweep_backward`` are the path's one body, called by the eager Function
and by the registered op alike (``ops.py``). The PyTorch path's rows per chunk come from the plan (its fp32
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

from .. import _checks, ops
from ..config import LogitTransform
from ..inputs import LogitsInputs
from ..torch_chunks import NEG_BIG, dlogits_, round_, soft_cap_


# Tile-sized temporaries of the PyTorch path alive at once (the plan's figure: ``planner.plan_logits``).
TORCH_LOGITS_TEMPS = 2


def row_blocks(logits: torch.Tensor):
    """(first row, (rows, V) view) pieces covering the rows of ``logits`` in their flat order, each a view (never a
    copy): the whole tensor when its leading dims flatten, else one piece per batch row (``logits[:, :-1]`` and
    other sliced or transposed (B, T, V) views: each ``logits[b]`` is a (T, V) view)."""
    V = logits.shape[-1]
    if logits.dim() == 2 or _checks.rows_flatten(logits):
        return [(0, logits.view(-1, V))]
    T = logits.shape[1]
    return [(b * T, logits[b]) for b in range(logits.shape[0])]


def _chunks(N: int, chunk_rows: int, fixed_rows: bool):
    """(first token, end token, rows of the chunk's temporaries): chunks of ``chunk_rows`` rows over the N tokens;
    ``fixed_rows`` (batch invariance): every chunk's temporaries hold exactly ``chunk_rows`` rows, the last one
    padded with zero rows, so every reduction runs on the same shape whatever N is."""
    return [(c0, min(N, c0 + chunk_rows), chunk_rows if fixed_rows else min(N, c0 + chunk_rows) - c0)
            for c0 in range(0, N, chunk_rows)]


def _chunk_copy(pieces, c0: int, c1: int, rows: int, dtype) -> torch.Tensor:
    """Tokens c0 .. c1 of the logits (``row_blocks`` pieces) as a fresh (rows, V) tensor in ``dtype``, zero rows
    past c1 - c0; one copy, across pieces when the chunk spans several batch rows."""
    first, x = pieces[0]
    if len(pieces) == 1 and rows == c1 - c0:
        return x[c0 - first:c1 - first].to(dtype, copy=True)
    out = torch.zeros((rows, x.shape[-1]), dtype=dtype, device=x.device)
    for first, x in pieces:
        a, b = max(c0, first), min(c1, first + x.shape[0])
        if a < b:
            out[a - c0:b - c0] = x[a - first:b - first]
    return out


def _chunk_write(pieces, c0: int, c1: int, values: torch.Tensor) -> None:
    """values[:c1 - c0] written to tokens c0 .. c1 of the ``row_blocks`` pieces."""
    for first, x in pieces:
        a, b = max(c0, first), min(c1, first + x.shape[0])
        if a < b:
            x[a - first:b - first].copy_(values[a - c0:b - c0])


def _padded_rows(t: torch.Tensor, c0: int, c1: int, rows: int) -> torch.Tensor:
    """t[c0:c1] (flat per-token values) as ``rows`` rows, zeros past c1 - c0."""
    if rows == c1 - c0:
        return t[c0:c1]
    out = t.new_zeros((rows,))
    out[: c1 - c0] = t[c0:c1]
    return out


def _torch_forward(logits: torch.Tensor, ids: torch.Tensor, transform: LogitTransform, chunk_rows: int,
                   fixed_rows: bool = False):
    """Chunked eager path: fp32 out (fp64 for fp64 logits); two chunk_rows x V temporaries at a time, read from the
    logits in place whatever their layout (``row_blocks``). With a soft cap the logits are capped in the chunk's
    buffer before the temperature. ``fixed_rows``: every chunk has chunk_rows rows (``_chunks``)."""
    flat_ids = ids.reshape(-1)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    N = flat_ids.numel()
    logp, lse, entropy = (torch.empty(N, dtype=acc, device=logits.device) for _ in range(3))
    pieces = row_blocks(logits)
    for c0, c1, rows in _chunks(N, chunk_rows, fixed_rows):
        n = c1 - c0
        raw = round_(_chunk_copy(pieces, c0, c1, rows, acc), transform.round_logits)
        z = soft_cap_(raw, transform.softcap).mul_(transform.inv_temperature)
        m = z.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        target = z.gather(-1, _padded_rows(flat_ids, c0, c1, rows).unsqueeze(-1)).squeeze(-1)
        z.sub_(m)  # z - max: the entropy as log s - sum e (z - m) / s, no cancellation of two large numbers
        e = z.exp()
        s = e.sum(-1)
        log_s = torch.log(s)
        chunk_lse = m.squeeze(-1) + log_s
        lse[c0:c1] = chunk_lse[:n]
        entropy[c0:c1] = (log_s - e.mul_(z.clamp_(min=NEG_BIG)).sum(-1) / s)[:n]
        logp[c0:c1] = (target - chunk_lse)[:n]
        del z, e
    return logp, lse, entropy


def _torch_backward(logits, ids, lse, entropy, grads, transform: LogitTransform, inplace: bool, chunk_rows: int,
                    fixed_rows: bool = False):
    """d logits, chunk by chunk, formed in place: two chunk_rows x V temporaries at a time (with or without a soft
    cap). grads: (d loss / d logp, d loss / d entropy or None), flat in the accumulation dtype. ``inplace``:
    ``logits`` itself holds d logits on return, for any non-overlapping view (written piece by piece through
    ``row_blocks``: no copy of a view that does not flatten). ``fixed_rows``: as ``_torch_forward``."""
    grad_logp, grad_entropy = grads
    out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat_ids = ids.reshape(-1)
    acc = lse.dtype
    inv_t = transform.inv_temperature
    pieces, out_pieces = row_blocks(logits), row_blocks(out)
    for c0, c1, rows in _chunks(flat_ids.numel(), chunk_rows, fixed_rows):
        def at(t):
            return _padded_rows(t, c0, c1, rows).to(acc).unsqueeze(-1)

        g = at(grad_logp)
        active = g != 0
        h = g_h = None
        if grad_entropy is not None:
            h, g_h = at(entropy), at(grad_entropy)
            active = active | (g_h != 0)
        raw = round_(_chunk_copy(pieces, c0, c1, rows, acc), transform.round_logits)
        dz = dlogits_(raw, at(lse), h, g, g_h, inv_t, transform.softcap,
                      _padded_rows(flat_ids, c0, c1, rows).unsqueeze(-1))
        # Why: a token without gradient (padding) gets exact zeros, as on the Triton path, even when its logits
        # hold NaN or inf (0 * NaN would otherwise leak into d logits); a valid token's NaN still propagates.
        dz.masked_fill_(~active, 0.0)
        _chunk_write(out_pieces, c0, c1, dz)
        del dz
    # Why a view: autograd's AccumulateGrad keeps (steals) a returned gradient only when nothing else holds its
    # tensor; ``logits`` itself is also held by the saved variables, so it would be cloned into a second buffer.
    return out.view(out.shape)


@ops.options_type(choices={"impl": ("triton", "torch")})
@dataclass(frozen=True)
class SweepOptions:
    """The non-tensor inputs of the path: the logits transform, impl "triton" | "torch", the PyTorch path's rows
    per chunk (from the plan; 0 on the Triton path) and whether every chunk has exactly that many rows (batch
    invariance: the plan's ``batch_invariant``)."""

    transform: LogitTransform
    impl: str
    chunk_rows: int = 0
    fixed_rows: bool = False


def sweep_forward(logits, ids, row_mask, o: SweepOptions):
    """(logp, lse, entropy) flat (N,), fp32 (fp64 for fp64 logits on the PyTorch path). row_mask (like ids, or None):
    the Triton path skips rows where it is 0 (their outputs are 0; they must get no gradient)."""
    if o.impl == "triton":
        from ..kernels.logits_kernels import logits_logprobs_forward  # lazy: creates the Triton kernels
        t = o.transform
        logp, lse, entropy = logits_logprobs_forward(logits, ids, t.temperature, softcap=t.softcap,
                                                     row_mask=row_mask, round_logits=t.round_logits)
    else:
        logp, lse, entropy = _torch_forward(logits, ids, o.transform, o.chunk_rows, o.fixed_rows)
    return logp.reshape(-1), lse.reshape(-1), entropy.reshape(-1)


def sweep_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, o: SweepOptions, inplace: bool):
    """d logits shaped like ``logits`` (written into the logits buffer when ``inplace``); a None incoming gradient
    counts as zeros (d logp) or as no entropy term."""
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.reshape(-1).to(lse.dtype)
    grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).to(lse.dtype)
    if o.impl == "triton":
        from ..kernels.logits_kernels import logits_logprobs_backward
        t = o.transform
        return logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, t.temperature,
                                        softcap=t.softcap, inplace=inplace, round_logits=t.round_logits)
    return _torch_backward(logits, ids, lse, entropy, (grad_logp, grad_entropy), o.transform, inplace,
                           o.chunk_rows, o.fixed_rows)


class _TokenLogprobs(torch.autograd.Function):
    """(logits, ids) -> (logp, entropy, lse); saves logits (no copy), ids and two fp32 values per token."""

    @staticmethod
    def forward(ctx, logits, ids, row_mask, o: SweepOptions, inplace: bool):
        logp, lse, entropy = sweep_forward(logits, ids, row_mask, o)
        ctx.save_for_backward(logits, ids, lse, entropy)
        ctx.options, ctx.inplace = o, inplace
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        shape = ids.shape
        return logp.view(shape), entropy.view(shape), lse.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        if ctx.inplace:
            # The first in-place backward overwrote the saved logits (Triton writes bump no version counter).
            if getattr(ctx, "consumed", False):
                raise RuntimeError("token_logprobs(inplace_backward=True): the logits were overwritten by the first "
                                   "backward; a second backward (retain_graph=True) needs inplace_backward=False")
            ctx.consumed = True
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        logits, ids, lse, entropy = ctx.saved_tensors
        dlogits = sweep_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, ctx.options, ctx.inplace)
        return dlogits, None, None, None, None


@custom_op("grpo_kernels::logits_logprobs", mutates_args=())
def _logits_logprobs(logits: torch.Tensor, ids: torch.Tensor, row_mask: Optional[torch.Tensor],
                     floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) flat (N,) of ``sweep_forward``; floats, ints: ``ops.encode(SweepOptions)``."""
    logp, lse, entropy = sweep_forward(logits, ids, row_mask, ops.decode(SweepOptions, floats, ints))
    return logp, entropy, lse


@_logits_logprobs.register_fake
def _(logits, ids, row_mask, floats, ints):
    o = ops.decode_for_fake(SweepOptions, ints)
    dtype = ops.acc_dtype(logits) if o.impl == "torch" else torch.float32
    return tuple(logits.new_empty((ids.numel(),), dtype=dtype) for _ in range(3))


@custom_op("grpo_kernels::logits_logprobs_backward", mutates_args=())
def _logits_logprobs_backward(logits: torch.Tensor, ids: torch.Tensor, stats: list[Optional[torch.Tensor]],
                              floats: torch.Tensor, ints: list[int]) -> torch.Tensor:
    """d logits (a new buffer shaped like logits) of ``sweep_backward``; stats: (lse, entropy, d logp, d entropy
    or None)."""
    lse, entropy, grad_logp, grad_entropy = stats
    return sweep_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, ops.decode(SweepOptions, floats, ints),
                          inplace=False)


@_logits_logprobs_backward.register_fake
def _(logits, ids, stats, floats, ints):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _logits_setup(ctx, inputs, output):
    logits, ids, _row_mask, floats, ints = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(logits, ids, lse, entropy)
    ctx.options = (floats, ints)


def _logits_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    logits, ids, lse, entropy = ctx.saved_tensors
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
    dlogits = _logits_logprobs_backward(logits, ids, [lse, entropy, grad_logp, grad_entropy], *ctx.options)
    return dlogits, None, None, None, None


_logits_logprobs.register_autograd(_logits_backward, setup_context=_logits_setup)


def logits_token_logprobs(inputs: LogitsInputs, plan, inplace_backward: bool = False, row_mask=None):
    """(logp, entropy, lse) shaped like the ids, from validated inputs and their plan.

    row_mask (like ids, optional): the Triton path skips rows where it is 0 (their outputs are 0 and they must get
    no gradient); the loss passes its mask so padded tokens cost no logits traffic."""
    o = SweepOptions(inputs.transform, inputs.impl, plan.chunk_rows or 0, plan.batch_invariant)
    row_mask = row_mask if inputs.impl == "triton" else None
    if ops.compiling():  # the Function does not trace: its registered op does
        logp, entropy, lse = _logits_logprobs(inputs.logits, inputs.ids, row_mask, *ops.encode(o))
        shape = inputs.ids.shape
        return logp.view(shape), entropy.view(shape), lse.view(shape)
    return _TokenLogprobs.apply(inputs.logits, inputs.ids, row_mask, o, bool(inplace_backward))
