"""Per-token log-prob and entropy straight from hidden states and the lm_head weight: the fused head's
``head.light``, ``head.no_grad`` and ``head.torch`` paths behind one autograd Function (docs/kernels.md, "Fused
head").

logits = hidden @ weight.T (+ bias) are never written whole:
- ``head.light`` (Triton): an O(N) forward (``kernels/linear_forward_kernels.py``, logit tiles stay on chip), then a
  recompute backward over vocab chunks and row blocks sized by the plan (``kernels/linear_backward_kernels.py``);
- ``head.no_grad`` (Triton): per row chunk, cuBLAS fp32 logits + one fold kernel; no backward;
- ``head.torch``: tiles with an online logsumexp, recomputed in the backward (``torch_tiles.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .. import ops
from ..distributed.sharded_head import gathered
from ..inputs import HeadInputs, ValidRows
from .torch_tiles import torch_linear_logprobs_backward, torch_linear_logprobs_forward


@dataclass(frozen=True)
class LightParams:
    """The non-differentiable inputs of ``_HeadLogprobs``: the plan's path and chunking, and the ZeRO-3 gather
    context (None or a zero-argument callable returning a context manager) entered again around the backward's use
    of weight / bias."""

    path: str
    temperature: float
    deterministic: bool = True
    chunk_rows: int | None = None
    chunk_bytes: int | None = None
    row_block: int | None = None
    gather_head: object = None
    working_bytes: int | None = None  # under torch.compile: the budget of the backward layout (Plan.working_bytes)


def _forward(hidden, weight, bias, ids, p: LightParams):
    if p.path == "head.no_grad":
        from ..kernels.linear_epilogue_kernels import head_logprobs_chunked
        return head_logprobs_chunked(hidden, weight, bias, ids, p.temperature, p.chunk_rows * 4 * weight.shape[0])
    if p.path == "head.light":
        from ..kernels.linear_forward_kernels import linear_logprobs_forward
        return linear_logprobs_forward(hidden, weight, bias, ids, p.temperature)
    return torch_linear_logprobs_forward(hidden, weight, bias, ids, p.temperature, p.chunk_rows)


def _backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy, needs, p: LightParams):
    if p.path == "head.light":
        from ..kernels.linear_backward_kernels import linear_logprobs_backward
        return linear_logprobs_backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy,
                                        p.temperature, *needs, p.deterministic, chunk_bytes=p.chunk_bytes,
                                        row_block=p.row_block)
    if p.path == "head.torch":
        return torch_linear_logprobs_backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy,
                                              p.temperature, *needs, p.chunk_rows)
    raise RuntimeError("linear_token_logprobs ran its no-gradient path (the call had no input requiring grad, or ran "
                       "under torch.no_grad): it has no backward")


class _HeadLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight, bias, ids) -> (logp, entropy, lse); saves inputs plus two fp32 values per token."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, params: LightParams):
        with torch.autocast(hidden.device.type, enabled=False):  # the tiles keep their fp32 accumulation
            logp, lse, entropy = _forward(hidden, weight, bias, ids, params)
        if params.path != "head.no_grad":
            ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.params = params
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        return logp, entropy, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, None, None, None
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype).contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.to(lse.dtype).contiguous()
        # Why gather again: a ZeRO-3 partition was emptied when the forward's gather context exited.
        with gathered(ctx.params.gather_head), torch.autocast(hidden.device.type, enabled=False):
            d_hidden, d_weight, d_bias = _backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy,
                                                   (need_h, need_w, need_b and bias is not None), ctx.params)
        return d_hidden, d_weight, d_bias, None, None


def head_token_logprobs(inputs: HeadInputs, plan, rows: ValidRows, deterministic: bool = True, gather_head=None):
    """(logp, entropy, lse) shaped like the caller's ids, from validated inputs and their plan.

    Only the rows ``rows`` keeps are computed (the others get 0 and no gradient): padding costs neither the
    N x V x H matmuls nor their backward. gather_head: see ``LightParams`` (the caller holds it open around this)."""
    inputs = inputs.in_compute_dtype()
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    params = LightParams(plan.path, inputs.temperature, bool(deterministic), plan.chunk_rows, plan.chunk_bytes,
                         plan.row_block, gather_head, plan.working_bytes)
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op (ops.py) does
        logp, entropy, lse = ops.head_logprobs(hidden, inputs.weight, inputs.bias, ids, rows.deferred, params)
    else:
        logp, entropy, lse = _HeadLogprobs.apply(hidden, inputs.weight, inputs.bias, ids, params)
    logp, entropy, lse = rows.scatter(logp, entropy, lse)
    shape = inputs.shape
    return logp.view(shape), entropy.view(shape), lse.view(shape)
