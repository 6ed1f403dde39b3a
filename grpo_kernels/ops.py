"""torch.compile support shared by the paths: each path registers its untraceable compute as a
``torch.library.custom_op`` beside its autograd Function, with a fake (meta) implementation and its autograd
formula; this module holds what those registrations share.

Why ops: the paths' bodies launch Triton kernels or loop over row / vocab chunks in Python, and carry non-tensor
state (the plan's chunking, the loss options). Dynamo traces the public functions' validation and planning (trace-
safe: their host syncs are skipped while compiling) and each op stays one opaque node of the graph, whose fake
implementation gives the output shapes from symbolic input shapes (so that a varying T does not recompile) and
whose autograd registration gives AOTAutograd the backward.

Eager calls keep the autograd Functions, with their eager-only memory savings (gradients scaled in place, d logits
written into the logits buffer); the entry points switch to the ops while ``torch.compiler.is_compiling()``. The
ops, in the ``grpo_kernels`` namespace (``torch.ops.grpo_kernels.<name>``):

- ``logits_logprobs`` / ``logits_logprobs_backward`` (``logits/logprobs.py``): ``logits.sweep``, ``logits.torch``;
- ``head_logprobs`` / ``head_logprobs_backward`` (``head/light.py``): ``head.light``, ``head.no_grad``,
  ``head.torch``;
- ``token_stage`` (``token_stage.py``): the Triton per-token stage after a sweep;
- ``logits_loss_fast`` (``logits/fast.py``): ``logits.fast``;
- ``head_loss_fast`` (``head/fast.py``): ``head.fast``.
"""
from __future__ import annotations

import torch

from .config import GRPOLossConfig

# The loss options the loss kernels read, passed to the ops as scalars (an op takes no dataclass).
_CFG_FIELDS = ("loss_type", "beta", "epsilon_low", "epsilon_high", "delta", "temperature", "use_bias_correction_kl",
               "sapo_temperature_pos", "sapo_temperature_neg", "entropy_coef", "softcap")


def config_args(cfg: GRPOLossConfig) -> dict:
    """The loss options of ``cfg`` that the loss ops take, as keyword arguments."""
    return {name: getattr(cfg, name) for name in _CFG_FIELDS}


def config_from_args(loss_type, beta, epsilon_low, epsilon_high, delta, temperature, use_bias_correction_kl,
                     sapo_temperature_pos, sapo_temperature_neg, entropy_coef, softcap=None) -> GRPOLossConfig:
    """The config an op was given as ``config_args`` (the options the kernels read; the others at their default)."""
    return GRPOLossConfig(loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                          delta=delta, temperature=temperature, use_bias_correction_kl=use_bias_correction_kl,
                          sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                          entropy_coef=entropy_coef, softcap=softcap)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The PyTorch paths' accumulation dtype: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def valid_index(row_mask, n: int):
    """The flat indices of the rows ``row_mask`` keeps, or None for all ``n``: the compaction of ``ValidRows``, made
    by an op when it runs (``ValidRows.deferred``) because its size depends on the data."""
    if row_mask is None:
        return None
    index = (row_mask.reshape(-1) != 0).nonzero().squeeze(1)
    return None if index.numel() == n else index


def take_rows(index, *tensors):
    """Each tensor's rows at ``index`` (None: all rows; None tensors stay None)."""
    return tuple(t if t is None or index is None else t.index_select(0, index) for t in tensors)


def put_rows(index, n: int, t):
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


def grads_for_inputs(ctx, *grads) -> tuple:
    """A registered op's backward result: the given gradients of its leading inputs, None for every other input
    (their number recorded by ``setup_context`` as ``ctx.n_inputs``), so that no backward pads by hand."""
    return grads + (None,) * (ctx.n_inputs - len(grads))


def setup_saving_gradient_output(ctx, inputs, output) -> None:
    """``setup_context`` of the ops whose third output is the gradient their forward made (the logits fast path's
    d logits, the token stage's d loss / d logp): it is saved for the backward, it and the sums are not differentiable."""
    ctx.n_inputs = len(inputs)
    ctx.save_for_backward(output[2])
    ctx.mark_non_differentiable(output[1], output[2])
