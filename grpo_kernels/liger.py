"""Liger-Kernel 0.8.5's GRPO and JSD-distillation entry points, running on grpo_kernels: change the import, keep
the code.

    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss            # before
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss          # before
    from grpo_kernels.liger import LigerFusedLinearGRPOLoss, triton_grpo_loss # after

The JSD ones (``LigerFusedLinearJSD``, ``liger_fused_linear_jsd``, ``LigerFusedLinearJSDLoss`` and the chunked loss's
functional form ``chunked_liger_fused_linear_jsd``) live in ``liger_jsd.py``, on ``fused_linear_distill_loss``.

Each keeps Liger's signature (every argument, default and position) and return values (Liger's loss and its
sequence of metrics, not grpo_kernels' dict), and runs on the public functions (``fused_linear_grpo_loss``,
``grpo_loss``, ``token_logprobs``) and their planner: Triton on CUDA, the chunked PyTorch path on CPU. Where Liger's
numbers differ from TRL 1.16's, these follow TRL; docs/api.md "Coming from Liger-Kernel" lists every difference.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import GRPOLossConfig
from .logprobs import token_logprobs
from .inputs import LossArguments
from .liger_jsd import (LigerFusedLinearJSD, LigerFusedLinearJSDLoss,  # noqa: F401  (re-exported)
                        chunked_liger_fused_linear_jsd, liger_fused_linear_jsd)
from .loss import FusedLinearGRPOLoss, grpo_loss, validate_logits_loss
from .loss_types import LOSS_TABLE
from .reference import per_token_loss

LIGER_VERSION = "0.8.5"  # the release whose signatures and return values these reproduce


# Liger's option names that are GRPOLossConfig's too (the others: eps_low / eps_high of triton_grpo_loss)
_SHARED_OPTIONS = ("loss_type", "beta", "epsilon_low", "epsilon_high", "temperature", "importance_sampling_level",
                   "delta", "max_completion_length", "use_bias_correction_kl", "sapo_temperature_pos",
                   "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def _config(options: dict) -> GRPOLossConfig:
    """Liger's options (by ``GRPOLossConfig``'s names) as a validated config (a ValueError names a bad one), with
    grpo_kernels' ``batch_invariant`` (a keyword-only addition to Liger's signatures)."""
    return GRPOLossConfig(**{name: options[name] for name in _SHARED_OPTIONS},
                          batch_invariant=options.get("batch_invariant", False))


def _clip_metric(metrics: dict, loss_type: str) -> torch.Tensor:
    """Liger's one clip metric: cispo's ``rho > eps_high, A > 0`` for cispo, else the clip region's fraction (TRL's
    ``clip_ratio/region_mean``; for sapo / vespo, where Liger reports 0, the fraction outside the region)."""
    return metrics["cispo_clip_ratio"] if LOSS_TABLE[loss_type].policy == "cispo" \
        else metrics["clip_ratio/region_mean"]


def _num_items(num_items_in_batch, mask, loss_type: str, like: torch.Tensor):
    """The dapo / cispo / vespo normalizer as Liger (and TRL) use it under torch.distributed: the global token count
    (``num_items_in_batch``, or the all-reduced mask sum) divided by the world size, because data-parallel training
    averages the ranks' gradients. Unchanged outside a process group and for the other loss types."""
    dist = torch.distributed
    if not LOSS_TABLE[loss_type].uses_num_items_in_batch or not (dist.is_available() and dist.is_initialized()):
        return num_items_in_batch
    if num_items_in_batch is None:
        count = torch.ones(like.shape[:2], device=like.device) if mask is None else mask.float()
        num_items_in_batch = count.sum()
        dist.all_reduce(num_items_in_batch)
    world = dist.get_world_size()
    if not isinstance(num_items_in_batch, torch.Tensor):  # a number stays a number: no host-to-device copy
        return max(float(num_items_in_batch) / world, 1.0)
    return (num_items_in_batch.float() / world).clamp(min=1.0)


class LigerFusedLinearGRPOLoss(nn.Module):
    """Liger's ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` (0.8.5), on ``fused_linear_grpo_loss``.

    The constructor takes Liger's arguments with Liger's defaults (``beta=0.04``, ``loss_type="dapo"``,
    ``use_bias_correction_kl=False``, ...) and stores them as attributes read at every forward, as Liger does.
    ``compiled`` and ``chunk_size`` are accepted and do nothing: the planner chooses the path and its chunking
    (``grpo_kernels.explain``), and the public functions compose with ``torch.compile`` themselves.
    ``use_ref_model=False`` ignores any reference input, as Liger does: the KL term is 0 (and so is the kl metric,
    reported while ``beta != 0``).

    forward(_input (B, T, H), lin_weight (V, H), selected_token_ids (B, T), attention_mask (B, T), advantages (B,),
    bias=None, ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
    vllm_is_ratio=None, num_items_in_batch=None) returns ``(loss, metrics)``: a 0-dim fp32 loss and a tuple of
    0-dim tensors, ``(kl, clip_ratio)`` when ``beta != 0`` else ``(clip_ratio,)``. With ``ref_input`` and no
    ``ref_per_token_logps`` the reference log-probs come from the no-grad fused head (``ref_weight`` defaults to
    ``lin_weight``); both given: a warning, and ``ref_per_token_logps`` is used.
    """

    impl = "auto"  # grpo_kernels' implementation choice (Triton on CUDA, chunked PyTorch on CPU)

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: int | None = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: float | None = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0, *,
                 batch_invariant: bool = False):
        super().__init__()
        self.batch_invariant = batch_invariant
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg
        self.config  # noqa: B018  (validates every option now, as Liger's constructor checks its own)

    @property
    def config(self) -> GRPOLossConfig:
        """The options as a ``GRPOLossConfig`` (``beta`` 0 when ``use_ref_model`` is False)."""
        options = {name: getattr(self, name) for name in _SHARED_OPTIONS}
        return _config(dict(options, beta=self.beta if self.use_ref_model else 0.0,
                            batch_invariant=self.batch_invariant))

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None,
                vllm_is_ratio=None, num_items_in_batch=None):
        cfg = self.config
        if not self.use_ref_model:  # Liger ignores every reference input then
            ref_per_token_logps = ref_input = ref_weight = ref_bias = None
        loss, metrics = FusedLinearGRPOLoss(config=cfg, impl=self.impl)(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, vllm_is_ratio,
            _num_items(num_items_in_batch, attention_mask, cfg.loss_type, selected_token_ids))
        out = []
        if self.beta != 0.0:
            out.append(metrics["kl"] if self.use_ref_model else torch.zeros_like(metrics["kl"]))
        out.append(_clip_metric(metrics, cfg.loss_type))
        return loss, tuple(out)


def _shifted_view(logits, completion_ids) -> torch.Tensor:
    """``logits[:, :-1]`` aligned with ``completion_ids`` (Liger's ``logits`` are (B, L + 1, V)). In place, the public
    functions hand the whole buffer back as its gradient (``inplace_views.py``: d logits in the first L positions,
    0 in the last), so no second B x (L + 1) x V tensor exists, at every batch size."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError(f"logits must be a (B, L + 1, V) tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not isinstance(completion_ids, torch.Tensor) or completion_ids.dim() != 2 \
            or tuple(completion_ids.shape) != (logits.shape[0], logits.shape[1] - 1):
        got = tuple(completion_ids.shape) if isinstance(completion_ids, torch.Tensor) else completion_ids
        raise ValueError(f"completion_ids must have shape (B, L) = ({logits.shape[0]}, {logits.shape[1] - 1}) for "
                         f"logits of shape {tuple(logits.shape)} (the last position predicts no completion token), "
                         f"got {got}")
    return logits[:, :-1]


def triton_grpo_loss(logits, old_logp, ref_logp, completion_ids, advantages, completion_mask=None, temperature=0.9,
                     beta=0.04, eps_low=0.2, eps_high=0.4, inplace=True, loss_type="dapo", max_completion_length=None,
                     importance_sampling_level="token", reduce=False, sapo_temperature_pos=1.0,
                     sapo_temperature_neg=1.05, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False,
                     num_items_in_batch=None, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                     vespo_lambda_neg=2.0, *, batch_invariant=False):
    """Liger's ``liger_kernel.transformers.grpo_loss.triton_grpo_loss`` (0.8.5), on ``grpo_loss`` /
    ``token_logprobs``.

    logits (B, L + 1, V): position t scores ``completion_ids[:, t]`` and the last position is unused (its gradient
    is 0); old_logp / ref_logp (B, L) or None (ref_logp required when beta != 0); advantages (B,) (or (B, L));
    completion_mask (B, L) or None. ``inplace=True`` writes d logits into the logits buffer (any non-overlapping
    layout; no second B x L x V tensor).

    reduce=False (the default) returns ``(per_token_loss, per_token_kl, is_clipped)``, (B, L) each, zero at padded
    tokens: the per-token loss (differentiable; reduce it yourself), the KL (None when beta == 0; detached, as
    Liger's) and the clip indicator as floats. reduce=True returns ``(loss, metrics)`` with the loss reduced by
    ``loss_type`` and metrics the list ``[kl_mean, clip_ratio]`` (``[clip_ratio]`` when beta == 0).
    """
    view = _shifted_view(logits, completion_ids)
    cfg = _config(dict(locals(), epsilon_low=eps_low, epsilon_high=eps_high))
    num_items = _num_items(num_items_in_batch, completion_mask, loss_type, completion_ids)
    if reduce:
        loss, metrics = grpo_loss(view, completion_ids, advantages, completion_mask, old_logps=old_logp,
                                  ref_logps=ref_logp, is_ratio=vllm_is_ratio, num_items_in_batch=num_items,
                                  config=cfg, inplace_backward=bool(inplace))
        out = [metrics["kl"]] if beta != 0.0 else []
        return loss, out + [_clip_metric(metrics, loss_type)]
    # the loss's own validation (the same messages as grpo_loss), then one log-prob sweep and the per-token maths
    args = LossArguments(advantages, completion_mask, old_logp, ref_logp, vllm_is_ratio,
                         num_items_in_batch=num_items)
    _, batch, _ = validate_logits_loss(view, completion_ids, args, cfg, inplace_backward=bool(inplace))
    logp = token_logprobs(view, completion_ids, temperature, inplace_backward=bool(inplace),
                          batch_invariant=batch_invariant)
    terms = per_token_loss(logp, batch.advantages, batch.mask, old_logps=batch.old_logps, ref_logps=batch.ref_logps,
                           is_ratio=batch.is_ratio, config=cfg)
    mask = terms.mask
    shape = mask.shape
    per_token = torch.where(mask, terms.loss.expand(shape), 0.0)
    kl = None if beta == 0.0 else torch.where(mask, terms.kl.expand(shape), 0.0).detach()
    low, high, cispo, _ = terms.clipped(cfg)
    clipped = cispo if LOSS_TABLE[loss_type].policy == "cispo" else low | high
    return per_token, kl, (clipped.expand(shape) & mask).to(per_token.dtype)


@torch.no_grad()
def fused_selective_log_softmax(logits, input_ids, temperature=0.9, mask=None, *, batch_invariant=False):
    """Liger's ``liger_kernel.ops.grpo_loss.fused_selective_log_softmax`` (0.8.5), on ``token_logprobs``: the
    no-grad log-probs (B, L) fp32 of the last L = ``logits.shape[1] - 1`` tokens of ``input_ids`` under
    ``logits[:, :-1] / temperature``, 0 where ``mask[:, -L:]`` is 0 (old / reference log-probs for
    ``triton_grpo_loss``)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError("logits must be a (B, L + 1, V) tensor")
    L = logits.shape[1] - 1
    ids = input_ids[:, input_ids.shape[1] - L:]
    logp = token_logprobs(logits[:, :-1], ids, temperature, batch_invariant=batch_invariant)
    return logp if mask is None else torch.where(mask[:, mask.shape[1] - L:] != 0, logp, 0.0)

