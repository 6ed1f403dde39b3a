"""``grpo_kernels.explain``: which path a call would take, why, and the transient memory it would allocate.

It validates and plans exactly as the call itself does (the same functions), but runs nothing: tensors may be
meta copies (``x.to("meta")``), which plan as if on a CUDA device.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from . import invariance
from .config import GRPOLossConfig, LogitTransform, TokenExtras, resolve_config
from .inputs import LogitsInputs, LossArguments
from .paths import HEAD_GEMM_PATHS
from .logprobs import HeadCallArgs, validate_head_logprobs, linear_token_logprobs, plan_linear_token_logprobs, plan_token_logprobs, \
    token_logprobs
from .loss import validate_head_loss, validate_logits_loss, fused_linear_grpo_loss, grpo_loss, plan_head_loss
# The two-head distillation functions (grpo_kernels/distill.py plans them: distill.plan_of)
from .distill import DISTILL_FUNCTIONS, plan_of as plan_distill_of
from .paths import DISTILL_GEMM_PATHS

_OPS = {"grpo_loss": grpo_loss, "fused_linear_grpo_loss": fused_linear_grpo_loss,
        "token_logprobs": token_logprobs, "linear_token_logprobs": linear_token_logprobs,
        **DISTILL_FUNCTIONS}


def _bind(fn, args, kwargs) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.update(named.pop("config_overrides", {}) or {})
    return named


def _infer(args, kwargs):
    """The loss a bare argument list belongs to: hidden + weight (a floating second argument) or logits + ids."""
    if "hidden" in kwargs or "weight" in kwargs:
        return fused_linear_grpo_loss
    second = args[1] if len(args) > 1 else kwargs.get("ids")
    return fused_linear_grpo_loss if isinstance(second, torch.Tensor) and second.is_floating_point() else grpo_loss


def plan_call(*args, **kwargs):
    """The ``Plan`` of a call: ``plan_call(fn, *args, **kwargs)`` with fn one of the four public functions (or its
    name), or ``plan_call(*loss_args, **loss_kwargs)`` for ``grpo_loss`` / ``fused_linear_grpo_loss``."""
    if args and (callable(args[0]) or isinstance(args[0], str)) and not isinstance(args[0], torch.Tensor):
        fn, args = args[0], args[1:]
        fn = _OPS.get(fn, fn) if isinstance(fn, str) else fn
        if fn not in _OPS.values():
            raise ValueError(f"explain: the first argument must be one of {sorted(_OPS)}, got {fn!r}")
    else:
        fn = _infer(args, kwargs)
    if fn in DISTILL_FUNCTIONS.values():
        return plan_distill_of(fn, args, kwargs)
    a = _bind(fn, args, kwargs)
    if fn in (grpo_loss, fused_linear_grpo_loss):
        cfg = _config(a)
        loss_args = LossArguments.of(a)
        if fn is grpo_loss:
            return validate_logits_loss(a["logits"], a["ids"], loss_args, cfg, a["impl"], a["inplace_backward"])[2]
        inputs, batch, rows, shard = validate_head_loss(a["hidden"], a["weight"], a["ids"], a["bias"], loss_args,
                                                        cfg, a["impl"], a["process_group"], a["vocab_start"])
        return plan_head_loss(inputs, batch, cfg, rows, shard)
    if fn is token_logprobs:
        transform = LogitTransform(a["temperature"], a["softcap"], a["round_logits"])
        inputs = LogitsInputs.validate(a["logits"], a["ids"], transform, a["impl"],
                                       inplace_backward=a["inplace_backward"])
        return plan_token_logprobs(inputs, bool(a["inplace_backward"]), a["memory_budget"], a["batch_invariant"],
                                   a["invariant_block_rows"])
    inputs, shard, rows = validate_head_logprobs(a["hidden"], a["weight"], a["ids"], a["bias"], a["mask"],
                                                 HeadCallArgs.of(a))
    return plan_linear_token_logprobs(inputs, rows, shard, a["memory_budget"], a["deterministic"],
                                      TokenExtras.of(a["extra_outputs"]), a["batch_invariant"],
                                      a["invariant_block_rows"])


def _config(arguments: dict) -> GRPOLossConfig:
    """The call's resolved config: ``config`` with every GRPOLossConfig field among the bound arguments on top."""
    known = {f.name for f in dataclasses.fields(GRPOLossConfig)}
    return invariance.as_run(resolve_config(arguments.get("config"),
                                            {k: v for k, v in arguments.items() if k in known}))


def explain(*args, **kwargs) -> str:
    """The plan of a call as text: which path runs, why, its chunking and FLOPs, and the transient memory it will
    allocate beyond its inputs and returned gradients, item by item.

    ``explain(fn, *args, **kwargs)`` for any of ``grpo_loss``, ``fused_linear_grpo_loss``, ``token_logprobs``,
    ``linear_token_logprobs`` (the function or its name), or ``explain(*args, **kwargs)`` with the arguments of
    ``grpo_loss`` / ``fused_linear_grpo_loss`` (told apart by the second argument: ids or a weight). Tensors may be
    meta copies. Nothing runs; validation errors are raised as the call would raise them.
    """
    plan = plan_call(*args, **kwargs)
    text = str(plan)
    if plan.path in HEAD_GEMM_PATHS + DISTILL_GEMM_PATHS:
        text += "\n" + _gemm_note()
    return text


def _gemm_note() -> str:
    """Whether cuBLAS writes fp32 logits from half-precision inputs on this machine (probed on first real use)."""
    try:
        from .kernels.fp32_gemm import fp32_output_gemm_support
    except ImportError:
        return "  fp32-output GEMM: decided at the first call on a CUDA device"
    if not torch.cuda.is_available():
        return "  fp32-output GEMM: no CUDA device here (decided at the first call on one)"
    status = fp32_output_gemm_support(torch.device("cuda", torch.cuda.current_device()))
    return f"  fp32-output GEMM: {status}"


__all__ = ["explain", "plan_call"]
