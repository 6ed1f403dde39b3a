"""One optimizer step on a rollout's rows, and the no-grad log-probs (old policy, reference) it may need.

Two layouts of a micro-batch: packed (``grpo/packing.py``: whole sequences end to end in rows, no padding, cut by a
token budget) and padded rows, where ``trim`` drops, per micro-batch, the columns no row needs (shared left padding,
completion tail), which is exact under causal attention and saves part of the padding cost of short completions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_kernels.loss_types import LOSS_TABLE

from .distributed import DistEnv, all_reduce_sum, read_scalars
from .packing import Packing, micro_batch_share, packed_micro_batches, padded_positions
from .policy import GRPOPolicy, LossTerms
from .rollout import Rollout
from .sharding import clip_grad_norm, gradient_sync, is_fsdp


@dataclass(frozen=True)
class StepOptions:
    """How an optimizer step runs. ``packing``: packed micro-batches (None: padded rows of ``micro_batch_size``;
    with packing, ``micro_batch_size`` caps the sequences per micro-batch). ``fsdp_grad_sync`` (FSDP2 only):
    ``"micro_batch"`` reduce-scatters every micro-batch's gradients (they stay sharded), ``"step"`` only the last
    one's (fewer collectives, but each rank holds the full unsharded fp32 gradient in between)."""

    micro_batch_size: int
    max_grad_norm: float
    env: DistEnv
    fsdp_grad_sync: str = "micro_batch"
    packing: Packing | None = None


def trim(batch: dict) -> dict:
    """Drop the columns no row of this (micro-)batch needs: shared left padding of the prompts and the
    completion tail after every row's last loss token. Exact: causal attention never looks right."""
    mask = batch["completion_mask"]
    P = batch["prompt_length"]
    used = mask.any(dim=0).nonzero()
    T = int(used[-1]) + 1 if used.numel() else 1
    lead = int((batch["attention_mask"][:, :P].sum(dim=0) > 0).nonzero()[0])
    out = dict(batch)
    out["input_ids"] = batch["input_ids"][:, lead:P + T]
    out["attention_mask"] = batch["attention_mask"][:, lead:P + T]
    out["prompt_length"] = P - lead
    for key in ("completion_ids", "completion_mask", "old_logps", "ref_logps", "teacher_hidden"):
        if key in batch:
            out[key] = batch[key][:, :T]
    return out


@torch.no_grad()
def rollout_logprobs(policy: GRPOPolicy, rollout: Rollout, micro_batch_size: int,
                     packing: Packing | None = None) -> torch.Tensor:
    """(B, T) fp32 log-probs of every completion token under ``policy`` (0 past each row's mask), over padded
    micro-batches of ``micro_batch_size`` rows, or packed ones (``packing``; at most ``micro_batch_size`` sequences
    each)."""
    device = rollout.completion_ids.device
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=device)
    if packing is not None:
        for packed in packed_micro_batches(rollout, list(range(rollout.batch_size)), packing, micro_batch_size):
            out[packed.token_rows, packed.token_cols] = policy.token_logprobs({"packed": packed}).to(out.dtype)
        return out
    for rows in torch.arange(rollout.batch_size, device=device).split(micro_batch_size):
        batch = trim(rollout.batch(rows))
        out[rows, :batch["completion_ids"].shape[1]] = policy.token_logprobs(batch).to(out.dtype)
    return out


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch ready for ``model(batch, ...)``; its loss enters the step's loss as ``loss * share /
    divisor`` (a float or a device tensor; padded micro-batches divide by their number, as before packing existed);
    ``positions``: the positions its forward runs on."""

    batch: dict
    share: float | torch.Tensor
    positions: int
    hidden: torch.Tensor | None = None
    divisor: int = 1

    def scale(self, loss: torch.Tensor | LossTerms) -> torch.Tensor:
        """The micro-batch's part of the step's loss. A distillation run's ``LossTerms``: the GRPO term weighted as
        above, plus the distillation term as it is (it was divided by the step's token count already)."""
        if isinstance(loss, LossTerms):
            return loss.distill if loss.grpo is None else self.scale(loss.grpo) + loss.distill
        if self.divisor != 1:
            loss = loss / self.divisor
        if isinstance(self.share, torch.Tensor):
            return loss * self.share.to(loss.dtype)
        return loss if self.share == 1.0 else loss * self.share


def _padded_micro_batches(rollout: Rollout, rows: torch.Tensor, extra: dict, micro_batch_size: int,
                          global_norm: bool) -> list[MicroBatch]:
    micro_rows = rows.split(micro_batch_size)
    out = []
    for mrows in micro_rows:
        batch = trim(rollout.batch(mrows, **extra))
        hidden = None
        if rollout.hidden is not None:
            in_order = torch.equal(mrows, torch.arange(len(mrows), device=mrows.device))
            if mrows.numel() != rollout.batch_size or not in_order:
                raise RuntimeError("a rollout sampled with its graph must be used as one micro-batch, in order")
            hidden = rollout.hidden[:, :batch["completion_ids"].shape[1]]
        positions = batch["input_ids"].numel()
        out.append(MicroBatch(batch, 1.0, positions, hidden, 1 if global_norm else len(micro_rows)))
    return out


def _packed_micro_batches(rollout: Rollout, rows: torch.Tensor, order: list[int], extra: dict,
                          options: StepOptions, reduction: str) -> list[MicroBatch]:
    if rollout.hidden is not None:
        raise RuntimeError("a rollout sampled with its graph (single pass) trains on padded rows, not packed ones")
    total_scored = rollout.completion_mask[rows].sum()
    out = []
    for packed in packed_micro_batches(rollout, order, options.packing, options.micro_batch_size):
        batch = {"packed": packed, "advantages": extra["advantages"][packed.rows]}
        for key in ("old_logps", "ref_logps", "teacher_hidden"):
            if extra.get(key) is not None:
                batch[key] = packed.gather(extra[key])
        share = micro_batch_share(reduction, packed.num_sequences, len(order), packed.completion_mask.sum(),
                                  total_scored)
        out.append(MicroBatch(batch, share, packed.positions))
    return out


def step_token_count(rollout: Rollout, rows: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """The completion tokens of the optimizer step's ``rows``, averaged over the ranks (so that DDP's gradient
    average makes the step's loss the token mean over all ranks' tokens), at least 1 (the library refuses a count of
    0; the loss divides by max(num_items_in_batch, 1)): a 0-dim fp32 device tensor, not read."""
    n_tokens = rollout.completion_mask[rows].sum().to(torch.float64)
    all_reduce_sum(n_tokens, env)
    return (n_tokens / env.world_size).clamp(min=1).to(torch.float32)


def optimizer_step(model, policy: GRPOPolicy, optimizer, scheduler, rollout: Rollout, rows: torch.Tensor,
                   advantages: torch.Tensor, old_logps, ref_logps, options: StepOptions,
                   order: list[int] | None = None) -> dict[str, float]:
    """``optimizer_step_unread``, then its metrics as floats in one host read (this rank's values)."""
    return read_scalars(optimizer_step_unread(model, policy, optimizer, scheduler, rollout, rows, advantages,
                                              old_logps, ref_logps, options, order))


def optimizer_step_unread(model, policy: GRPOPolicy, optimizer, scheduler, rollout: Rollout, rows: torch.Tensor,
                          advantages: torch.Tensor, old_logps, ref_logps, options: StepOptions,
                          order: list[int] | None = None) -> dict:
    """Gradient-accumulated loss over ``rows`` in micro-batches, clipping, one optimizer and scheduler step.

    ``model`` is ``policy``, its DDP wrapper, or ``policy`` itself sharded with FSDP2 (grpo/sharding.py). When
    the rollout kept its sampling forward's hidden states (``rollout.hidden``, single-pass mode: the whole rollout
    is one padded micro-batch of one on-policy step), the loss backpropagates through them instead of running the
    backbone again. Micro-batch losses are weighted so that the step's loss is that of the whole mini-batch in one
    call (``packing.micro_batch_share``; padded micro-batches are equal, so each weighs 1 / their number). Returns
    the token-weighted means of the loss metrics plus ``loss`` and ``grad_norm`` as 0-d device tensors, not read
    (``distributed.read_scalars`` reads them, in the trainer together with the rollout's statistics: one host read
    per step), and the positions the forwards ran on (``positions``) and those a padded run would
    (``padded_positions``, see ``packing.padded_positions``) as host floats. ``order``: ``rows`` as host ints, which
    packed micro-batches are planned from (None: read from ``rows``, one host sync).
    """
    optimizer.zero_grad(set_to_none=True)
    env = options.env
    sharded = is_fsdp(model)
    reduction = LOSS_TABLE[policy.loss_config.loss_type].reduction
    # Loss types normalized by num_items_in_batch divide by the token count of the whole optimizer step (all
    # ranks); the others normalize inside each micro-batch, and the micro-batch losses are weighted.
    global_norm = reduction == "num_items"
    # The distillation loss (--teacher) is a token mean over the step too: each micro-batch's sum divided by it.
    distilling = policy.distill is not None
    num_items = step_token_count(rollout, rows, env) if global_norm or distilling else None
    extra = dict(advantages=advantages, old_logps=old_logps, ref_logps=ref_logps,
                 teacher_hidden=rollout.teacher_hidden if distilling else None)
    if options.packing is None:
        micro = _padded_micro_batches(rollout, rows, extra, options.micro_batch_size, global_norm)
        padded = sum(mb.positions for mb in micro)
    else:
        order = rows.tolist() if order is None else order
        micro = _packed_micro_batches(rollout, rows, order, extra, options, reduction)
        padded = padded_positions(rollout, order, options.micro_batch_size)
    totals: dict[str, torch.Tensor] = {}
    loss_total = torch.zeros((), dtype=torch.float32, device=rows.device)
    token_total = torch.zeros((), dtype=torch.float32, device=rows.device)
    for i, mb in enumerate(micro):
        last = i == len(micro) - 1
        sync = gradient_sync(model, last or (sharded and options.fsdp_grad_sync == "micro_batch"), env)
        with sync:
            loss, metrics = model(mb.batch, num_items_in_batch=num_items if global_norm else None, hidden=mb.hidden,
                                  **({"distill_num_items": num_items} if distilling else {}))
            scaled = mb.scale(loss)
            scaled.backward()
        mask = mb.batch["packed"].completion_mask if "packed" in mb.batch else mb.batch["completion_mask"]
        weight = mask.sum().float()
        loss_total += scaled.detach().float()
        token_total += weight
        for k, v in metrics.items():  # summed on the device; read once at the end
            totals[k] = totals.get(k, 0.0) + v.detach().float() * weight
    rollout.hidden = None  # its graph is consumed
    params = [p for p in policy.parameters() if p.requires_grad]
    max_norm = options.max_grad_norm if options.max_grad_norm > 0 else float("inf")
    if sharded:  # gradients are DTensor shards: the norm of the full gradient
        grad_norm = clip_grad_norm(params, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    scheduler.step()
    out = {k: v / token_total.clamp(min=1.0) for k, v in totals.items()}
    out.update(loss=loss_total, grad_norm=grad_norm.float(), positions=float(sum(mb.positions for mb in micro)),
               padded_positions=float(padded))
    return out
