"""The loss-type table: the one place that says what each ``loss_type`` computes (docs/DESIGN.md section 2).

Every consumer reads it: ``config.GRPOLossConfig`` (the valid names), ``reference.loss_from_logps`` (policy term and
reduction), the per-token Triton stage (the ``KIND`` constexpr of its kernel and the reduction weights), and the
trainer in ``grpo/`` (which loss types normalize by ``num_items_in_batch``). The tests check that each of them
agrees with the table (docs/numerics.md, "One definition").

Policy terms (``A`` the advantage broadcast over the row, ``rho`` the importance ratio):
- ``clipped``: ``-min(rho' A, clamp(rho, 1 - eps_low, 1 + eps_high) A)``, ``rho' = min(rho, delta)`` when delta is set;
- ``cispo``: ``-stopgrad(min(rho, eps_high)) A logp``;
- ``sapo``: ``-sigmoid(t_A (rho - 1)) 4 / t_A A``;
- ``vespo``: ``-stopgrad(phi(w)) A logp`` with ``w`` the row's clamped *sum* of log ratios (a cross-token statistic).

Reductions of the masked per-token loss ``m l`` to a scalar, written as per-token weights ``w`` so that
``loss = sum(w * l)`` (``reduction_weights``):
- ``row_mean``: ``mean_b(sum_t m l / max(sum_t m, 1))``;
- ``token_mean``: ``sum m l / max(sum m, 1)``;
- ``fixed_length``: ``sum m l / (B * max_completion_length)`` (T when it is not set);
- ``num_items``: ``sum m l / max(num_items_in_batch, 1)``, ``num_items_in_batch`` defaulting to ``sum m``;
- ``row_sum``: ``mean_b(sum_t m l)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

POLICY_TERMS = ("clipped", "cispo", "sapo", "vespo")


@dataclass(frozen=True)
class LossType:
    """One row of the table: the policy term and the reduction of a ``loss_type``."""

    name: str
    policy: str
    reduction: str

    @property
    def uses_num_items_in_batch(self) -> bool:
        """Normalized by ``num_items_in_batch`` (the token count of the whole optimizer step when given)."""
        return self.reduction == "num_items"

    @property
    def token_local(self) -> bool:
        """The policy term and its gradient at a token need no other token (vespo needs its row's ratio sum)."""
        return self.policy != "vespo"

    @property
    def policy_kind(self) -> int:
        """The policy term as the integer the Triton kernels take as a constexpr (index in ``POLICY_TERMS``)."""
        return POLICY_TERMS.index(self.policy)


LOSS_TABLE: dict[str, LossType] = {lt.name: lt for lt in (
    LossType("grpo", "clipped", "row_mean"),
    LossType("bnpo", "clipped", "token_mean"),
    LossType("dr_grpo", "clipped", "fixed_length"),
    LossType("dapo", "clipped", "num_items"),
    LossType("luspo", "clipped", "row_sum"),
    LossType("cispo", "cispo", "num_items"),
    LossType("sapo", "sapo", "row_mean"),
    LossType("vespo", "vespo", "num_items"),
)}

LOSS_TYPES = tuple(LOSS_TABLE)
CLIPPED_LOSS_TYPES = tuple(name for name, lt in LOSS_TABLE.items() if lt.policy == "clipped")


def per_token_gradient_known(config) -> bool:
    """Whether, for ``config`` (a ``GRPOLossConfig``), each token's loss term and its gradient ``d loss / d logp``
    depend on that token alone once the reduction weights are known: token-level ratios, a token-local policy
    term (not vespo), no off-policy sequence mask, no top-entropy quantile mask. Then a kernel can compute the
    gradient as soon as a token's log-prob is known (the Triton per-token stage; gradients in the forward)."""
    return (config.importance_sampling_level == "token" and LOSS_TABLE[config.loss_type].token_local
            and config.off_policy_mask_threshold is None and config.top_entropy_quantile == 1.0)


def reduction_weights(mask: torch.Tensor, loss_type: str, num_items_in_batch=None,
                      max_completion_length: int | None = None, sequences=None) -> torch.Tensor:
    """Per-token weights ``w`` (B, T), zero at padded positions, with ``loss = sum(w * per_token_loss)``.

    mask: (B, T) float (0/1) in the dtype of the result; num_items_in_batch: None, a number or a one-element tensor
    (``_items_divisor``: never a host-to-device copy in eager); sequences: how the tokens group into sequences (``sequences.Sequences``; None: one
    per row). Packed sequences need ``max_completion_length`` for ``fixed_length`` (there is no row length). Empty
    batches give empty weights (the loss is then 0).
    """
    B, T = mask.shape
    packed = sequences is not None and sequences.is_packed
    S = sequences.n_seq if packed else B
    reduction = LOSS_TABLE[loss_type].reduction
    if reduction == "row_mean":
        if packed:
            return mask / sequences.expand(sequences.sums(mask).clamp(min=1)) / max(S, 1)
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / max(B, 1)
    if reduction == "token_mean":
        return mask / mask.sum().clamp(min=1)
    if reduction == "fixed_length":
        if packed and max_completion_length is None:
            raise ValueError(f"loss_type={loss_type!r} on packed sequences needs max_completion_length (its "
                             "normalizer; a packed batch has no padded width to take it from)")
        return mask / (max(S, 1) * (max_completion_length or max(T, 1)))
    if reduction == "row_sum":
        return mask / max(S, 1)
    if num_items_in_batch is None:
        return mask / mask.sum().clamp(min=1)
    return mask / _items_divisor(num_items_in_batch, mask)


def _items_divisor(n, mask: torch.Tensor):
    """``max(num_items_in_batch, 1)`` without a host-to-device copy: a Python number stays a number (a kernel
    argument); a tensor on the mask's device is used there; a CPU tensor beside device inputs (TRL passes one) is
    read on the host in eager (host memory: no transfer, no sync) and moved by the graph under torch.compile. With
    ``capturable`` (a CUDA graph) a number is a constant of the graph: pass a device tensor when it changes."""
    if not isinstance(n, torch.Tensor):
        return max(float(n), 1.0)
    if n.device != mask.device:
        if n.device.type == "cpu" and not torch.compiler.is_compiling():
            return max(float(n), 1.0)
        n = n.to(mask.device)
    return n.to(mask.dtype).reshape(()).clamp(min=1)
