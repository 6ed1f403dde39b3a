"""Validated inputs of the two-head divergence (``linear_token_divergence``, ``fused_linear_distill_loss``): every
argument checked once, into ``DistillInputs``; everything below trusts it.

Each model is a ``ModelHead``: hidden (N, H_model), its lm_head weight (V, H_model) and bias, in the dtype the head
runs in (autocast decides it, as for ``F.linear``, once here). Only V must match between the models; the teacher gets
no gradient, whatever its tensors require (TRL's ``ChunkedDivergenceFunction`` returns None for them): its hidden
states are detached here, its weight and bias get None from every path's backward. Each error is a ValueError
naming the argument.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks
from ._triton import resolve_impl
from .distill_config import DistillLossConfig


def _autocast_dtype(hidden: torch.Tensor):
    """The autocast dtype a head on ``hidden``'s device runs in, or None outside autocast (meta tensors stand for
    CUDA ones, as ``inputs.HeadInputs``)."""
    kinds = ("cuda", "cpu") if hidden.device.type == "meta" else (hidden.device.type,)
    device_type = next((k for k in kinds if torch.is_autocast_enabled(k)), None)
    return None if device_type is None else torch.get_autocast_dtype(device_type)


@dataclass(frozen=True)
class ModelHead:
    """One model's head: hidden (N, H), weight (V, H), bias (V,) | None as given (unit stride on H for Triton);
    ``dtype`` the dtype its GEMMs run in."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    def cast_bytes(self, *, hidden: bool = True, weight: bool = True) -> int:
        """Bytes of the copies in the compute dtype (hidden and weight not already in it; the bias is never cast)."""
        chosen = ([self.hidden] if hidden else []) + ([self.weight] if weight else [])
        return sum(t.numel() * self.dtype.itemsize for t in chosen if t is not None and t.dtype != self.dtype)

    def tensors(self) -> tuple:
        return self.hidden, self.weight, self.bias


def _head(role: str, hidden, weight, bias, lead_dims) -> tuple:
    """One model's tensors checked; ``role`` is "student" or "teacher" (the arguments' prefix)."""
    _checks.tensor(f"{role}_hidden", hidden, floating=True, dims=lead_dims)
    _checks.tensor(f"{role}_weight", weight, floating=True, dims=(2,))
    if bias is not None:
        _checks.tensor(f"{role}_bias", bias, floating=True, dims=(1,))
    H = hidden.shape[-1]
    if weight.shape[1] != H:
        raise ValueError(f"{role}_weight must have shape (V, H) = (V, {H}) to match {role}_hidden's last dim, got "
                         f"{tuple(weight.shape)}")
    if weight.shape[0] == 0 or H == 0:
        raise ValueError(f"{role}_weight must have non-empty V and H, got {tuple(weight.shape)}")
    autocast = _autocast_dtype(hidden)
    if autocast is None and weight.dtype != hidden.dtype:
        raise ValueError(f"{role}_weight dtype {weight.dtype} must match {role}_hidden dtype {hidden.dtype}")
    if bias is not None and bias.shape[0] != weight.shape[0]:
        raise ValueError(f"{role}_bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    return hidden.dtype if autocast is None else autocast


@dataclass(frozen=True)
class DistillInputs:
    """Both heads validated, hidden flattened to (N, H_model); ``shape`` the leading dims of the caller's hidden
    (the per-token outputs are reshaped to it); ``cfg`` the options; impl resolved ("triton" | "torch")."""

    student: ModelHead
    teacher: ModelHead
    shape: torch.Size
    impl: str
    cfg: DistillLossConfig

    @classmethod
    def validate(cls, student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias,
                 cfg: DistillLossConfig, impl, lead_dims=(2, 3)) -> "DistillInputs":
        s_dtype = _head("student", student_hidden, student_weight, student_bias, lead_dims)
        t_dtype = _head("teacher", teacher_hidden, teacher_weight, teacher_bias, lead_dims)
        if teacher_weight.shape[0] != student_weight.shape[0]:
            raise ValueError(f"teacher_weight must have the student's vocabulary V = {student_weight.shape[0]} rows "
                             f"(only V must match; H may differ), got {tuple(teacher_weight.shape)}")
        if tuple(teacher_hidden.shape[:-1]) != tuple(student_hidden.shape[:-1]):
            raise ValueError(f"teacher_hidden must have student_hidden's leading dims "
                             f"{tuple(student_hidden.shape[:-1])} (one row per token), got "
                             f"{tuple(teacher_hidden.shape)}")
        _checks.same_device(student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias,
                            teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias)
        tensors = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
        impl = resolve_impl(impl, *tensors)
        heads = []
        for hidden, weight, bias, dtype, name in ((student_hidden, student_weight, student_bias, s_dtype, "student"),
                                                  (teacher_hidden, teacher_weight, teacher_bias, t_dtype, "teacher")):
            if name == "teacher":
                # The teacher gets no gradient (TRL's), whatever its tensors require: its hidden states are detached
                # here, its weight and bias get None from the paths' backward. Why not detach those too: a ZeRO-3
                # partition must be the parameter itself, gathered again in a recompute backward (a detached alias
                # would keep the gathered head alive from the forward to the backward).
                hidden = hidden.detach()
            hidden = hidden.reshape(-1, hidden.shape[-1])
            if impl == "triton":
                _checks.kernel_dtype(f"{name}_hidden", dtype)
                hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
                weight = weight if weight.stride(-1) == 1 else weight.contiguous()
                bias = None if bias is None else bias.contiguous()
            heads.append(ModelHead(hidden, weight, bias, dtype))
        return cls(heads[0], heads[1], student_hidden.shape[:-1], impl, cfg)

    @property
    def n_tokens(self) -> int:
        return self.student.hidden.shape[0]

    @property
    def vocab(self) -> int:
        return self.student.weight.shape[0]
