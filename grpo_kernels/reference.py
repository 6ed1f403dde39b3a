"""The eager reference of the GRPO loss contract (docs/DESIGN.md section 2): the single source of truth.

Everything here is plain differentiable PyTorch, valid in float64. The kernels only replace the part that touches
the vocabulary (``logprobs_and_entropy``); the per-token loss, masks, reductions and metrics of every
implementation go through ``loss_from_logps`` below, on tensors of size B x T, so there is one copy of the maths.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import GRPOLossConfig
from .loss_types import LOSS_TABLE, reduction_weights
from .sequences import Sequences

_LOG_1E_8 = math.log(1e-8)


def _option(value, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A float option as a 0-dim tensor on ``like``'s device, in ``dtype`` (default: ``like``'s), made by adding it
    to a zero: the value the scalar overloads of clamp / where / quantile use (the float rounded to the dtype), and
    under torch.compile a symbolic option stays a runtime input of the graph, where a float passed to those overloads
    would be specialized (a recompile for every new value; ``ops.py``'s module docstring)."""
    return torch.zeros((), dtype=like.dtype if dtype is None else dtype, device=like.device) + value


# The dtypes ``round_logits`` names (config.GRPOLossConfig.round_logits)
ROUND_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _StraightThrough(torch.autograd.Function):
    """x rounded to ``dtype`` and back, with the identity as its derivative (autograd's own pair of casts would round
    the gradient to ``dtype`` too)."""

    @staticmethod
    def forward(ctx, x, dtype):
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def round_logits(x: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """The sampler's recipe: the raw logits x rounded to nearest-even to ``dtype`` ("bf16" / "fp16") and read back
    in x's dtype (x itself for None), before the soft cap and the temperature (docs/numerics.md "Rounding the
    logits"). NaN and +-inf stay; a value past the dtype's largest becomes +-inf. Its derivative is taken as 1
    (straight-through): d loss / d x = d loss / d rounded x, unrounded."""
    return x if dtype is None else _StraightThrough.apply(x, ROUND_DTYPES[dtype])


def soft_cap(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The soft cap of the logits, ``softcap * tanh(x / softcap)`` (x itself when softcap is None), applied before
    the temperature as in transformers' Gemma 2 (``final_logit_softcapping``). Its derivative is
    ``1 - tanh^2 = 1 - (capped / softcap)^2`` (``soft_cap_derivative``)."""
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def soft_cap_derivative(capped: torch.Tensor, softcap: float | None):
    """d capped / d x from the capped value: ``1 - (capped / softcap)^2`` (1 when softcap is None)."""
    if softcap is None:
        return 1.0
    t = capped / softcap
    return 1.0 - t * t


def logprobs_and_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                         softcap: float | None = None, rounding: str | None = None):
    """Full-logits log-softmax, gather and entropy of ``z = soft_cap(round_logits(logits, rounding), softcap) /
    temperature``; fp32 out (float64 for float64 logits).

    logits (..., V), ids (...) -> logp (...), entropy (...). Materializes the whole softmax: reference only.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = soft_cap(round_logits(logits.to(dtype), rounding), softcap) / temperature
    logz = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1) - logz
    p = torch.softmax(z, dim=-1)
    # -inf logits (banned tokens) have p = 0 and add nothing to the entropy; keep 0 * -inf out of the graph.
    entropy = logz - (p * torch.where(torch.isinf(z), 0.0, z)).sum(-1)
    return logp, entropy


def token_extras(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, softcap: float | None = None,
                 rounding: str | None = None):
    """The per-token statistics ``config.EXTRA_OUTPUTS`` of ``z = soft_cap(logits, softcap) / temperature`` (the
    logits first rounded as ``round_logits(logits, rounding)``), as
    TRL 1.16's ``ChunkedLogProbFunction`` defines them: (log_sum_sq_probs, mean_logits, is_top1), each shaped like
    ids; the first two fp32 (float64 for float64 logits), is_top1 bool. Not differentiable.

    - ``log_sum_sq_probs = log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)`` (p = softmax(z));
    - ``mean_logits = sum_v z_v / V``;
    - ``is_top1 = (z_t >= max_v z_v) & (z_t > max_{v < t} z_v)`` with t = ids (an empty max is -inf): the target is
      the argmax, the first maximum winning ties (``torch.argmax``), and False on a row whose log-prob is NaN (a NaN
      or +inf logit; a row of -inf only).
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        z = soft_cap(round_logits(logits.to(dtype), rounding), softcap) / temperature
        lse = torch.logsumexp(z, dim=-1)
        log_sum_sq = torch.logsumexp(2 * z, dim=-1) - 2 * lse
        mean = z.mean(dim=-1)
        t = ids.long().unsqueeze(-1)
        z_t = z.gather(-1, t).squeeze(-1)
        before = torch.arange(z.shape[-1], device=z.device) < t
        max_before = torch.where(before, z, float("-inf")).amax(dim=-1)
        is_top1 = (z_t >= z.amax(dim=-1)) & (z_t > max_before) & ~torch.isnan(z_t - lse)
    return log_sum_sq, mean, is_top1


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     weights=None) -> torch.Tensor:
    """Group-normalized advantages: ``(r - mean_group(r)) / (std + eps)``, NaN -> 0.

    rewards (B,) or (B, R) with R reward functions (weighted sum with ``weights``, NaN rewards ignored as in TRL's
    ``nansum``); B must be a multiple of ``group_size``; groups are consecutive runs of ``group_size`` rows.
    scale: "group" (Bessel std of the group), "batch" (Bessel std of the whole batch) or "none".
    Returns (B,) in the rewards' floating dtype (fp32 for integer rewards).
    """
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() not in (1, 2) or rewards.shape[0] == 0:
        raise ValueError(f"rewards must have shape (B,) or (B, R) with B > 0, got {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"rewards has B={rewards.shape[0]} rows, not a multiple of group_size={group_size}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    if r.dim() == 2:
        w = torch.ones(r.shape[1], dtype=r.dtype, device=r.device) if weights is None else \
            torch.as_tensor(weights, dtype=r.dtype, device=r.device)
        if w.shape != (r.shape[1],):
            raise ValueError(f"weights must have shape (R,) = ({r.shape[1]},), got {tuple(w.shape)}")
        unscorable = torch.isnan(r).all(dim=1)
        r = torch.nansum(r * w, dim=1).masked_fill(unscorable, float("nan"))
    elif weights is not None:
        raise ValueError("weights is only valid with rewards of shape (B, R)")
    grouped = r.view(-1, group_size)
    adv = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)
    if scale == "group":
        std = _nanstd(grouped, dim=1) if group_size > 1 else torch.zeros_like(grouped)
        adv = adv / (std.expand_as(grouped).reshape(-1) + eps)
    elif scale == "batch":
        std = _nanstd(r, dim=0) if r.numel() > 1 else torch.zeros_like(r)
        adv = adv / (std + eps)
    return torch.nan_to_num(adv, nan=0.0)


def _nanstd(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Bessel-corrected std ignoring NaNs (TRL's ``nanstd``), keepdim; NaN where fewer than 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    return torch.sqrt(torch.where(count > 1, var, float("nan")))


def gamma_weights(advantages, log_ratio, mask, is_ratio, config: GRPOLossConfig, seqs: Sequences | None = None):
    """VESPO weights ``phi(w) = exp(lam + k log w - lam w)`` with ``log w`` the clamped masked *sum* of log ratios
    per sequence (plus the clamped log of ``is_ratio``: a per-sequence one once, a per-token one summed over every
    position of the sequence, as TRL's ``get_gamma_weights``); detached. ``advantages`` / ``is_ratio``: in ``seqs``'
    per-sequence layout, or (B, T); phi is per-sequence when the advantages are."""
    seqs = seqs or Sequences.rows(*log_ratio.shape)
    with torch.no_grad():
        seq_log_ratio = seqs.sums(torch.where(mask, log_ratio.clamp(-20.0, 20.0), 0.0))
        broken = seqs.sums(torch.isnan(torch.where(mask, log_ratio, 0.0)).to(log_ratio.dtype)) > 0
        if is_ratio is not None:
            log_is = torch.log(is_ratio).clamp(_LOG_1E_8, 20.0)
            per_seq = _is_per_sequence(is_ratio, log_ratio)
            seq_log_ratio = seq_log_ratio + (log_is if per_seq else seqs.sums(log_is))
            nan_is = torch.isnan(is_ratio)
            broken = broken | (nan_is if per_seq else seqs.sums(nan_is.to(log_ratio.dtype)) > 0)
        log_w = seq_log_ratio.clamp(_LOG_1E_8, 20.0)
        if not _is_per_sequence(advantages, log_ratio):  # per-token advantages: phi per token
            log_w, broken = seqs.expand(log_w), seqs.expand(broken.to(log_w.dtype)) > 0
        nonneg = advantages >= 0
        # where of two Python floats gives the default dtype: the same rounding, from 0-dim tensors (``_option``)
        k = torch.where(nonneg, *(_option(v, log_w, torch.get_default_dtype())
                                  for v in (config.vespo_k_pos, config.vespo_k_neg))).to(log_w.dtype)
        lam = torch.where(nonneg, *(_option(v, log_w, torch.get_default_dtype())
                                    for v in (config.vespo_lambda_pos, config.vespo_lambda_neg))).to(log_w.dtype)
        lam = lam.clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        # TRL's nan_to_num above also turns a NaN log ratio into a zero weight, which would hide a broken input:
        # a NaN at a valid position (or in is_ratio, read at every position here) must reach the loss.
        return torch.where(broken, float("nan"), phi)


def _is_per_sequence(t: torch.Tensor, grid_like: torch.Tensor) -> bool:
    """Whether ``t`` is in the per-sequence layout ((B, 1) padded, (S,) packed) rather than a (B, T) grid."""
    return t.dim() == 1 or (t.shape[-1] == 1 and grid_like.shape[-1] != 1)


def off_policy_mask(advantages, logps, sampling_logps, mask, threshold: float, seqs: Sequences | None = None):
    """DeepSeek-V3.2 sequence mask: keep a sequence unless A < 0 and mean(sampling_logp - logp) > threshold; in
    the advantages' layout (per sequence, or (B, T))."""
    seqs = seqs or Sequences.rows(*logps.shape)
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    avg = seqs.sums(torch.where(mask, kl, 0.0)) / seqs.sums(mask).clamp(min=1)
    if not _is_per_sequence(advantages, logps):
        avg = seqs.expand(avg)
    return (advantages >= 0) | (avg <= threshold)


def high_entropy_mask(entropy, mask, top_quantile: float) -> torch.Tensor:
    """Tokens whose entropy is at or above the ``1 - top_quantile`` quantile of the valid tokens' entropies."""
    e = entropy.detach()
    # Why nanquantile over the padded grid: padded tokens become NaN and are left out, so the quantile is that of
    # the valid tokens, with no host sync to compact them (``e[mask]`` would be one). A NaN entropy at a valid token
    # must still reach the result (NaN threshold: no token kept), as the quantile of the valid tokens would.
    # quantile needs fp32 or fp64; rounding a float64 threshold to fp32 would drop the token that sits on it
    grid = torch.where(mask, e, float("nan"))
    grid = grid if grid.dtype == torch.float64 else grid.float()
    threshold = torch.nanquantile(grid.reshape(-1), _option(1.0 - top_quantile, grid))
    threshold = torch.where(torch.isnan(torch.where(mask, e, 0.0)).any(), float("nan"), threshold)
    return (torch.where(mask, e, 0.0) >= threshold.to(e.dtype)) & mask


@dataclass(frozen=True)
class PerTokenLoss:
    """Section 2's per-token terms before the reduction (``per_token_loss``): (B, T) tensors, or per-sequence ones
    in ``seqs``' layout ((B, 1) padded: they broadcast) where marked.

    loss: ``l = policy * masks * is_ratio + beta * kl``, (B, T) or (B, 1), differentiable (padded tokens hold finite
    values that every reduction weights by 0); kl: the k3 KL (times the ratio with ``use_bias_correction_kl``), None
    without ``ref_logps``; coef_1: the ratio the clip metrics read (after the delta clamp, as TRL's), per sequence
    when ``coef_per_seq``; adv: the advantages (0 at padded tokens when (B, T)), per sequence when ``adv_per_seq``;
    mask: bool (B, T); entropy: 0 at padded tokens, or None; phi: vespo's weights (per sequence with the advantages)
    or None; entropy_mask: the top-entropy mask or None; seqs: the layout."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    coef_1: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    phi: torch.Tensor | None = None
    entropy_mask: torch.Tensor | None = None
    seqs: Sequences | None = None
    coef_per_seq: bool = False
    adv_per_seq: bool = False

    def clipped(self, cfg: GRPOLossConfig):
        """(low, high, cispo, per_seq) of the clip metrics: bool indicators of ``rho < 1 - eps_low`` with A < 0,
        ``rho > 1 + eps_high`` with A > 0 and cispo's ``rho > eps_high`` with A > 0 (TRL's definitions), per
        sequence when the ratio and the advantages both are."""
        coef, adv, per_seq = self.coef_1, self.adv, self.coef_per_seq and self.adv_per_seq
        if not per_seq:
            coef = self.seqs.expand(coef) if self.coef_per_seq else coef
            adv = self.seqs.expand(adv) if self.adv_per_seq else adv
        low = (coef < 1 - cfg.epsilon_low) & (adv < 0)
        high = (coef > 1 + cfg.epsilon_high) & (adv > 0)
        return low, high, (coef > cfg.epsilon_high) & (adv > 0), per_seq


def _layout(logps, cu_seqlens, sequences, invariant: bool = False) -> tuple:
    """(logps on the (B, T) grid, Sequences) of a reference call: padded (B, T) logps, or packed (N,) ones with
    ``cu_seqlens`` (then a (1, N) grid), or a layout the caller already made (``sequences``); ``invariant``: the
    batch-invariant sums (``Sequences.tree_sums``)."""
    if sequences is not None:
        return logps.reshape(sequences.grid), sequences
    if cu_seqlens is not None:
        seqs = Sequences.packed(cu_seqlens, logps.numel(), invariant)
        return logps.reshape(seqs.grid), seqs
    return logps, Sequences.rows(*logps.shape, invariant=invariant)


def per_token_loss(logps, advantages, mask=None, *, old_logps=None, ref_logps=None, is_ratio=None, entropy=None,
                   sampling_logps=None, config: GRPOLossConfig | None = None, cu_seqlens=None,
                   sequences: Sequences | None = None) -> PerTokenLoss:
    """The per-token loss of docs/DESIGN.md section 2 and what its metrics read, before any reduction; arguments
    as ``loss_from_logps`` (which reduces it)."""
    cfg = config or GRPOLossConfig()
    policy = LOSS_TABLE[cfg.loss_type].policy
    logps, seqs = _layout(logps, cu_seqlens, sequences, cfg.batch_invariant)
    x = _neutral_inputs(logps, advantages, mask, old_logps, ref_logps, is_ratio, entropy, sampling_logps, policy,
                        seqs)
    logps, mask, adv, dtype = x["logps"], x["mask"], x["adv"], logps.dtype
    adv_g = seqs.expand(adv) if x["adv_per_seq"] else adv

    log_ratio = logps - x["old"]
    coef_per_seq = cfg.importance_sampling_level != "token"
    if coef_per_seq:
        coef_1 = torch.exp(seqs.sums(torch.where(mask, log_ratio, 0.0)) / seqs.sums(mask).clamp(min=1))
    else:
        coef_1 = torch.exp(log_ratio)
    coef_g = seqs.expand(coef_1) if coef_per_seq else coef_1

    per_token_kl = None
    if x["ref"] is not None:
        ref = x["ref"]
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if cfg.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_g

    # the policy term in the per-sequence layout where both operands are (padded: (B, 1), as TRL computes it)
    same_layout = coef_per_seq and x["adv_per_seq"]
    ratio, a = (coef_1, adv) if same_layout else (coef_g, adv_g)
    loss, phi, ratio = _policy_term(policy, ratio, a, logps, log_ratio, mask, x["is_ratio"], cfg, seqs, adv)
    loss = _grid(loss, logps, seqs)
    # padded, a per-sequence ratio stays (B, 1) (it broadcasts) even against per-token advantages
    ratio_per_seq = same_layout or (coef_per_seq and not seqs.is_packed)
    if cfg.off_policy_mask_threshold is not None:
        sampling = x["old"] if x["sampling"] is None else x["sampling"]
        keep = off_policy_mask(adv, logps, sampling, mask, cfg.off_policy_mask_threshold, seqs).to(dtype)
        loss = loss * (seqs.expand(keep) if x["adv_per_seq"] else keep)
    entropy_mask = None
    if cfg.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(x["entropy"], mask, cfg.top_entropy_quantile)
        loss = loss * entropy_mask.to(dtype)
    if x["is_ratio"] is not None and policy != "vespo":
        loss = loss * (seqs.expand(x["is_ratio"]) if x["is_per_seq"] else x["is_ratio"])
    if cfg.beta != 0.0:
        loss = loss + cfg.beta * per_token_kl
    return PerTokenLoss(loss, per_token_kl, ratio, adv, mask, x["entropy"], phi, entropy_mask, seqs, ratio_per_seq,
                        x["adv_per_seq"])


def loss_from_logps(logps, advantages, mask=None, *, old_logps=None, ref_logps=None, is_ratio=None,
                    entropy=None, num_items_in_batch=None, sampling_logps=None,
                    config: GRPOLossConfig | None = None, cu_seqlens=None, sequences: Sequences | None = None):
    """GRPO loss of docs/DESIGN.md section 2 from per-token log-probs: returns ``(loss, metrics)``.

    Padded: logps (B, T) differentiable (fp32 or fp64); advantages (B,) or (B, T); mask (B, T) bool/int/float or
    None; old_logps, ref_logps, sampling_logps (B, T); is_ratio (B,), (B, 1) or (B, T); entropy (B, T),
    differentiable when ``config.entropy_coef != 0``. Packed (``cu_seqlens`` (S + 1,): sequence s is tokens
    ``cu_seqlens[s]:cu_seqlens[s + 1]``): logps, mask and the other per-token tensors (N,), advantages (S,), is_ratio
    (S,) or (N,). Inputs must already be validated and on logps' device; they are cast to logps' dtype. metrics:
    detached 0-dim tensors ``kl``, ``entropy``, ``clip_ratio/{low,high,region}_mean`` and, for cispo / vespo,
    ``cispo_clip_ratio`` / ``vespo/phi_seq_mean``.
    """
    cfg = config or GRPOLossConfig()
    terms = per_token_loss(logps, advantages, mask, old_logps=old_logps, ref_logps=ref_logps, is_ratio=is_ratio,
                           entropy=entropy, sampling_logps=sampling_logps, config=cfg, cu_seqlens=cu_seqlens,
                           sequences=sequences)
    mask, seqs = terms.mask, terms.seqs
    weights = reduction_weights(mask.to(logps.dtype), cfg.loss_type, num_items_in_batch, cfg.max_completion_length,
                                seqs)
    loss = seqs.total(torch.where(mask, weights * _to_grid(terms.loss, seqs), 0.0))

    if cfg.entropy_coef != 0.0:
        eff = mask if terms.entropy_mask is None else terms.entropy_mask
        loss = loss - cfg.entropy_coef * seqs.total(torch.where(eff, terms.entropy, 0.0)) / eff.sum().clamp(min=1)
    return loss, _metrics(terms, cfg)


def _neutral_inputs(logps, advantages, mask, old_logps, ref_logps, is_ratio, entropy, sampling_logps, policy,
                    seqs: Sequences):
    """The inputs in logps' dtype on the (B, T) grid with neutral values at padded positions, by name; per-sequence
    advantages / is_ratio in ``seqs``' per-sequence layout (flagged ``adv_per_seq`` / ``is_per_seq``).

    Padded positions may hold anything (sentinel log-probs, -inf, a huge ratio): neutral values there keep 0 * inf
    out of the forward and the backward. Valid positions are untouched, so the numbers are TRL's."""
    dtype, grid = logps.dtype, seqs.grid
    mask = torch.ones(grid, dtype=torch.bool, device=logps.device) if mask is None else mask.reshape(grid).bool()
    adv = advantages.to(dtype)
    adv_per_seq = seqs.is_packed or adv.dim() == 1
    # (B, T) advantages at padded positions are neutral too (a per-row ratio's gradient sums over the whole row)
    adv = seqs.per_sequence(adv) if adv_per_seq else torch.where(mask, adv.reshape(grid), 0.0)
    logps = torch.where(mask, logps, 0.0)
    neutral = logps.detach()
    # packed: (S,) per sequence (where S = N every sequence is one token and both readings agree), (N,) per token
    if is_ratio is None:
        is_per_seq = False
    elif seqs.is_packed:
        is_per_seq = is_ratio.shape[0] == seqs.n_seq
    else:
        is_per_seq = is_ratio.dim() == 1 or (is_ratio.shape[-1] == 1 and grid[1] != 1)
    if is_ratio is not None:
        is_ratio = is_ratio.to(dtype)
        # vespo folds the raw ratios of every position into its gamma weights, as TRL does; elsewhere padded
        # positions only multiply a masked-out loss, so they are neutralized.
        is_ratio = seqs.per_sequence(is_ratio) if is_per_seq else \
            is_ratio.reshape(grid) if policy == "vespo" else torch.where(mask, is_ratio.reshape(grid), 1.0)

    def at_valid(t, fill):
        return None if t is None else torch.where(mask, t.reshape(grid).to(dtype), fill)

    return {"logps": logps, "mask": mask, "adv": adv, "adv_per_seq": adv_per_seq, "is_ratio": is_ratio,
            "is_per_seq": is_per_seq, "old": neutral if old_logps is None else at_valid(old_logps, neutral),
            "ref": at_valid(ref_logps, neutral), "sampling": at_valid(sampling_logps, neutral),
            "entropy": None if entropy is None else torch.where(mask, entropy.reshape(grid), 0.0)}


def _policy_term(policy, coef_1, adv, logps, log_ratio, mask, is_ratio, cfg, seqs: Sequences, adv_own):
    """(per-token policy loss, vespo's phi or None, the ratio the clip metrics read: delta-clamped for the clipped
    term, as TRL's) of the loss type's policy term (docs/DESIGN.md section 2). coef_1 and adv share a layout;
    adv_own: the advantages in their own layout (vespo's phi is per sequence when they are)."""
    if policy == "cispo":
        return -torch.clamp(_grid(coef_1, logps, seqs), max=_option(cfg.epsilon_high, coef_1)).detach() \
            * _grid(adv, logps, seqs) * logps, None, coef_1
    if policy == "clipped":
        coef_2 = torch.clamp(coef_1, _option(1 - cfg.epsilon_low, coef_1), _option(1 + cfg.epsilon_high, coef_1))
        if cfg.delta is not None:
            coef_1 = torch.clamp(coef_1, max=_option(cfg.delta, coef_1))
        return -torch.min(coef_1 * adv, coef_2 * adv), None, coef_1
    if policy == "sapo":
        # where of two Python floats gives the default dtype: the same rounding, from 0-dim tensors (``_option``)
        temp = torch.where(adv > 0, *(_option(v, adv, torch.get_default_dtype())
                                      for v in (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))).to(logps.dtype)
        return -torch.sigmoid(temp * (coef_1 - 1)) * 4 / temp * adv, None, coef_1
    phi = gamma_weights(adv_own, log_ratio, mask, is_ratio, cfg, seqs)  # vespo: per sequence with the advantages
    return -_grid(phi, logps, seqs) * _grid(adv, logps, seqs) * logps, phi, coef_1


def _grid(t, logps, seqs: Sequences):
    """``t`` broadcastable against the (B, T) grid (a packed per-sequence tensor expanded to its tokens; with the
    batch-invariant sums, a padded one too, so that its gradient is summed by the tree)."""
    per_seq = _is_per_sequence(t, logps)
    return seqs.expand(t) if per_seq and (seqs.is_packed or seqs.invariant) else t


def _to_grid(t, seqs: Sequences):
    """``t`` (per token, or a padded (B, 1) per-sequence tensor) on the whole (B, T) grid."""
    if seqs.invariant and t.shape != seqs.grid:
        return seqs.expand(t)
    return t.expand(seqs.grid)


def _masked_mean(x, per_seq: bool, mask, n_valid, seqs: Sequences) -> torch.Tensor:
    """TRL's ``global_masked_mean``: a per-sequence value is counted once per sequence, a per-token one is masked
    by tokens."""
    if per_seq:
        return seqs.mean(x)
    return seqs.total(torch.where(mask, x, 0.0)) / n_valid.clamp(min=1)


def _metrics(terms: PerTokenLoss, cfg) -> dict:
    """The metrics dict (detached 0-dim masked means over the batch) of ``loss_from_logps``."""
    with torch.no_grad():
        mask, dtype, seqs = terms.mask, terms.coef_1.dtype, terms.seqs
        n_valid = mask.sum().to(dtype)
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        low, high, cispo_clipped, per_seq = terms.clipped(cfg)

        def mean(x, seq=per_seq):
            return _masked_mean(x.to(dtype), seq, mask, n_valid, seqs)

        metrics = {
            "kl": zero if terms.kl is None else mean(terms.kl, False),
            "entropy": zero if terms.entropy is None else mean(terms.entropy.detach(), False),
            "clip_ratio/low_mean": mean(low),
            "clip_ratio/high_mean": mean(high),
            "clip_ratio/region_mean": mean(low | high),
        }
        if LOSS_TABLE[cfg.loss_type].policy == "cispo":
            metrics["cispo_clip_ratio"] = mean(cispo_clipped)
        if terms.phi is not None:
            metrics["vespo/phi_seq_mean"] = mean(terms.phi, terms.adv_per_seq)
        return {k: v.detach() for k, v in metrics.items()}


def reference_grpo_loss(logits, ids, advantages, mask=None, old_logps=None, ref_logps=None, is_ratio=None,
                        num_items_in_batch=None, sampling_logps=None, config: GRPOLossConfig | None = None,
                        cu_seqlens=None):
    """Full-logits eager GRPO loss (the ground truth of the tests): logits (B, T, V), or (N, V) packed with
    ``cu_seqlens`` -> (loss, metrics)."""
    cfg = config or GRPOLossConfig()
    logps, entropy = logprobs_and_entropy(logits, ids, cfg.temperature, cfg.softcap, cfg.round_logits)
    return loss_from_logps(logps, advantages, mask=mask, old_logps=old_logps, ref_logps=ref_logps,
                           is_ratio=is_ratio, entropy=entropy, num_items_in_batch=num_items_in_batch,
                           sampling_logps=sampling_logps, config=cfg, cu_seqlens=cu_seqlens)
