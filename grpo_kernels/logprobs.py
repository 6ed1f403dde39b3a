"""Per-token log-probs (and entropies) of the sampled tokens: ``token_logprobs`` from logits and
``linear_token_logprobs`` from hidden states and the lm_head. Each validates once, asks the planner for a plan, and
dispatches on its path (docs/DESIGN.md, "The planner").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _checks, invariance, ops, planner
from .config import LogitTransform, TokenExtras
from .distributed import sharded_head, vocab_parallel
from .head.light import head_token_logprobs
from .inputs import HeadInputs, LogitsInputs, ValidRows
from .logits.logprobs import logits_token_logprobs


def plan_token_logprobs(inputs: LogitsInputs, inplace_backward: bool, memory_budget=None,
                        batch_invariant: bool = False, invariant_block_rows: int | None = None) -> planner.Plan:
    wants_grad = torch.is_grad_enabled() and inputs.logits.requires_grad
    on, rows = _flag_and_block(batch_invariant, invariant_block_rows)
    return planner.plan_logits(planner.LogitsCall("token_logprobs", inputs, None, planner.Budget.of(memory_budget),
                                                  wants_grad, bool(inplace_backward), on,
                                                  invariant_rows=rows))


def _flag_and_block(batch_invariant, invariant_block_rows) -> tuple[bool, int | None]:
    """(whether the call runs the batch-invariant paths, its chosen rows per block), both validated as passed; the
    test-only ``force_variant`` knob turns both off (``invariance.requested``)."""
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    rows = _checks.invariant_block_rows(invariant_block_rows, batch_invariant)
    on = invariance.requested(batch_invariant)
    return on, rows if on else None


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0, return_entropy: bool = False,
                   impl: str = "auto", inplace_backward: bool = False, memory_budget: int | None = None,
                   softcap: float | None = None, batch_invariant: bool = False, round_logits: str | None = None,
                   invariant_block_rows: int | None = None):
    """Log-probability of ``ids`` under ``softmax(logits / temperature)``, differentiable w.r.t. logits.

    logits: (B, T, V) or (N, V), float32 / bfloat16 / float16 (float64 with impl="torch"); position t scores
        ``ids[..., t]`` (no implicit shift).
    ids: integer tensor shaped like ``logits[..., 0]`` with values in [0, V).
    Returns logp shaped like ids in float32 (float64 for float64 logits), and the entropy of the same
    distribution when ``return_entropy``. ``inplace_backward=True`` writes d logits into the logits buffer
    (saves one B x T x V tensor; use it only when nothing else reads the logits afterwards; refused for logits
    whose elements overlap in memory). impl: "auto" (Triton on CUDA, chunked PyTorch on CPU), "triton", "torch".
    memory_budget: bytes of transient memory the call may allocate (GRPOLossConfig.memory_budget's meaning).
    softcap: None, or soft-cap the logits first: ``softmax(softcap * tanh(logits / softcap) / temperature)``
    (Gemma 2's ``final_logit_softcapping``), inside the kernels.
    batch_invariant: each row's log-prob, entropy and d logits are bitwise the same whatever else is in the call
    (docs/numerics.md, "Batch invariance").
    round_logits: None, or "bf16" / "fp16": round the logits (read as fp32) to that dtype, to nearest even, before
    the soft cap and the temperature, the sampler's recipe (GRPOLossConfig.round_logits; a no-op for bf16 logits
    rounded to bf16). The gradient passes through the rounding unchanged (straight-through).
    invariant_block_rows: None (the device's block) or the rows per block of ``batch_invariant=True``
    (GRPOLossConfig.invariant_block_rows: another block is another bit pattern).
    """
    inputs = LogitsInputs.validate(logits, ids, LogitTransform(temperature, softcap, round_logits), impl,
                                   inplace_backward=inplace_backward)
    plan = plan_token_logprobs(inputs, bool(inplace_backward), memory_budget, batch_invariant, invariant_block_rows)
    logp, entropy, _ = logits_token_logprobs(inputs, plan, inplace_backward)
    return (logp, entropy) if return_entropy else logp


@dataclass(frozen=True)
class TokenOutputs:
    """What ``linear_token_logprobs(..., extra_outputs=...)`` returns, each tensor shaped like ids: ``logp`` (fp32;
    float64 for float64 inputs on the torch path), ``entropy`` (None unless ``return_entropy``), and each extra
    output named in ``extra_outputs`` (None otherwise): ``log_sum_sq_probs`` (log sum_v p_v^2) and ``mean_logits``
    (the mean over V of the transformed logits) in logp's dtype, ``is_top1`` bool (the id is the argmax, the first
    maximum winning ties). The extras are not differentiable; rows that ``mask`` drops hold 0 / False."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


@dataclass(frozen=True)
class HeadCallArgs:
    """A ``linear_token_logprobs`` call's arguments beside its tensors, as passed (what the validator and ``explain``
    take): the logits transform, impl, capturable, the vocab-parallel options and the extra outputs asked for."""

    transform: LogitTransform
    impl: str = "auto"
    capturable: bool = False
    process_group: object = None
    vocab_start: int | None = None
    hidden_grad: str = "reduced"
    extra_outputs: tuple = ()

    @classmethod
    def of(cls, named: dict) -> "HeadCallArgs":
        """From a call's bound arguments (temperature, softcap and round_logits make the transform)."""
        transform = LogitTransform(named["temperature"], named["softcap"], named["round_logits"])
        return cls(transform, named["impl"], named["capturable"],
                   named["process_group"], named["vocab_start"], named["hidden_grad"], named["extra_outputs"])


def validate_head_logprobs(hidden, weight, ids, bias, mask, args: HeadCallArgs):
    """(inputs, shard | None, ValidRows) of one ``linear_token_logprobs`` call (also what ``explain`` shows)."""
    group = args.process_group
    if TokenExtras.of(args.extra_outputs) and group is not None:
        raise ValueError("extra_outputs is not supported with process_group (a vocab-parallel head): the shards "
                         "would have to combine each statistic; call without extra_outputs")

    def local():
        vocab_parallel.check_hidden_grad(args.hidden_grad, group)
        inputs = HeadInputs.validate(hidden, weight, ids, bias, args.transform, args.impl, check_ids=group is None)
        _checks.mask_like(mask, tuple(ids.shape), " (the shape of ids)")
        return inputs, mask, None

    if group is None:
        inputs, _, _ = local()
        return inputs, None, ValidRows.of(mask, inputs.ids.numel(), keep_padding=bool(args.capturable))
    inputs, _, _, shard, rows = vocab_parallel.validate(group, args.vocab_start, hidden, local,
                                                        bool(args.capturable), args.hidden_grad)
    return inputs, shard, rows


def plan_linear_token_logprobs(inputs: HeadInputs, rows: ValidRows, shard=None, memory_budget=None,
                               deterministic: bool = True, extras: TokenExtras | None = None,
                               batch_invariant: bool = False, invariant_block_rows: int | None = None) -> planner.Plan:
    wants = torch.is_grad_enabled()
    needs = tuple(wants and t is not None and t.requires_grad for t in (inputs.hidden, inputs.weight, inputs.bias))
    on, block = _flag_and_block(batch_invariant, invariant_block_rows)
    return planner.plan_head(planner.HeadCall("linear_token_logprobs", inputs, None, planner.Budget.of(memory_budget),
                                              needs, rows.count, bool(deterministic), shard=shard,
                                              batch_invariant=on, extras=extras, invariant_rows=block))


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, bias=None,
                          temperature: float = 1.0, return_entropy: bool = False, impl: str = "auto",
                          deterministic: bool = True, mask: torch.Tensor | None = None, process_group=None,
                          vocab_start: int | None = None, gather_head=None, memory_budget: int | None = None,
                          softcap: float | None = None, capturable: bool = False, hidden_grad: str = "reduced",
                          extra_outputs: tuple[str, ...] = (), batch_invariant: bool = False,
                          round_logits: str | None = None, invariant_block_rows: int | None = None):
    """Per-token log-prob of ``ids`` under ``softmax((hidden @ weight.T + bias) / temperature)``, or under
    ``softmax(softcap * tanh((hidden @ weight.T + bias) / softcap) / temperature)`` with ``softcap`` (Gemma 2's
    ``final_logit_softcapping``, applied inside the kernels on every path).

    hidden: (B, T, H) or (N, H); weight: (V, H) in hidden's dtype; bias: (V,) or None; ids: (B, T) or (N,)
    with one id per hidden row, values in [0, V). Returns float32 logp shaped like ids (and the entropy when
    ``return_entropy``). Differentiable w.r.t. hidden, weight and bias, each only when it requires grad; under
    ``torch.no_grad()`` it is the one-sweep old/reference-policy path. Never holds an N x V tensor. With ``mask``
    (shaped like ids) only the rows where it is non-zero are computed; the others are 0. Under ``torch.autocast``
    the head runs in the autocast dtype, like ``nn.Linear``. memory_budget: bytes of transient memory the call may
    allocate (GRPOLossConfig.memory_budget's meaning); ``grpo_kernels.explain`` shows the plan. capturable: no host
    sync (CUDA graph capture; GRPOLossConfig.capturable's meaning): the rows ``mask`` drops are computed too, then
    zeroed.

    extra_outputs: names among ``"log_sum_sq_probs"`` (log sum_v p_v^2), ``"mean_logits"`` (the mean over V of the
    logits after the soft cap and the temperature) and ``"is_top1"`` (whether the id is the argmax, the first maximum
    winning ties), TRL's ``ChunkedLogProbFunction`` outputs of those names (``reference.token_extras``), computed in
    the same sweep over V, not differentiable; not with ``process_group``. When given, the result is a
    ``TokenOutputs`` (logp, entropy if ``return_entropy``, and the extras named) instead of the tensors.

    batch_invariant: each row's log-prob, entropy, extras and gradient with respect to its hidden state are bitwise
    the same whatever else is in the call: batch size, position, mask, memory budget (docs/numerics.md, "Batch
    invariance"; d weight sums over rows: deterministic, not invariant). Needs ``deterministic``.
    invariant_block_rows: None (the device's block) or the rows per block of ``batch_invariant=True``
    (GRPOLossConfig.invariant_block_rows: another block is another bit pattern; pass the loss's value).

    round_logits: None, or "bf16" / "fp16": round the raw logits ``hidden @ weight.T + bias`` (accumulated in fp32)
    to that dtype, to nearest even, before the soft cap and the temperature, as a sampler (vLLM) or TRL's head under
    autocast does (GRPOLossConfig.round_logits, docs/numerics.md "Rounding the logits"); the gradient passes
    through the rounding unchanged (straight-through).

    Vocab-parallel (``process_group``, a torch.distributed group): ``weight`` / ``bias`` are this rank's contiguous
    shard (V_r, H) / (V_r,) of the vocabulary, starting at full-vocabulary id ``vocab_start`` (None: the sum of
    the lower ranks' shard sizes); hidden, ids and mask are the same on every rank and ids lie in the full
    vocabulary. Every rank gets the full-vocabulary logp / entropy, its own dW / dbias and the all-reduced
    d hidden (docs/distributed.md); with ``hidden_grad="partial"`` d hidden is not all-reduced: each rank gets its
    shard's part of it (their sum over the ranks is the full d hidden), for a caller whose next op sums it over the
    group (Megatron's sequence-parallel gather; verl's fused-kernel seam, ``grpo_kernels.verl``).

    A head sharded for data parallelism is gathered for the call (docs/distributed.md): a DTensor ``weight`` /
    ``bias`` (FSDP2: Shard(0) on one mesh dimension, Replicate on any other) is all-gathered and its gradient
    reduce-scattered back averaged over the mesh; for DeepSpeed ZeRO-3 pass
    ``gather_head=grpo_kernels.zero3_gather_head(weight, bias)`` (any zero-argument callable returning a context
    manager under which weight and bias hold their full values): it is entered around the forward and again in the
    backward. With gradients, call it inside the model's forward, where ZeRO-3 reduces the head's gradient.
    """
    sharded_head.check_head_options(weight, bias, process_group, vocab_start, gather_head)
    ops.check_head_compilable(process_group, gather_head)
    weight, bias = sharded_head.gathered_dtensor_head(weight, bias)
    with sharded_head.gathered(gather_head):
        transform = LogitTransform(temperature, softcap, round_logits)
        args = HeadCallArgs(transform, impl, capturable, process_group, vocab_start,
                            hidden_grad, extra_outputs)
        inputs, shard, rows = validate_head_logprobs(hidden, weight, ids, bias, mask, args)
        extras = TokenExtras.of(extra_outputs)
        plan = plan_linear_token_logprobs(inputs, rows, shard, memory_budget, deterministic, extras, batch_invariant,
                                          invariant_block_rows)
        if shard is not None:
            logp, entropy, _ = vocab_parallel.sharded_head_logprobs(inputs, shard, plan, rows,
                                                                    reduce_hidden_grad=hidden_grad == "reduced")
            more = (None, None, None)
        else:
            logp, entropy, _, more = head_token_logprobs(inputs, plan, rows, sharded_head.backward_context(gather_head),
                                                         extras)
    if capturable and mask is not None:  # the rows the mask drops were computed: 0 there, and no gradient
        keep = mask.reshape(logp.shape) != 0
        logp, entropy = torch.where(keep, logp, 0.0), torch.where(keep, entropy, 0.0)
        more = tuple(None if t is None else torch.where(keep, t, False if t.dtype == torch.bool else 0.0)
                     for t in more)
    if extras:
        return TokenOutputs(logp, entropy if return_entropy else None, *more)
    return (logp, entropy) if return_entropy else logp
