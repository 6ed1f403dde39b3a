"""Validated inputs: every public entry point checks its arguments once, into one of these frozen objects, and
resolves the implementation once; everything below takes them by name and trusts them.

- ``LogitsInputs``: logits (B, T, V) or (N, V), ids, the logits transform, impl (``token_logprobs``, ``grpo_loss``);
- ``HeadInputs``: hidden as (N, H), the lm_head weight / bias, ids as (N,) int64, the logits transform, impl, in the
  dtype the head runs in (``linear_token_logprobs``, ``fused_linear_grpo_loss``). This is the one place where
  autocast decides that dtype, as it would for ``F.linear``;
- ``LossInputs``: the per-token tensors of the loss on the (B, T) completion grid, with the one place that turns the
  mask into reduction weights (``token_weights``);
- ``ValidRows``: the one valid-row compaction (gather the tokens the mask keeps, scatter results back).

Each ``validate`` raises a ValueError naming the argument (a wrong id would read out of bounds inside a kernel).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from . import _checks
from ._triton import resolve_impl
from .config import GRPOLossConfig, LogitTransform
from .inplace_views import root_at_base
from .loss_types import LOSS_TABLE, reduction_weights
from .sequences import Sequences


@dataclass(frozen=True)
class LogitsInputs:
    """logits (B, T, V) or (N, V) with ids shaped like its leading dims; ``transform`` (temperature, soft cap) the
    one carrier of what the kernels do to a logit; impl resolved ("triton" | "torch")."""

    logits: torch.Tensor
    ids: torch.Tensor
    transform: LogitTransform
    impl: str

    @classmethod
    def validate(cls, logits, ids, transform: LogitTransform, impl, dims=(2, 3),
                 inplace_backward: bool = False) -> "LogitsInputs":
        _checks.tensor("logits", logits, floating=True, dims=dims)
        if inplace_backward and torch.compiler.is_compiling():
            raise ValueError("inplace_backward=True is not supported under torch.compile (d logits cannot be written "
                             "into a buffer the compiled graph owns); pass inplace_backward=False")
        if inplace_backward and _checks.overlaps_in_memory(logits):
            # Why refuse: d logits written into a buffer whose rows share memory would overwrite each other. Any
            # non-overlapping view (logits[:, :-1], transposed, step-sliced) is written in place.
            raise ValueError("inplace_backward=True needs logits whose elements do not overlap in memory (got an "
                             "expanded or as_strided tensor); pass logits.contiguous() or inplace_backward=False")
        _checks.tensor("ids", ids, integer=True, dims=(logits.dim() - 1,))
        if tuple(ids.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"ids must have shape {tuple(logits.shape[:-1])} (logits' leading dims), "
                             f"got {tuple(ids.shape)}")
        if logits.shape[-1] == 0:
            raise ValueError("logits must have a non-empty vocabulary dimension V")
        _checks.same_device(logits=logits, ids=ids)
        _checks.token_ids(ids, logits.shape[-1])  # on the device, eager and compiled alike (``_checks.holds``)
        impl = resolve_impl(impl, logits, ids)
        if impl == "triton":
            _checks.kernel_dtype("logits", logits)
        if inplace_backward:  # a sliced view's d logits land in its base's buffer (inplace_views.py)
            logits = root_at_base(logits)
        return cls(logits, ids, transform, impl)


@dataclass(frozen=True)
class HeadInputs:
    """hidden (N, H), weight (V, H), bias (V,) | None as the caller gave them (contiguous on H for Triton); ids (N,)
    int64 contiguous; ``shape`` the shape of the caller's ids (the outputs are reshaped to it); ``transform`` the
    logits transform (temperature, soft cap); ``dtype`` the dtype the head runs in.

    This is the one place where autocast decides that dtype, as it would for ``F.linear``: under autocast the head
    runs in the autocast dtype and gradients flow back to the given (e.g. fp32 master) tensors. The cast itself is
    made by the path that runs: ``in_compute_dtype()`` (autograd casts, as nn.Linear) or, on the fast path, inside
    its autograd Function (so that an fp32 master weight's gradient accumulates straight into fp32)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    ids: torch.Tensor
    shape: torch.Size
    transform: LogitTransform
    impl: str
    dtype: torch.dtype

    @classmethod
    def validate(cls, hidden, weight, ids, bias, transform: LogitTransform, impl, ids_dims=None,
                 check_ids: bool = True) -> "HeadInputs":
        """check_ids=False: ids index a vocabulary larger than weight's (a vocab-parallel shard; its caller checks
        them against the whole vocabulary)."""
        _checks.tensor("hidden", hidden, floating=True, dims=(2, 3))
        _checks.tensor("weight", weight, floating=True, dims=(2,))
        _checks.tensor("ids", ids, integer=True, dims=ids_dims)
        if bias is not None:
            _checks.tensor("bias", bias, floating=True, dims=(1,))
        # meta tensors (a plan made without data) stand for CUDA ones, autocast included (a CPU autocast region
        # counts too: on a machine without CUDA torch does not enable a CUDA one)
        kinds = ("cuda", "cpu") if hidden.device.type == "meta" else (hidden.device.type,)
        device_type = next((k for k in kinds if torch.is_autocast_enabled(k)), None)
        autocast = device_type is not None
        dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
        H = hidden.shape[-1]
        if weight.shape[1] != H:
            raise ValueError(f"weight must have shape (V, H) = (V, {H}) to match hidden's last dim, "
                             f"got {tuple(weight.shape)}")
        if weight.shape[0] == 0 or H == 0:
            raise ValueError(f"weight must have non-empty V and H, got {tuple(weight.shape)}")
        if not autocast and weight.dtype != hidden.dtype:
            raise ValueError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
        N = hidden.numel() // H
        if hidden.dim() == 3 and tuple(ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"ids must have shape {tuple(hidden.shape[:2])} (hidden's leading dims), "
                             f"got {tuple(ids.shape)}")
        if ids.numel() != N:
            raise ValueError(f"ids must have one id per hidden row: hidden has N={N} rows, ids has shape "
                             f"{tuple(ids.shape)}")
        if bias is not None and bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
        _checks.same_device(hidden=hidden, weight=weight, ids=ids, bias=bias)
        if check_ids:  # on the device, eager and compiled alike (``_checks.holds``)
            _checks.token_ids(ids, weight.shape[0])
        impl = resolve_impl(impl, hidden, weight, bias)
        hidden2d = hidden.reshape(N, H)
        if impl == "triton":
            _checks.kernel_dtype("hidden", dtype)
            # the kernels read rows with a unit stride on H (autograd maps gradients back through any copy)
            hidden2d = hidden2d if hidden2d.stride(-1) == 1 else hidden2d.contiguous()
            weight = weight if weight.stride(-1) == 1 else weight.contiguous()
            bias = None if bias is None else bias.contiguous()
        return cls(hidden2d, weight, bias, ids.reshape(N).long().contiguous(), ids.shape, transform, impl, dtype)

    def cast_bytes(self, *, hidden: bool = True, weight: bool = True) -> int:
        """Bytes of the copies ``in_compute_dtype`` makes (tensors not already in the compute dtype)."""
        chosen = ([self.hidden] if hidden else []) + ([self.weight, self.bias] if weight else [])
        return sum(t.numel() * self.dtype.itemsize for t in chosen if t is not None and t.dtype != self.dtype)

    def in_compute_dtype(self) -> "HeadInputs":
        """The same inputs with hidden / weight / bias cast to ``dtype`` (autograd-tracked, like nn.Linear)."""
        if all(t is None or t.dtype == self.dtype for t in (self.hidden, self.weight, self.bias)):
            return self
        cast = [None if t is None else t.to(self.dtype) for t in (self.hidden, self.weight, self.bias)]
        return replace(self, hidden=cast[0], weight=cast[1], bias=cast[2])


@dataclass(frozen=True)
class LossArguments:
    """The loss's per-token arguments exactly as the caller passed them (``grpo_loss`` / ``fused_linear_grpo_loss``,
    their modules, ``explain``), before validation: ``LossInputs.validate`` checks them."""

    advantages: object
    mask: object = None
    old_logps: object = None
    ref_logps: object = None
    is_ratio: object = None
    sampling_logps: object = None
    num_items_in_batch: object = None
    cu_seqlens: object = None

    @classmethod
    def of(cls, named: dict) -> "LossArguments":
        """From a call's bound arguments (other names are ignored)."""
        return cls(**{f.name: named.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class LossInputs:
    """The per-token inputs of the loss on the (B, T) grid, validated; ``num_items_in_batch`` as given; ``seqs`` how
    the tokens group into sequences (packed: a (1, N) grid; advantages and a per-sequence is_ratio stay (S,))."""

    advantages: torch.Tensor
    mask: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    num_items_in_batch: object = None
    seqs: Sequences | None = None

    @classmethod
    def validate(cls, B: int, T: int, device: torch.device, config: GRPOLossConfig,
                 args: LossArguments) -> "LossInputs":
        """Padded: the (B, T) grid. Packed (``args.cu_seqlens``; the caller's grid is (1, N)): per-token tensors
        (N,), advantages (S,), is_ratio (S,) or (N,), with S + 1 = len(cu_seqlens)."""
        advantages, mask, old_logps, ref_logps = args.advantages, args.mask, args.old_logps, args.ref_logps
        is_ratio, sampling_logps, num_items_in_batch = args.is_ratio, args.sampling_logps, args.num_items_in_batch
        cu_seqlens = args.cu_seqlens
        packed = cu_seqlens is not None
        _checks.tensor("advantages", advantages, floating=True)
        shapes = _Shapes.packed_of(T, advantages) if packed else _Shapes.padded(B, T)
        shapes.check("advantages", advantages, shapes.per_sequence + shapes.per_token_adv)
        _checks.mask_like(mask, shapes.token, " (one per packed token)" if packed else "")
        for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps), ("sampling_logps", sampling_logps)):
            if t is not None:
                _checks.tensor(name, t, floating=True)
                shapes.check(name, t, (shapes.token,))
        if is_ratio is not None:
            _checks.tensor("is_ratio", is_ratio, floating=True)
            shapes.check("is_ratio", is_ratio, shapes.per_sequence + shapes.is_ratio_extra + (shapes.token,))
        _num_items(num_items_in_batch)
        if config.beta != 0.0 and ref_logps is None:
            raise ValueError(f"ref_logps is required when beta != 0 (beta={_checks.shown(config.beta)}); pass the reference "
                             f"model's per-token log-probs of shape{shapes.token_words()}")
        # num_items_in_batch may live anywhere (a CPU scalar is common): it is moved to the loss's device
        _checks.same_device(advantages=advantages, mask=mask, old_logps=old_logps, ref_logps=ref_logps,
                            is_ratio=is_ratio, sampling_logps=sampling_logps)
        if advantages.device != device:
            raise ValueError(f"advantages must be on the device of the logits / hidden states {device}, "
                             f"got {advantages.device}")
        seqs = Sequences.rows(B, T, config.batch_invariant)
        if packed:
            _checks.cu_seqlens(cu_seqlens, T, advantages.shape[0], device)
            seqs = Sequences.packed(cu_seqlens, T, config.batch_invariant)
            if LOSS_TABLE[config.loss_type].reduction == "fixed_length" and config.max_completion_length is None:
                raise ValueError(f"loss_type={config.loss_type!r} on packed sequences (cu_seqlens) needs "
                                 "max_completion_length in the config: its normalizer, which a packed batch has no "
                                 "padded width to take from")
            to_grid = (lambda t: None if t is None else t.reshape(1, T))  # noqa: E731
            mask, old_logps, ref_logps, sampling_logps = map(to_grid, (mask, old_logps, ref_logps, sampling_logps))
            if is_ratio is not None and is_ratio.shape[0] != seqs.n_seq:
                is_ratio = to_grid(is_ratio)
        batch = cls(advantages, mask, old_logps, ref_logps, is_ratio, sampling_logps, num_items_in_batch, seqs)
        batch._check_values()  # on the device, eager and compiled alike (docs/api.md, "Host syncs")
        return batch

    def _check_values(self) -> None:
        """is_ratio >= 0 at valid positions (finite negative weights are refused; non-finite ones propagate, the
        NaN / Inf rule, and padded positions are neutral whatever they hold); num_items_in_batch > 0."""
        is_ratio, mask, seqs = self.is_ratio, self.mask, self.seqs
        if is_ratio is not None and is_ratio.numel():
            bad = (is_ratio < 0) & torch.isfinite(is_ratio)
            if mask is not None:
                per_token = is_ratio.dim() == 2 and is_ratio.shape[-1] == seqs.grid[1]
                valid = mask.bool() if per_token else (seqs.sums(mask.bool()) > 0)
                bad = bad & valid.reshape(bad.shape)
            _checks.holds(~bad.any(), "is_ratio must be >= 0 (an importance weight)",
                          lambda: f", got {is_ratio[bad].min().item()} at a valid position")
        n = self.num_items_in_batch
        if isinstance(n, torch.Tensor):
            _checks.holds((n > 0).all(), "num_items_in_batch must be > 0 (the token count that normalizes the loss)",
                          lambda: f", got {float(n)!r}")

    def token_weights(self, cfg: GRPOLossConfig, B: int, T: int, device) -> "TokenWeights":
        """The mask as bool and float, its count and the loss type's reduction weights on the (B, T) grid."""
        mask_b = torch.ones(B, T, dtype=torch.bool, device=device) if self.mask is None else self.mask.bool()
        mask_f = mask_b.float()
        weights = reduction_weights(mask_f, cfg.loss_type, self.num_items_in_batch, cfg.max_completion_length,
                                    self.seqs)
        return TokenWeights(mask_b, mask_f, self.seqs.total(mask_f), weights.contiguous())

    def per_token(self, t):
        """A per-sequence tensor (advantages, is_ratio) at every token of the grid, or a per-token one as given:
        packed, the gather of ``Sequences.expand`` (no (S, Tmax) tensor); padded, (B,) / (B, 1) as they broadcast."""
        if t is None or not self.seqs.is_packed or t.dim() == 2:
            return t
        return self.seqs.expand(t)


def _num_items(n) -> None:
    """num_items_in_batch: None, a number > 0 or a one-element tensor (whose value is checked on the device)."""
    if n is None:
        return
    if isinstance(n, torch.Tensor):
        if n.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a scalar, got shape {tuple(n.shape)}")
    elif not _checks.is_number(n) or not _checks.is_finite(n) or n <= 0:
        raise ValueError(f"num_items_in_batch must be a number > 0 (the token count that normalizes the loss) or a "
                         f"scalar tensor, got {_checks.shown(n)}")


@dataclass(frozen=True)
class _Shapes:
    """The shapes a loss call accepts, with the words its errors use."""

    token: tuple
    per_sequence: tuple
    per_token_adv: tuple
    is_ratio_extra: tuple
    packed: bool = False

    @classmethod
    def padded(cls, B: int, T: int) -> "_Shapes":
        return cls((B, T), ((B,),), ((B, T),), ((B, 1),))

    @classmethod
    def packed_of(cls, N: int, advantages) -> "_Shapes":
        S = advantages.shape[0] if advantages.dim() == 1 else None
        return cls((N,), ((S,),) if S is not None else (), (), (), True)

    def token_words(self) -> str:
        """The per-token shape in words, for an error (formatted only then: under torch.compile printing a
        symbolic size would specialize the graph on it)."""
        return f" {self.token}" + (" (one per packed token)" if self.packed else "")

    def check(self, name: str, t, allowed: tuple) -> None:
        # Why each shape compared on its own: a tuple-of-tuples membership test makes Dynamo guard on every size
        if not any(len(t.shape) == len(a) and all(x == y for x, y in zip(t.shape, a)) for a in allowed):
            listed = " or ".join(str(a) for a in allowed) or "(S,), one per sequence"
            raise ValueError(f"{name} must have shape {listed}, got {tuple(t.shape)}")


@dataclass(frozen=True)
class TokenWeights:
    """``mask_b`` / ``mask_f`` (B, T) bool / fp32, ``n_valid`` its 0-dim fp32 count, ``weights`` (B, T) fp32 with
    ``loss = sum(weights * per_token_loss)``."""

    mask_b: torch.Tensor
    mask_f: torch.Tensor
    n_valid: torch.Tensor
    weights: torch.Tensor

    @property
    def count(self) -> torch.Tensor:
        """The number of valid tokens, at least 1 (the divisor of every masked mean)."""
        return self.n_valid.clamp(min=1)


@dataclass(frozen=True)
class LossTokens:
    """The per-token inputs of the loss kernels on the (B, T) grid: advantages (B,) or (B, T), the float mask and
    the reduction weights (B, T) fp32, the optional old / reference log-probs (B, T) and importance weight, and the
    packed layout's ``cu_seqlens`` (None: padded rows), which the batch-invariant term sums follow."""

    advantages: torch.Tensor
    mask_f: torch.Tensor
    weights: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    is_ratio: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None

    @classmethod
    def of(cls, batch: "LossInputs", weights: "TokenWeights") -> "LossTokens":
        """The stage's tokens: each sequence's advantage (and per-sequence is_ratio) reaches its tokens here."""
        return cls(batch.per_token(batch.advantages), weights.mask_f.contiguous(), weights.weights, batch.old_logps,
                   batch.ref_logps, batch.per_token(batch.is_ratio), batch.seqs.cu_seqlens)

    def as_list(self) -> list:
        """The tensors in field order, as a registered op takes them (``ops.py``)."""
        return [self.advantages, self.mask_f, self.weights, self.old_logps, self.ref_logps, self.is_ratio,
                self.cu_seqlens]


@dataclass(frozen=True)
class HeadTokens:
    """Per-token inputs of the fused head's gradient-in-forward epilogue, fp32 (N_valid,) contiguous at the valid
    tokens: advantage, reduction weight ``w`` and the optional old / reference log-probs and importance weight;
    ``ge``: fp32 (1,) d loss / d entropy of every valid token (the entropy bonus) or None; ``cu_seqlens``: the
    packed layout's offsets on the call's grid (None: padded rows), which the batch-invariant term sums follow."""

    adv: torch.Tensor
    w: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    isr: torch.Tensor | None = None
    ge: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None

    def as_list(self) -> list:
        """The tensors in field order, as a registered op takes them (``ops.py``)."""
        return [self.adv, self.w, self.old, self.ref, self.isr, self.ge, self.cu_seqlens]

    def rows(self, index) -> "HeadTokens":
        """The tokens at ``index`` (None: all); ``ge`` is one value for every token, ``cu_seqlens`` the grid's."""
        if index is None:
            return self
        adv, w, old, ref, isr = (None if t is None else t.index_select(0, index)
                                 for t in (self.adv, self.w, self.old, self.ref, self.isr))
        return HeadTokens(adv, w, old, ref, isr, self.ge, self.cu_seqlens)


@dataclass(frozen=True)
class LogprobGrads:
    """What a log-prob backward takes per token besides the head's inputs, flat (N,) in the accumulation dtype: the
    forward's ``lse`` and ``entropy``, the incoming ``grad_logp`` (d loss / d logp) and ``grad_entropy``
    (d loss / d entropy, None: no entropy term)."""

    lse: torch.Tensor
    entropy: torch.Tensor
    grad_logp: torch.Tensor
    grad_entropy: torch.Tensor | None = None

    @classmethod
    def incoming(cls, lse, entropy, grad_logp, grad_entropy) -> "LogprobGrads":
        """From autograd's incoming gradients: a None d logp counts as zeros, a None d entropy as no term; both flat
        and contiguous in lse's dtype."""
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp.reshape(-1).to(lse.dtype).contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.reshape(-1).to(lse.dtype).contiguous()
        return cls(lse, entropy, grad_logp, grad_entropy)

    def as_list(self) -> list:
        """The tensors in field order, as a registered op takes them (``ops.py``)."""
        return [self.lse, self.entropy, self.grad_logp, self.grad_entropy]

    def rows(self, index) -> "LogprobGrads":
        """The tokens at ``index`` (None: all)."""
        if index is None:
            return self
        return LogprobGrads(*(None if t is None else t.index_select(0, index) for t in self.as_list()))


@dataclass(frozen=True)
class ValidRows:
    """The flat indices of the tokens a mask keeps, or ``index=None`` when it keeps all ``total`` of them.

    Why compact: padded tokens then cost neither the N x V x H matmuls nor a vocab sweep. ``of`` makes the call's
    one host sync: the valid tokens per sequence (``counts``, B integers read at once), which size the compact batch
    and plan the sequence chunks; the index itself is then made on the device with that size (no second sync).
    ``keep_padding`` (the ``capturable`` option) skips it: every row is computed, no sync. On meta tensors (planning
    without data) every token counts as valid. Under torch.compile a data-dependent size cannot enter the graph:
    ``deferred`` then holds the flat mask and the registered ops of the head paths make the same compaction when
    they run."""

    index: torch.Tensor | None
    total: int
    counts: tuple | None = None
    deferred: torch.Tensor | None = None
    offsets: tuple | None = None

    @classmethod
    def of(cls, mask, total: int, keep_padding: bool = False, seqs: Sequences | None = None) -> "ValidRows":
        values = cls.counts_on_device(mask, keep_padding, seqs)
        # the one host sync of the call
        return cls.from_counts(mask, total, None if values is None else values.tolist(), keep_padding, seqs)

    @staticmethod
    def counts_on_device(mask, keep_padding: bool = False, seqs: Sequences | None = None):
        """What the compaction reads on the host, as one tensor: the valid tokens per sequence ((B,) rows of a
        (B, T) mask, (1,) for a flat one), and for packed ``seqs`` (S,) then the S + 1 offsets; None where no
        compaction is made (no mask, meta tensors, ``keep_padding``, torch.compile)."""
        if mask is None or mask.device.type == "meta" or keep_padding or torch.compiler.is_compiling():
            return None
        if seqs is not None and seqs.is_packed:
            counts = seqs.sums(mask.reshape(-1) != 0).to(torch.int64)
            return torch.cat([counts, seqs.cu_seqlens])
        return (mask.reshape(mask.shape[0] if mask.dim() > 1 else 1, -1) != 0).sum(-1)

    @classmethod
    def from_counts(cls, mask, total: int, values, keep_padding: bool = False,
                    seqs: Sequences | None = None) -> "ValidRows":
        """The compaction of ``mask`` from what ``counts_on_device`` gave, read on the host: per-sequence counts
        (and, packed, the sequences' token offsets)."""
        if values is None:
            deferred = mask is not None and not keep_padding and torch.compiler.is_compiling()
            return cls(None, total, deferred=mask.reshape(-1) if deferred else None)
        counts, offsets = values, None
        if seqs is not None and seqs.is_packed:
            counts, offsets = values[:seqs.n_seq], tuple(values[seqs.n_seq:])
        count = sum(counts)
        keep = mask.reshape(-1) != 0
        return cls(None if count == total else _flat_index(keep, count), total, tuple(counts), offsets=offsets)

    @property
    def count(self) -> int:
        return self.total if self.index is None else self.index.shape[0]

    def compact(self, *tensors):
        """Each tensor's rows at the valid tokens (differentiable); unchanged when every token is valid."""
        if self.index is None:
            return tensors
        return tuple(None if t is None else _TakeRows.apply(t, self.index) for t in tensors)

    def scatter(self, *tensors):
        """Each compact (N_valid,) tensor back on all ``total`` tokens, zeros elsewhere (differentiable)."""
        if self.index is None:
            return tensors
        return tuple(torch.zeros(self.total, dtype=t.dtype, device=t.device).index_copy(0, self.index, t)
                     for t in tensors)


class _TakeRows(torch.autograd.Function):
    """``x.index_select(0, index)`` for distinct indices, whose backward writes each row's gradient once
    (``index_copy``): autograd's own backward of ``index_select`` is ``index_add_``, atomic on CUDA (docs/numerics.md,
    "Determinism")."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_copy_(0, index, grad), None


def _flat_index(keep: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of ``keep``'s True entries, ``count`` of them (known on the host): no sync for the size."""
    try:
        return torch.nonzero_static(keep, size=count).squeeze(1)
    except (AttributeError, NotImplementedError):  # a torch without nonzero_static for this device
        return torch.argsort((~keep).to(torch.uint8), stable=True)[:count]


# The check of num_items_in_batch's type and shape under a public name, for the distillation loss
# (grpo_kernels/distill.py), which takes the same argument
check_num_items = _num_items
