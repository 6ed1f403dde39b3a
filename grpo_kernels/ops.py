"""Registered ops (``torch.library.custom_op``): the compute that ``torch.compile`` cannot trace, behind the
``grpo_kernels::`` namespace, each with a fake (meta) implementation and its autograd formula.

Why ops: the paths' bodies launch Triton kernels or loop over row / vocab chunks in Python, and carry
non-tensor state (the plan's chunking, the loss options). Dynamo traces the public functions' validation and
planning (they are trace-safe: their host syncs are skipped while compiling) and each op stays one opaque node of
the graph, whose fake implementation gives the output shapes from symbolic input shapes (so that a varying T
does not recompile) and whose autograd registration gives AOTAutograd the backward.

Eager calls do not come here: they run the same kernels through the paths' autograd Functions, which keep the
eager-only memory savings (gradients scaled in place, d logits in the logits buffer). The entry points switch to
these ops while ``torch.compiler.is_compiling()``. The ops:

- ``logits_logprobs`` / ``logits_logprobs_backward``: the ``logits.sweep`` / ``logits.torch`` sweeps;
- ``head_logprobs`` / ``head_logprobs_backward``: the fused head's ``head.light``, ``head.no_grad``, ``head.torch``;
- ``token_stage``: the per-token loss kernel (Triton) of the ``logits.sweep`` / ``head.light`` losses;
- ``logits_loss_fast``: ``logits.fast`` (d logits made in the forward, scaled in the backward);
- ``head_loss_fast``: ``head.fast`` (d hidden, d weight, d bias made in the forward, scaled in the backward).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.library import custom_op

from .config import GRPOLossConfig
from .loss_types import LOSS_TABLE

# The loss options the loss kernels read, passed to the ops as scalars (an op takes no dataclass).
_CFG_FIELDS = ("loss_type", "beta", "epsilon_low", "epsilon_high", "delta", "temperature", "use_bias_correction_kl",
               "sapo_temperature_pos", "sapo_temperature_neg", "entropy_coef")


def config_args(cfg: GRPOLossConfig) -> dict:
    """The loss options of ``cfg`` that the loss ops take, as keyword arguments."""
    return {name: getattr(cfg, name) for name in _CFG_FIELDS}


def _config(loss_type, beta, epsilon_low, epsilon_high, delta, temperature, use_bias_correction_kl,
            sapo_temperature_pos, sapo_temperature_neg, entropy_coef) -> GRPOLossConfig:
    return GRPOLossConfig(loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                          delta=delta, temperature=temperature, use_bias_correction_kl=use_bias_correction_kl,
                          sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                          entropy_coef=entropy_coef)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _valid_index(row_mask, n: int):
    """The flat indices of the rows ``row_mask`` keeps, or None for all ``n``: the compaction of ``ValidRows``, made
    here at run time because its size depends on the data (a host sync the compiled graph cannot make)."""
    if row_mask is None:
        return None
    index = (row_mask.reshape(-1) != 0).nonzero().squeeze(1)
    return None if index.numel() == n else index


def _take(index, *tensors):
    return tuple(t if t is None or index is None else t.index_select(0, index) for t in tensors)


def _put(index, n: int, t):
    """A compact tensor back on all ``n`` rows, zeros at the rows left out."""
    if t is None or index is None:
        return t
    return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=t.device).index_copy_(0, index, t)


def check_head_compilable(process_group, gather_head) -> None:
    """Under torch.compile, refuse the sharded heads: their collectives and gather contexts run in Python around
    the kernels, outside any op."""
    if not torch.compiler.is_compiling():
        return
    if process_group is not None:
        raise ValueError("process_group (a vocab-parallel head) is not supported under torch.compile; call the "
                         "function outside the compiled region")
    if gather_head is not None:
        raise ValueError("gather_head (a ZeRO-3 partitioned head) is not supported under torch.compile; call the "
                         "function outside the compiled region")


# ------------------------------------------------------------------------------------------ logits log-probs

@custom_op("grpo_kernels::logits_logprobs", mutates_args=())
def _logits_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, impl: str,
                     chunk_rows: int, row_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(logp, entropy, lse) flat (N,), fp32 (fp64 for fp64 logits on the PyTorch path)."""
    if impl == "triton":
        from .kernels.logits_kernels import logits_logprobs_forward
        logp, lse, entropy = logits_logprobs_forward(logits, ids, temperature, row_mask=row_mask)
    else:
        from .logits.logprobs import _torch_forward
        logp, lse, entropy = _torch_forward(logits, ids, temperature, chunk_rows)
    return logp.reshape(-1), entropy.reshape(-1), lse.reshape(-1)


@_logits_logprobs.register_fake
def _(logits, ids, temperature, impl, chunk_rows, row_mask):
    dtype = _acc_dtype(logits) if impl == "torch" else torch.float32
    return tuple(logits.new_empty((ids.numel(),), dtype=dtype) for _ in range(3))


@custom_op("grpo_kernels::logits_logprobs_backward", mutates_args=())
def _logits_logprobs_backward(logits: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                              grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor], temperature: float,
                              impl: str, chunk_rows: int) -> torch.Tensor:
    """d logits (a new buffer shaped like logits)."""
    if impl == "triton":
        from .kernels.logits_kernels import logits_logprobs_backward
        return logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature,
                                        inplace=False)
    from .logits.logprobs import _torch_backward
    return _torch_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature, False, chunk_rows)


@_logits_logprobs_backward.register_fake
def _(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature, impl, chunk_rows):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _logits_setup(ctx, inputs, output):
    logits, ids, temperature, impl, chunk_rows, _row_mask = inputs
    _logp, entropy, lse = output
    ctx.save_for_backward(logits, ids, lse, entropy)
    ctx.args = (temperature, impl, chunk_rows)


def _logits_backward(ctx, grad_logp, grad_entropy, _grad_lse):
    logits, ids, lse, entropy = ctx.saved_tensors
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.reshape(-1).to(lse.dtype)
    grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).to(lse.dtype)
    dlogits = _logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, *ctx.args)
    return dlogits, None, None, None, None, None


_logits_logprobs.register_autograd(_logits_backward, setup_context=_logits_setup)


def logits_logprobs(logits, ids, params):
    """``logits.logprobs._TokenLogprobs`` as an op: (logp, entropy, lse) shaped like ids."""
    logp, entropy, lse = _logits_logprobs(logits, ids, params.temperature, params.impl, params.chunk_rows or 0,
                                          params.row_mask)
    shape = ids.shape
    return logp.view(shape), entropy.view(shape), lse.view(shape)


# --------------------------------------------------------------------------------------------- head log-probs

def _light_params(path, temperature, deterministic, chunk_rows, chunk_bytes, row_block):
    from .head.light import LightParams
    return LightParams(path, temperature, deterministic, chunk_rows or None, chunk_bytes or None, row_block or None)


def _deferred_layout(p, n, weight, dtype, device, working_bytes, needs):
    """``p`` with the light backward's layout for ``n`` rows within ``working_bytes`` (a plan made under
    torch.compile leaves it to run time: ``planner._plan_light``)."""
    if p.path != "head.light" or p.chunk_bytes is not None or working_bytes <= 0:
        return p
    from dataclasses import replace

    from .kernels.linear_backward_kernels import backward_layout
    V, H = weight.shape
    layout = backward_layout(n, V, H, dtype, device, working_bytes, *needs, p.deterministic)
    if layout is None:
        raise ValueError(f"memory_budget leaves {working_bytes} bytes, below the smallest backward layout of the "
                         "memory-light head path; raise memory_budget (or leave it None)")
    return replace(p, chunk_bytes=layout.chunk_bytes, row_block=layout.row_block)


@custom_op("grpo_kernels::head_logprobs", mutates_args=())
def _head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                   row_mask: Optional[torch.Tensor], path: str, temperature: float, deterministic: bool, chunk_rows: int, chunk_bytes: int,
                   row_block: int, working_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) (N,) of the fused head, in the accumulation dtype; 0 at the rows ``row_mask`` drops."""
    from .head.light import _forward
    p = _light_params(path, temperature, deterministic, chunk_rows, chunk_bytes, row_block)
    N = hidden.shape[0]
    index = _valid_index(row_mask, N)
    h, i = _take(index, hidden, ids)
    with torch.autocast(hidden.device.type, enabled=False):
        logp, lse, entropy = _forward(h, weight, bias, i, p)
    return _put(index, N, logp), _put(index, N, entropy), _put(index, N, lse)


@_head_logprobs.register_fake
def _(hidden, weight, bias, ids, row_mask, path, temperature, deterministic, chunk_rows, chunk_bytes, row_block,
      working_bytes):
    dtype = _acc_dtype(hidden) if path == "head.torch" else torch.float32
    return tuple(hidden.new_empty((hidden.shape[0],), dtype=dtype) for _ in range(3))


@custom_op("grpo_kernels::head_logprobs_backward", mutates_args=())
def _head_logprobs_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            ids: torch.Tensor, row_mask: Optional[torch.Tensor], lse: torch.Tensor,
                            entropy: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: Optional[torch.Tensor],
                            path: str, temperature: float, deterministic: bool,
                            chunk_rows: int, chunk_bytes: int, row_block: int, working_bytes: int,
                            need_hidden: bool, need_weight: bool,
                            need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias); an empty (0,) tensor stands for a gradient not wanted (an op returns no None)."""
    from .head.light import _backward
    p = _light_params(path, temperature, deterministic, chunk_rows, chunk_bytes, row_block)
    needs = (need_hidden, need_weight, need_bias and bias is not None)
    N = hidden.shape[0]
    index = _valid_index(row_mask, N)
    h, i, lse, entropy, grad_logp, grad_entropy = _take(index, hidden, ids, lse, entropy, grad_logp, grad_entropy)
    p = _deferred_layout(p, h.shape[0], weight, hidden.dtype, hidden.device, working_bytes, needs)
    with torch.autocast(hidden.device.type, enabled=False):
        d_h, d_w, d_b = _backward(h, weight, bias, i, lse, entropy, grad_logp, grad_entropy, needs, p)
    grads = (_put(index, N, d_h), d_w, d_b)
    return tuple(hidden.new_empty((0,)) if g is None else g.to(t.dtype)
                 for g, t in zip(grads, (hidden, weight, hidden if bias is None else bias)))


@_head_logprobs_backward.register_fake
def _(hidden, weight, bias, ids, row_mask, lse, entropy, grad_logp, grad_entropy, path, temperature, deterministic, chunk_rows,
      chunk_bytes, row_block, working_bytes, need_hidden, need_weight, need_bias):
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


def head_logprobs(hidden, weight, bias, ids, row_mask, params):
    """``head.light._HeadLogprobs`` as an op: (logp, entropy, lse) (N,); row_mask: ``ValidRows.deferred``."""
    return _head_logprobs(hidden, weight, bias, ids, row_mask, params.path, params.temperature, params.deterministic,
                          params.chunk_rows or 0, params.chunk_bytes or 0, params.row_block or 0,
                          params.working_bytes or 0)


# ------------------------------------------------------------------------------------------ per-token stage

@custom_op("grpo_kernels::token_stage", mutates_args=())
def _token_stage(logps: torch.Tensor, old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
                 advantages: torch.Tensor, is_ratio: Optional[torch.Tensor], mask_f: torch.Tensor,
                 weights: torch.Tensor, loss_type: str, beta: float, epsilon_low: float, epsilon_high: float,
                 delta: Optional[float], temperature: float, use_bias_correction_kl: bool,
                 sapo_temperature_pos: float, sapo_temperature_neg: float,
                 entropy_coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 0-dim, term sums fp64, d loss / d logps (B, T) fp32) of the Triton per-token stage."""
    from .kernels.token_loss_kernels import token_loss_forward
    cfg = _config(loss_type, beta, epsilon_low, epsilon_high, delta, temperature, use_bias_correction_kl,
                  sapo_temperature_pos, sapo_temperature_neg, entropy_coef)
    grad, sums = token_loss_forward(logps, old_logps, ref_logps, advantages, is_ratio, mask_f, weights, cfg,
                                    LOSS_TABLE[loss_type].policy_kind)
    return sums[0].to(torch.float32), sums, grad


@_token_stage.register_fake
def _(logps, old_logps, ref_logps, advantages, is_ratio, mask_f, weights, *cfg):
    from .kernels.token_loss_kernels import N_SUMS
    return (logps.new_empty((), dtype=torch.float32), logps.new_empty((N_SUMS,), dtype=torch.float64),
            logps.new_empty(logps.shape, dtype=torch.float32))


def _stage_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _stage_backward(ctx, grad_loss, _grad_sums, _grad_grad):
    (grad,) = ctx.saved_tensors
    return (grad_loss * grad,) + (None,) * 16


_token_stage.register_autograd(_stage_backward, setup_context=_stage_setup)


def token_stage(logps, params):
    """``token_stage._TokenStage`` as an op: (loss, term sums)."""
    batch, cfg = params.batch, params.cfg
    loss, sums, _ = _token_stage(logps, batch.old_logps, batch.ref_logps, batch.advantages, batch.is_ratio,
                                 params.weights.mask_f, params.weights.weights, **config_args(cfg))
    return loss, sums


# ---------------------------------------------------------------------------------------------- logits.fast

@custom_op("grpo_kernels::logits_loss_fast", mutates_args=())
def _logits_loss_fast(logits: torch.Tensor, ids: torch.Tensor, mask_f: torch.Tensor, weights: torch.Tensor,
                      old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], advantages: torch.Tensor,
                      is_ratio: Optional[torch.Tensor], count: torch.Tensor, loss_type: str, beta: float,
                      epsilon_low: float, epsilon_high: float, delta: Optional[float], temperature: float,
                      use_bias_correction_kl: bool, sapo_temperature_pos: float, sapo_temperature_neg: float,
                      entropy_coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 0-dim, term sums fp64 (N_TERMS,), d logits of the loss) from the ``logits.fast`` row kernel;
    count: the 0-dim valid-token count (>= 1) of the entropy bonus."""
    from .kernels.logits_loss_kernels import grad_in_forward
    from .metrics import ENTROPY, LOSS
    cfg = _config(loss_type, beta, epsilon_low, epsilon_high, delta, temperature, use_bias_correction_kl,
                  sapo_temperature_pos, sapo_temperature_neg, entropy_coef)
    h_scale = None if entropy_coef == 0.0 else (-entropy_coef / count).float().reshape(1)
    dlogits, terms = grad_in_forward(logits, ids, mask_f.contiguous(), weights, old_logps, ref_logps, advantages,
                                     is_ratio, h_scale, cfg, LOSS_TABLE[loss_type].policy_kind, False)
    sums = terms.sum(0, dtype=torch.float64)
    loss = sums[LOSS]
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * sums[ENTROPY] / count.double()
    return loss.float(), sums, dlogits.contiguous()


@_logits_loss_fast.register_fake
def _(logits, ids, mask_f, weights, old_logps, ref_logps, advantages, is_ratio, count, *cfg):
    from .kernels.logits_loss_kernels import N_TERMS
    return (logits.new_empty((), dtype=torch.float32), logits.new_empty((N_TERMS,), dtype=torch.float64),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


def _fast_setup(ctx, inputs, output):
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])


def _fast_backward(ctx, grad_loss, _grad_sums, _grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    # the scale in fp32, one rounding to the logits' dtype (as the eager scale kernel)
    return ((dlogits.float() * grad_loss).to(dlogits.dtype),) + (None,) * 18


_logits_loss_fast.register_autograd(_fast_backward, setup_context=_fast_setup)


def logits_loss_fast(logits, params):
    """``logits.fast._LogitsLossInForward`` as an op: (loss, term sums)."""
    w = params.weights
    loss, sums, _ = _logits_loss_fast(logits, params.ids, w.mask_f, w.weights, params.batch.old_logps,
                                      params.batch.ref_logps, params.batch.advantages, params.batch.is_ratio,
                                      w.count, **config_args(params.cfg))
    return loss, sums


# ------------------------------------------------------------------------------------------------ head.fast

@custom_op("grpo_kernels::head_loss_fast", mutates_args=())
def _head_loss_fast(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                    row_mask: Optional[torch.Tensor], adv: torch.Tensor, w: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
                    isr: Optional[torch.Tensor], ge: Optional[torch.Tensor], entropy_scale: torch.Tensor,
                    dtype: torch.dtype, rows: int, need_hidden: bool, need_weight: bool, need_bias: bool,
                    loss_type: str, beta: float, epsilon_low: float, epsilon_high: float, delta: Optional[float],
                    temperature: float, use_bias_correction_kl: bool, sapo_temperature_pos: float,
                    sapo_temperature_neg: float, entropy_coef: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(loss, term sums fp64, d hidden, d weight fp32, d bias fp32) of ``head.fast`` at an incoming gradient of 1;
    a gradient not wanted is an empty (0,) tensor."""
    from .kernels.linear_epilogue_kernels import head_loss_and_grads
    cfg = _config(loss_type, beta, epsilon_low, epsilon_high, delta, temperature, use_bias_correction_kl,
                  sapo_temperature_pos, sapo_temperature_neg, entropy_coef)
    N = hidden.shape[0]
    index = _valid_index(row_mask, N)
    hidden_rows, ids, adv, w, old, ref, isr = _take(index, hidden, ids, adv, w, old, ref, isr)
    tokens = {"adv": adv, "w": w, "old": old, "ref": ref, "isr": isr}
    if ge is not None:
        tokens["ge"] = ge
    need_bias = need_bias and bias is not None
    h, wt, b = (None if t is None else t.to(dtype) for t in (hidden_rows, weight, bias))
    with torch.autocast(hidden.device.type, enabled=False):
        _logp, ent, terms, dh, dw32, db32 = head_loss_and_grads(h, wt, b, ids, tokens, cfg,
                                                                 LOSS_TABLE[loss_type].policy_kind, rows,
                                                                 need_hidden, need_weight, need_bias)
    sums = torch.cat([terms.double().sum(0), ent.double().sum().reshape(1)])
    loss = (sums[0] - entropy_coef * sums[-1] * entropy_scale).float()
    empty = hidden.new_empty((0,))
    return (loss, sums, empty if dh is None else _put(index, N, dh.to(hidden.dtype)), empty if dw32 is None else dw32,
            empty if db32 is None else db32)


@_head_loss_fast.register_fake
def _(hidden, weight, bias, ids, row_mask, adv, w, old, ref, isr, ge, entropy_scale, dtype, rows, need_hidden, need_weight,
      need_bias, *cfg):
    from .kernels.linear_epilogue_kernels import N_ROW_TERMS
    empty = hidden.new_empty((0,))
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32), hidden.new_empty((N_ROW_TERMS + 1,), dtype=torch.float64),
            torch.empty_like(hidden) if need_hidden else empty,
            weight.new_empty(weight.shape, dtype=f32) if need_weight else empty,
            bias.new_empty(bias.shape, dtype=f32) if need_bias and bias is not None else empty)


def _head_fast_setup(ctx, inputs, output):
    hidden, weight, bias = inputs[:3]
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.save_for_backward(*output[2:])
    ctx.mark_non_differentiable(*output[1:])


def _head_fast_backward(ctx, grad_loss, *_unused):
    grads = []
    for g, dtype, need in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3]):
        # one rounding from the fp32 accumulator, as the eager hand-out
        grads.append((g * grad_loss).to(dtype) if need and dtype is not None else None)
    return (*grads,) + (None,) * 24


_head_loss_fast.register_autograd(_head_fast_backward, setup_context=_head_fast_setup)


def head_loss_fast(hidden, weight, bias, ids, row_mask, params, needs):
    """``head.fast._HeadLossInForward`` as an op: (loss, term sums); row_mask: ``ValidRows.deferred``; needs:
    (hidden, weight, bias) gradient wanted."""
    t = params.tokens
    loss, sums, *_ = _head_loss_fast(hidden, weight, bias, ids, row_mask, t["adv"], t["w"], t["old"], t["ref"], t["isr"],
                                     t.get("ge"), params.entropy_scale, params.dtype, params.rows, *needs,
                                     **config_args(params.cfg))
    return loss, sums
