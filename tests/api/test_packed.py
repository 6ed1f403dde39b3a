"""Packed sequences (docs/api.md, "Packed sequences"): a packed call (N tokens of S sequences in one row,
``cu_seqlens``) gives the padded (S, Tmax) call's loss, metrics and gradients on the same tokens, for every loss
type and option; bad ``cu_seqlens`` raise a ValueError naming it.

Packing a padded batch: sequence s keeps its first ``kept[s]`` positions (its valid tokens, and for some sequences
a few unscored ones after them, mask 0 in the packed row too); the rest of its row is padding, dropped. Ragged
lengths with a 1-token sequence, a sequence whose tokens are all unscored and an empty one."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import logprobs_and_entropy, loss_from_logps

from ..cases import CASES, make_inputs

PER_TOKEN = ("old_logps", "ref_logps", "sampling_logps")


def packing(mask: torch.Tensor, extra=(0, 2, 1, 0, 3)):
    """(kept lengths (S,), cu_seqlens (S + 1,), flat positions (N,) of the kept tokens in the (S, T) grid)."""
    S, T = mask.shape
    valid = mask.sum(-1)
    kept = torch.clamp(valid + torch.tensor(extra[:S]), max=T)
    cu = torch.zeros(S + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(kept, 0)
    positions = torch.cat([torch.arange(int(k)) + s * T for s, k in enumerate(kept.tolist())])
    return kept, cu, positions


def packed_inputs(inputs: dict, positions, cu, V=None):
    """The padded inputs' kept tokens in one packed row (advantages and a per-row is_ratio per sequence)."""
    flat = lambda t: t.reshape(-1, *t.shape[2:]).index_select(0, positions)  # noqa: E731
    out = {"cu_seqlens": cu, "advantages": inputs["advantages"], "ids": flat(inputs["ids"]),
           "mask": flat(inputs["mask"])}
    for k in ("logits", "hidden") + PER_TOKEN:
        if k in inputs:
            out[k] = flat(inputs[k])
    if "is_ratio" in inputs:
        isr = inputs["is_ratio"]
        out["is_ratio"] = isr if isr.dim() == 1 else flat(isr)
    for k in ("num_items_in_batch", "weight"):
        if k in inputs:
            out[k] = inputs[k]
    return out


def _config(case, T):
    cfg = case.config
    if cfg.loss_type == "dr_grpo" and cfg.max_completion_length is None:
        cfg = cfg.replace(max_completion_length=T)  # the padded call's default, which a packed one must be given
    return cfg


def _padded_batch(case, extra, seed=0):
    inputs = make_inputs(case, B=5, T=7, V=37, dtype=torch.float64, seed=seed)
    kept, cu, positions = packing(inputs["mask"], extra)
    if "is_ratio" in inputs and inputs["is_ratio"].dim() == 2:
        # TRL pads is_ratio with 1 (vespo folds every position of a padded row, and log 1 = 0)
        beyond = torch.arange(7).unsqueeze(0) >= kept.unsqueeze(1)
        inputs["is_ratio"] = torch.where(beyond, 1.0, inputs["is_ratio"].double())
    return inputs, kept, cu, positions


REFERENCE_CASES = [c for c in CASES if not c.adv_2d]


@pytest.mark.parametrize("extra", [(0, 2, 1, 0, 3), (0, 0, 0, 0, 0)], ids=["unscored-tokens", "valid-only"])
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: c.id)
def test_reference_packed_equals_padded(case, extra):
    """The eager reference, float64: loss, metrics, d logp and d entropy at the kept tokens (exact up to the
    order of float64 sums: 1e-12 relative)."""
    inputs, kept, cu, positions = _padded_batch(case, extra)
    cfg = _config(case, 7)
    logp, ent = logprobs_and_entropy(inputs["logits"], inputs["ids"], cfg.temperature)
    logp, ent = logp.detach().requires_grad_(True), ent.detach().requires_grad_(True)
    rest = {k: inputs[k] for k in PER_TOKEN + ("is_ratio", "num_items_in_batch") if k in inputs}
    loss, metrics = loss_from_logps(logp, inputs["advantages"], inputs["mask"], entropy=ent, config=cfg, **rest)
    g_logp, g_ent = torch.autograd.grad(loss, [logp, ent], allow_unused=True)
    packed = packed_inputs(inputs, positions, cu)
    p_logp = logp.detach().reshape(-1)[positions].requires_grad_(True)
    p_ent = ent.detach().reshape(-1)[positions].requires_grad_(True)
    p_rest = {k: packed[k] for k in PER_TOKEN + ("is_ratio", "num_items_in_batch") if k in packed}
    p_loss, p_metrics = loss_from_logps(p_logp, packed["advantages"], packed["mask"], entropy=p_ent, config=cfg,
                                        cu_seqlens=cu, **p_rest)
    pg_logp, pg_ent = torch.autograd.grad(p_loss, [p_logp, p_ent], allow_unused=True)
    torch.testing.assert_close(p_loss, loss, rtol=1e-12, atol=1e-14)
    assert set(p_metrics) == set(metrics)
    for k in metrics:
        torch.testing.assert_close(p_metrics[k], metrics[k], rtol=1e-12, atol=1e-14, msg=k)
    torch.testing.assert_close(pg_logp, g_logp.reshape(-1)[positions], rtol=1e-12, atol=1e-14)
    if g_ent is not None:
        torch.testing.assert_close(pg_ent, g_ent.reshape(-1)[positions], rtol=1e-12, atol=1e-14)
    # the padding the packed call dropped gets no gradient in the padded one
    dropped = torch.ones(logp.numel(), dtype=torch.bool)
    dropped[positions] = False
    assert (g_logp.reshape(-1)[dropped] == 0).all()
