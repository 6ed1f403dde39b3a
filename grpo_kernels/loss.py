"""The GRPO losses: ``grpo_loss`` (from logits), ``fused_linear_grpo_loss`` (from hidden states and the lm_head) and
their thin ``nn.Module`` wrappers.

Each validates its arguments once (``inputs.py``), asks the planner for a ``Plan`` and dispatches on ``Plan.path``
(docs/DESIGN.md, "The planner"); this module decides nothing itself. Every path ends in the contract's per-token
loss, masks and reduction: inside a Triton kernel on the fast paths, else ``token_stage.loss_from_token_logprobs``.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from dataclasses import replace

from . import invariance, ops, planner
from .config import GRPOLossConfig, resolve_config
from .distributed import sharded_head, vocab_parallel
from .head.fast import head_loss_in_forward, head_sequence_loss_in_forward
from .head.light import head_token_logprobs
from .inputs import HeadInputs, LogitsInputs, LossArguments, LossInputs, ValidRows
from .logits.fast import logits_loss_in_forward
from .logits.logprobs import logits_token_logprobs
from .logprobs import linear_token_logprobs
from .paths import HEAD_FAST, HEAD_FAST_SEQUENCE, HEAD_FAST_VOCAB_PARALLEL, LOGITS_FAST
from .token_stage import loss_from_token_logprobs


def validate_logits_loss(logits, ids, args: LossArguments, cfg: GRPOLossConfig, impl="auto",
                         inplace_backward=False):
    """(inputs, batch, plan) of one ``grpo_loss`` call (also what ``explain`` shows), for the resolved config.
    Packed (``args.cu_seqlens``): the (N, V) logits and (N,) ids become a (1, N) grid (views)."""
    packed = args.cu_seqlens is not None
    inputs = LogitsInputs.validate(logits, ids, cfg.transform, impl, dims=(2,) if packed else (3,),
                                   inplace_backward=inplace_backward)
    if packed:
        inputs = replace(inputs, logits=inputs.logits.unsqueeze(0), ids=inputs.ids.unsqueeze(0))
    B, T = inputs.ids.shape
    batch = LossInputs.validate(B, T, logits.device, cfg, args)
    wants_grad = torch.is_grad_enabled() and logits.requires_grad
    call = planner.LogitsCall("grpo_loss", inputs, cfg, planner.Budget.of(cfg.memory_budget), wants_grad,
                              bool(inplace_backward), cfg.batch_invariant, invariant_rows=cfg.invariant_block_rows)
    return inputs, batch, planner.with_sequences_note(planner.plan_logits(call), batch.seqs)


def grpo_loss(logits, ids, advantages, mask=None, old_logps=None, ref_logps=None, is_ratio=None,
              num_items_in_batch=None, config: GRPOLossConfig | None = None, impl: str = "auto",
              sampling_logps=None, inplace_backward: bool = False, cu_seqlens=None, **config_overrides):
    """GRPO loss from logits (B, T, V) aligned with ``ids`` (B, T): returns ``(loss, metrics)``.

    advantages (B,) or (B, T); mask (B, T) (None = all valid); old_logps / ref_logps / sampling_logps (B, T);
    is_ratio (B,), (B, 1) or (B, T), >= 0; num_items_in_batch > 0 normalizes dapo / cispo / vespo (default:
    mask.sum()). config: a ``GRPOLossConfig``; keyword overrides (``loss_type="grpo"``, ``beta=0.04``...) apply on top.
    Packed sequences (``cu_seqlens`` (S + 1,) int32 / int64, flash-attn's convention: sequence s is rows
    ``cu_seqlens[s]:cu_seqlens[s + 1]``): logits (N, V), ids / mask / old / ref / sampling log-probs (N,) (mask: the
    rows scored, e.g. 0 at prompt tokens), advantages (S,), is_ratio (S,) or (N,); the same numbers as the padded
    (S, Tmax) call on the same tokens (dr_grpo needs ``max_completion_length``; docs/api.md "Packed sequences").
    inplace_backward: write d logits into the logits buffer (no second B x T x V tensor; refused for logits whose
    elements overlap in memory, e.g. expanded). On the fast path (``grpo_kernels.explain`` says which path runs)
    the buffer holds d logits as soon as this returns. Returns a 0-dim fp32 loss (fp64 for fp64 logits) and a
    dict of detached 0-dim metrics.
    """
    cfg = invariance.as_run(resolve_config(config, config_overrides))
    args = LossArguments(advantages, mask, old_logps, ref_logps, is_ratio, sampling_logps, num_items_in_batch,
                         cu_seqlens)
    inputs, batch, plan = validate_logits_loss(logits, ids, args, cfg, impl, inplace_backward)
    if plan.path == LOGITS_FAST:
        return logits_loss_in_forward(inputs, batch, cfg, plan, inplace_backward)
    logps, entropy, _ = logits_token_logprobs(inputs, plan, inplace_backward, row_mask=batch.mask)
    return loss_from_token_logprobs(logps, entropy, batch, cfg, plan.token_stage)


def validate_head_loss(hidden, weight, ids, bias, args: LossArguments, cfg: GRPOLossConfig, impl="auto",
                       process_group=None, vocab_start=None):
    """(inputs, batch, rows, shard | None) for the resolved config: validated on this rank, or agreed by the whole
    vocab-parallel group (``distributed/vocab_parallel.validate``: every rank raises the same error). Packed
    (``args.cu_seqlens``): hidden (N, H) and ids (N,) on a (1, N) grid."""
    packed = args.cu_seqlens is not None

    def local():
        inputs = HeadInputs.validate(hidden, weight, ids, bias, cfg.transform, impl, ids_dims=(1,) if packed else (2,),
                                     check_ids=process_group is None)
        if packed:
            if hidden.dim() != 2:
                raise ValueError(f"hidden must have shape (N, H) with cu_seqlens (packed rows), got "
                                 f"{tuple(hidden.shape)}")
            inputs = replace(inputs, shape=torch.Size((1, inputs.ids.numel())))
        B, T = inputs.shape
        batch = LossInputs.validate(B, T, hidden.device, cfg, args)
        return inputs, batch.mask, batch

    if process_group is None:
        inputs, _, batch = local()
        rows = ValidRows.of(batch.mask, inputs.ids.numel(), cfg.capturable, batch.seqs)
        return inputs, batch, rows, None
    inputs, _, batch, shard, rows = vocab_parallel.validate(process_group, vocab_start, hidden, local, cfg.capturable)
    return inputs, batch, rows, shard


def plan_head_loss(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig, rows: ValidRows,
                   vocab_parallel_shard=None) -> planner.Plan:
    """The plan of one ``fused_linear_grpo_loss`` call (also what ``explain`` shows)."""
    wants = torch.is_grad_enabled()
    needs = tuple(wants and t is not None and t.requires_grad for t in (inputs.hidden, inputs.weight, inputs.bias))
    B, T = inputs.shape

    def counts():
        """(valid tokens per sequence, packed: the sequences' token offsets), from the valid-row compaction's one
        host sync, or read here when it made none (packed without a mask); None where nothing may be read."""
        if torch.compiler.is_compiling() or (cfg.capturable and batch.seqs.is_packed):
            # Why None: a compiled graph (or a capturable call) makes no host sync, and the sequence-level path
            # runs Python per chunk of sequences; the planner then takes the memory-light path
            return None
        if not batch.seqs.is_packed:
            return ([T] * B if rows.counts is None else list(rows.counts)), None
        if rows.offsets is not None:
            return list(rows.counts), rows.offsets
        offsets = batch.seqs.cu_seqlens.tolist()  # the call's one host sync (no mask: no compaction read)
        return [b - a for a, b in zip(offsets[:-1], offsets[1:])], tuple(offsets)

    plan = planner.plan_head(planner.HeadCall("fused_linear_grpo_loss", inputs, cfg,
                                              planner.Budget.of(cfg.memory_budget), needs, rows.count,
                                              cfg.deterministic, counts, vocab_parallel_shard, cfg.batch_invariant,
                                              invariant_rows=cfg.invariant_block_rows))
    return planner.with_sequences_note(plan, batch.seqs)


def fused_linear_grpo_loss(hidden, weight, ids, advantages, mask=None, bias=None, old_logps=None, ref_logps=None,
                           is_ratio=None, num_items_in_batch=None, config: GRPOLossConfig | None = None,
                           impl: str = "auto", sampling_logps=None, process_group=None,
                           vocab_start: int | None = None, gather_head=None, cu_seqlens=None, **config_overrides):
    """GRPO loss from final hidden states and the lm_head, never writing the B x T x V logits.

    hidden (B, T, H) or (B*T, H); weight (V, H); bias (V,) or None; ids (B, T); other arguments as ``grpo_loss``.
    Packed sequences (``cu_seqlens``, as ``grpo_loss``): hidden (N, H), ids and the per-token tensors (N,),
    advantages (S,).
    Gradients flow to hidden, weight and bias, each only when it requires grad (a frozen head does no d weight
    work). The planner picks the path (``grpo_kernels.explain`` shows it): on the Triton path, token-level
    configurations compute the gradients in the forward (6NHV) when its chunk and accumulators fit
    ``config.memory_budget``; everything else takes the memory-light recompute path, whose ``config.deterministic``
    selects the atomics-free backward.

    Vocab-parallel (``process_group``): ``weight`` / ``bias`` are this rank's vocabulary shard starting at
    ``vocab_start``, everything else is replicated, as for ``linear_token_logprobs``; every rank gets the same
    loss, its own dW / dbias and the all-reduced d hidden (docs/distributed.md).

    A head sharded for data parallelism (a DTensor from FSDP2, or a DeepSpeed ZeRO-3 partition with
    ``gather_head=grpo_kernels.zero3_gather_head(weight, bias)``, inside the model's forward) is gathered for the
    call; ``gather_head`` is entered around the forward and, on the memory-light path, again around the backward.
    """
    sharded_head.check_head_options(weight, bias, process_group, vocab_start, gather_head)
    ops.check_head_compilable(process_group, gather_head)
    weight, bias = sharded_head.gathered_dtensor_head(weight, bias)
    with sharded_head.gathered(gather_head):
        cfg = invariance.as_run(resolve_config(config, config_overrides))
        args = LossArguments(advantages, mask, old_logps, ref_logps, is_ratio, sampling_logps, num_items_in_batch,
                             cu_seqlens)
        inputs, batch, rows, shard = validate_head_loss(hidden, weight, ids, bias, args, cfg, impl, process_group,
                                                        vocab_start)
        plan = plan_head_loss(inputs, batch, cfg, rows, shard)
        # the fast paths read weight / bias only here: their backward hands out stored gradients
        if plan.path == HEAD_FAST:
            return head_loss_in_forward(inputs, batch, cfg, plan, rows)
        if plan.path == HEAD_FAST_SEQUENCE:
            return head_sequence_loss_in_forward(inputs, batch, cfg, plan, rows)
        if plan.path == HEAD_FAST_VOCAB_PARALLEL:
            return head_sequence_loss_in_forward(inputs, batch, cfg, plan, rows, vocab_parallel.fast_path_view(shard))
        if shard is not None:
            logps, entropy, _ = vocab_parallel.sharded_head_logprobs(inputs, shard, plan, rows)
        else:
            logps, entropy, _, _ = head_token_logprobs(inputs, plan, rows, sharded_head.backward_context(gather_head))
    return loss_from_token_logprobs(logps, entropy, batch, cfg, plan.token_stage)


class GRPOLoss(nn.Module):
    """``grpo_loss`` with a fixed ``GRPOLossConfig``: ``GRPOLoss(loss_type="grpo")(logits, ids, advantages)``."""

    def __init__(self, config: GRPOLossConfig | None = None, impl: str = "auto", **overrides):
        super().__init__()
        self.config = resolve_config(config, overrides)
        self.impl = impl

    def forward(self, logits, ids, advantages, mask=None, **kwargs):
        return grpo_loss(logits, ids, advantages, mask, config=self.config, impl=self.impl, **kwargs)


_LIGER_NAMES = {"_input": "hidden", "lin_weight": "weight", "selected_token_ids": "ids",
                "attention_mask": "mask", "ref_per_token_logps": "ref_logps",
                "old_per_token_logps": "old_logps", "vllm_is_ratio": "is_ratio"}


class FusedLinearGRPOLoss(nn.Module):
    """``fused_linear_grpo_loss`` with a fixed config; a drop-in for Liger's ``LigerFusedLinearGRPOLoss``.

    forward takes our names (hidden, weight, ids, advantages, mask, bias, old_logps, ref_logps, is_ratio,
    num_items_in_batch) or Liger's (_input, lin_weight, selected_token_ids, attention_mask, advantages, bias,
    ref_per_token_logps, old_per_token_logps, ref_input, ref_weight, ref_bias, vllm_is_ratio,
    num_items_in_batch), positionally in Liger's order too. With ``ref_input``/``ref_weight`` and no
    ``ref_logps`` the reference log-probs are computed with the fused no-grad path. ``process_group`` /
    ``vocab_start`` (keywords) make it a vocab-parallel head, ``gather_head`` gathers a ZeRO-3 partitioned one
    (``fused_linear_grpo_loss``). Returns (loss, metrics).
    """

    _POSITIONAL = ("hidden", "weight", "ids", "mask", "advantages", "bias", "ref_logps", "old_logps",
                   "ref_input", "ref_weight", "ref_bias", "is_ratio", "num_items_in_batch")

    def __init__(self, config: GRPOLossConfig | None = None, impl: str = "auto", **overrides):
        super().__init__()
        self.config = resolve_config(config, overrides)
        self.impl = impl

    def forward(self, *args, **kwargs):
        if len(args) > len(self._POSITIONAL):
            raise ValueError(f"FusedLinearGRPOLoss.forward takes at most {len(self._POSITIONAL)} positional "
                             f"arguments, got {len(args)}")
        named = dict(zip(self._POSITIONAL, args))
        for key, value in kwargs.items():
            key = _LIGER_NAMES.get(key, key)
            if key in named:
                raise ValueError(f"argument {key!r} given twice")
            named[key] = value
        unknown = set(named) - set(self._POSITIONAL) - {"sampling_logps", "process_group", "vocab_start",
                                                        "gather_head", "cu_seqlens"}
        if unknown:
            raise ValueError(f"unknown argument(s) {sorted(unknown)} for FusedLinearGRPOLoss.forward")
        for required in ("hidden", "weight", "ids", "advantages"):
            if named.get(required) is None:
                raise ValueError(f"FusedLinearGRPOLoss.forward needs {required!r}")
        ref_input, ref_weight, ref_bias = (named.pop(k, None) for k in ("ref_input", "ref_weight", "ref_bias"))
        if ref_input is not None and named.get("ref_logps") is not None:  # Liger warns the same way
            warnings.warn("grpo_kernels: both ref_logps (Liger: ref_per_token_logps) and ref_input are given; using "
                          "ref_logps (ref_input / ref_weight / ref_bias are ignored)", UserWarning, stacklevel=2)
        if named.get("ref_logps") is None and self.config.beta != 0.0 and ref_input is not None:
            with torch.no_grad():
                named["ref_logps"] = linear_token_logprobs(
                    ref_input, named["weight"] if ref_weight is None else ref_weight, named["ids"],
                    bias=named.get("bias") if ref_weight is None else ref_bias, temperature=self.config.temperature,
                    softcap=self.config.softcap, round_logits=self.config.round_logits,
                    impl=self.impl, process_group=named.get("process_group"),
                    vocab_start=named.get("vocab_start"),
                    gather_head=named.get("gather_head") if ref_weight is None else None,
                    memory_budget=self.config.memory_budget).view(named["ids"].shape)
        return fused_linear_grpo_loss(config=self.config, impl=self.impl, **named)
