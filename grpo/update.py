"""One optimizer step on a rollout's rows, and the no-grad log-probs (old policy, reference) it may need.

``trim`` drops, per micro-batch, the columns no row needs (shared left padding, completion tail), which is exact
under causal attention and saves most of the padding cost of short completions.
"""
from __future__ import annotations

import torch

from grpo_kernels.loss_types import LOSS_TABLE

from .distributed import DistEnv, all_reduce_sum
from .policy import GRPOPolicy
from .rollout import Rollout
from .sharding import clip_grad_norm, gradient_sync, is_fsdp


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
    for key in ("completion_ids", "completion_mask", "old_logps", "ref_logps"):
        if key in batch:
            out[key] = batch[key][:, :T]
    return out


@torch.no_grad()
def rollout_logprobs(policy: GRPOPolicy, rollout: Rollout, micro_batch_size: int) -> torch.Tensor:
    """(B, T) fp32 log-probs of every completion token under ``policy`` (0 past each row's mask)."""
    device = rollout.completion_ids.device
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=device)
    for rows in torch.arange(rollout.batch_size, device=device).split(micro_batch_size):
        batch = trim(rollout.batch(rows))
        out[rows, :batch["completion_ids"].shape[1]] = policy.token_logprobs(batch)
    return out


def optimizer_step(model, policy: GRPOPolicy, optimizer, scheduler, rollout: Rollout, rows: torch.Tensor,
                   advantages: torch.Tensor, old_logps, ref_logps, *, micro_batch_size: int, max_grad_norm: float,
                   env: DistEnv, fsdp_grad_sync: str = "micro_batch") -> dict:
    """Gradient-accumulated loss over ``rows`` in micro-batches, clipping, one optimizer and scheduler step.

    ``model`` is ``policy``, its DDP wrapper, or ``policy`` itself sharded with FSDP2 (grpo/sharding.py). When
    the rollout kept its sampling forward's hidden states (``rollout.hidden``, single-pass mode: the whole rollout
    is one micro-batch of one on-policy step), the loss backpropagates through them instead of running the
    backbone again. Returns the token-weighted means of the loss metrics plus ``loss`` and ``grad_norm`` (floats:
    one host sync per micro-batch, for the metrics). ``fsdp_grad_sync`` (FSDP2 only):
    ``"micro_batch"`` reduce-scatters every micro-batch's gradients (they stay sharded), ``"step"`` only the last
    one's (fewer collectives, but each rank holds the full unsharded fp32 gradient in between).
    """
    optimizer.zero_grad(set_to_none=True)
    sharded = is_fsdp(model)
    micro_rows = rows.split(micro_batch_size)
    # Loss types normalized by num_items_in_batch divide by the token count of the whole optimizer step (all
    # ranks); the others normalize inside each micro-batch, so their micro-batch losses are averaged.
    global_norm = LOSS_TABLE[policy.loss_config.loss_type].uses_num_items_in_batch
    num_items = None
    if global_norm:
        n_tokens = rollout.completion_mask[rows].sum().to(torch.float64)
        all_reduce_sum(n_tokens, env)
        # at least 1 (the loss divides by max(num_items_in_batch, 1); the library refuses a count of 0)
        num_items = (n_tokens / env.world_size).clamp(min=1).to(torch.float32)
    totals: dict[str, torch.Tensor] = {}
    loss_total = torch.zeros((), dtype=torch.float32, device=rows.device)
    token_total = torch.zeros((), dtype=torch.float32, device=rows.device)
    for i, mrows in enumerate(micro_rows):
        batch = trim(rollout.batch(mrows, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps))
        last = i == len(micro_rows) - 1
        sync = gradient_sync(model, last or (sharded and fsdp_grad_sync == "micro_batch"), env)
        hidden = None
        if rollout.hidden is not None:
            if mrows.numel() != rollout.batch_size or not torch.equal(mrows, torch.arange(len(mrows), device=mrows.device)):
                raise RuntimeError("a rollout sampled with its graph must be used as one micro-batch, in order")
            hidden = rollout.hidden[:, :batch["completion_ids"].shape[1]]
        with sync:
            loss, metrics = model(batch, num_items_in_batch=num_items, hidden=hidden)
            scaled = loss if global_norm else loss / len(micro_rows)
            scaled.backward()
        weight = batch["completion_mask"].sum().float()
        loss_total += scaled.detach().float()
        token_total += weight
        for k, v in metrics.items():  # summed on the device; read once at the end
            totals[k] = totals.get(k, 0.0) + v.detach().float() * weight
    rollout.hidden = None  # its graph is consumed
    params = [p for p in policy.parameters() if p.requires_grad]
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    if sharded:  # gradients are DTensor shards: the norm of the full gradient
        grad_norm = clip_grad_norm(params, max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    optimizer.step()
    scheduler.step()
    names = list(totals)
    values = torch.stack([totals[k] / token_total.clamp(min=1.0) for k in names]
                         + [loss_total, grad_norm.float()]).tolist()  # one host sync for every metric
    out = dict(zip(names, values[:len(names)]))
    out.update(loss=values[-2], grad_norm=values[-1])
    return out
