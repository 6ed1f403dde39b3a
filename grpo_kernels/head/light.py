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
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from ..distributed.sharded_head import gathered
from ..inputs import HeadInputs, ValidRows
from .torch_tiles import torch_linear_logprobs_backward, torch_linear_logprobs_forward


@dataclass(frozen=True)
class LightParams:
    """The non-differentiable inputs of ``_HeadLogprobs``: the plan's path and chunking, the temperature and soft cap
    (None: none) of the logits, and the ZeRO-3 gather context (None or a zero-argument callable returning a context
    manager) entered again around the backward's use of weight / bias."""

    path: str
    temperature: float
    deterministic: bool = True
    softcap: float | None = None
    chunk_rows: int | None = None
    chunk_bytes: int | None = None
    row_block: int | None = None
    gather_head: object = None
    working_bytes: int | None = None  # under torch.compile: the budget of the backward layout (Plan.working_bytes)


def _forward(hidden, weight, bias, ids, p: LightParams):
    if p.path == "head.no_grad":
        from ..kernels.linear_epilogue_kernels import head_logprobs_chunked
        return head_logprobs_chunked(hidden, weight, bias, ids, p.temperature, p.chunk_rows * 4 * weight.shape[0],
                                     softcap=p.softcap)
    if p.path == "head.light":
        from ..kernels.linear_forward_kernels import linear_logprobs_forward
        return linear_logprobs_forward(hidden, weight, bias, ids, p.temperature, softcap=p.softcap)
    return torch_linear_logprobs_forward(hidden, weight, bias, ids, p.temperature, p.chunk_rows, softcap=p.softcap)


def _backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy, needs, p: LightParams):
    if p.path == "head.light":
        from ..kernels.linear_backward_kernels import linear_logprobs_backward
        return linear_logprobs_backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy,
                                        p.temperature, *needs, p.deterministic, chunk_bytes=p.chunk_bytes,
                                        row_block=p.row_block, softcap=p.softcap)
    if p.path == "head.torch":
        return torch_linear_logprobs_backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy,
                                              p.temperature, *needs, p.chunk_rows, softcap=p.softcap)
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


def _light_params(path, temperature, deterministic, chunk_rows, chunk_bytes, row_block, softcap):
    return LightParams(path, temperature, deterministic, softcap, chunk_rows or None, chunk_bytes or None,
                       row_block or None)


def _deferred_layout(p, n, weight, dtype, device, working_bytes, needs):
    """``p`` with the light backward's layout for ``n`` rows within ``working_bytes`` (a plan made under
    torch.compile leaves it to run time: ``planner._plan_light``)."""
    if p.path != "head.light" or p.chunk_bytes is not None or working_bytes <= 0:
        return p
    from dataclasses import replace

    from ..kernels.linear_backward_kernels import backward_layout
    V, H = weight.shape
    layout = backward_layout(n, V, H, dtype, device, working_bytes, *needs, p.deterministic)
    if layout is None:
        raise ValueError(f"memory_budget leaves {working_bytes} bytes, below the smallest backward layout of the "
                         "memory-light head path; raise memory_budget (or leave it None)")
    return replace(p, chunk_bytes=layout.chunk_bytes, row_block=layout.row_block)


@custom_op("grpo_kernels::head_logprobs", mutates_args=())
def _head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                   row_mask: Optional[torch.Tensor], path: str, temperature: float, deterministic: bool,
                   chunk_rows: int, chunk_bytes: int, row_block: int, working_bytes: int,
                   softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) (N,) of the fused head, in the accumulation dtype; 0 at the rows ``row_mask`` drops."""
    p = _light_params(path, temperature, deterministic, chunk_rows, chunk_bytes, row_block, softcap)
    N = hidden.shape[0]
    index = ops.valid_index(row_mask, N)
    h, i = ops.take_rows(index, hidden, ids)
    with torch.autocast(hidden.device.type, enabled=False):
        logp, lse, entropy = _forward(h, weight, bias, i, p)
    return ops.put_rows(index, N, logp), ops.put_rows(index, N, entropy), ops.put_rows(index, N, lse)


@_head_logprobs.register_fake
def _(hidden, weight, bias, ids, row_mask, path, temperature, deterministic, chunk_rows, chunk_bytes, row_block,
      working_bytes, softcap):
    dtype = ops.acc_dtype(hidden) if path == "head.torch" else torch.float32
    return tuple(hidden.new_empty((hidden.shape[0],), dtype=dtype) for _ in range(3))


@custom_op("grpo_kernels::head_logprobs_backward", mutates_args=())
def _head_logprobs_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            ids: torch.Tensor, row_mask: Optional[torch.Tensor], lse: torch.Tensor,
                            entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                            path: str, temperature: float, deterministic: bool,
                            chunk_rows: int, chunk_bytes: int, row_block: int, working_bytes: int,
                            softcap: Optional[float], need_hidden: bool, need_weight: bool,
                            need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias); an empty (0,) tensor stands for a gradient not wanted (an op returns no None)."""
    p = _light_params(path, temperature, deterministic, chunk_rows, chunk_bytes, row_block, softcap)
    needs = (need_hidden, need_weight, need_bias and bias is not None)
    N = hidden.shape[0]
    index = ops.valid_index(row_mask, N)
    h, i, lse, entropy, grad_logp, grad_entropy = ops.take_rows(index, hidden, ids, lse, entropy, grad_logp,
                                                                grad_entropy)
    p = _deferred_layout(p, h.shape[0], weight, hidden.dtype, hidden.device, working_bytes, needs)
    with torch.autocast(hidden.device.type, enabled=False):
        d_h, d_w, d_b = _backward(h, weight, bias, i, lse, entropy, grad_logp, grad_entropy, needs, p)
    grads = (ops.put_rows(index, N, d_h), d_w, d_b)
    return tuple(hidden.new_empty((0,)) if g is None else g.to(t.dtype)
                 for g, t in zip(grads, (hidden, weight, hidden if bias is None else bias)))


@_head_logprobs_backward.register_fake
def _(hidden, weight, bias, ids, row_mask, lse, entropy, grad_logp, grad_entropy, path, temperature, deterministic,
      chunk_rows, chunk_bytes, row_block, working_bytes, softcap, need_hidden, need_weight, need_bias):
    need_bias = need_bias and bias is not None
    return (torch.empty_like(hidden) if need_hidden else hidden.new_empty((0,)),
            torch.empty_like(weight) if need_weight else hidden.new_empty((0,)),
            torch.empty_like(bias) if need_bias else hidden.new_empty((0,)))


def _head_setup(ctx, inputs, output):
    hidden, weight, bias, ids, row_mask, *args = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, ids, row_mask, lse, entropy)
    ctx.args = tuple(args)


def _head_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, bias, ids, row_mask, lse, entropy = ctx.saved_tensors
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.to(lse.dtype).contiguous()
    grad_entropy = None if grad_entropy is None else grad_entropy.to(lse.dtype).contiguous()
    d_h, d_w, d_b = _head_logprobs_backward(hidden, weight, bias, ids, row_mask, lse, entropy, grad_logp, grad_entropy,
                                            *ctx.args, bool(need_h), bool(need_w), bool(need_b and bias is not None))
    return (d_h if need_h else None, d_w if need_w else None, d_b if need_b and bias is not None else None,
            None, None, *([None] * len(ctx.args)))


_head_logprobs.register_autograd(_head_backward, setup_context=_head_setup)


def _compiled_head_logprobs(hidden, weight, bias, ids, row_mask, params):
    """``_HeadLogprobs`` through the registered op (under torch.compile): (logp, entropy, lse) (N,); row_mask:
    ``ValidRows.deferred``."""
    return _head_logprobs(hidden, weight, bias, ids, row_mask, params.path, params.temperature, params.deterministic,
                          params.chunk_rows or 0, params.chunk_bytes or 0, params.row_block or 0,
                          params.working_bytes or 0, params.softcap)


def head_token_logprobs(inputs: HeadInputs, plan, rows: ValidRows, deterministic: bool = True, gather_head=None):
    """(logp, entropy, lse) shaped like the caller's ids, from validated inputs and their plan.

    Only the rows ``rows`` keeps are computed (the others get 0 and no gradient): padding costs neither the
    N x V x H matmuls nor their backward. gather_head: see ``LightParams`` (the caller holds it open around this)."""
    inputs = inputs.in_compute_dtype()
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    params = LightParams(plan.path, inputs.temperature, bool(deterministic), inputs.softcap, plan.chunk_rows,
                         plan.chunk_bytes, plan.row_block, gather_head, plan.working_bytes)
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op does
        logp, entropy, lse = _compiled_head_logprobs(hidden, inputs.weight, inputs.bias, ids, rows.deferred, params)
    else:
        logp, entropy, lse = _HeadLogprobs.apply(hidden, inputs.weight, inputs.bias, ids, params)
    logp, entropy, lse = rows.scatter(logp, entropy, lse)
    shape = inputs.shape
    return logp.view(shape), entropy.view(shape), lse.view(shape)
