"""The per-token term layout shared by the Triton loss kernels, and the one function that turns their sums into the
metrics dict (the same keys and meanings as ``reference.loss_from_logps``, docs/numerics.md).

Every loss kernel writes, per token (or per block of tokens), the columns below in this order; the logits
gradient-in-forward kernel appends the masked entropy as column ``ENTROPY``. Sums are taken in fp64 in a fixed
order (deterministic), then divided by the number of valid tokens.
"""
from __future__ import annotations

import torch

from .loss_types import LOSS_TABLE

LOSS = 0            # sum of w * l: the loss before the entropy bonus
KL = 1              # sum of m * k3 KL
CLIP_LOW = 2        # sum of m * [rho < 1 - eps_low and A < 0]
CLIP_HIGH = 3       # sum of m * [rho > 1 + eps_high and A > 0]
CLIP_REGION = 4     # sum of m * (low or high)
CISPO_CLIPPED = 5   # sum of m * [rho > eps_high and A > 0] (cispo only)
ENTROPY = 6         # sum of m * entropy, where a kernel carries it
N_TERMS = 6         # the columns every loss kernel writes (ENTROPY comes on top where present)


def metrics_from_sums(sums: torch.Tensor, entropy_sum: torch.Tensor, count: torch.Tensor, has_ref: bool,
                      loss_type: str) -> dict:
    """The metrics dict from the term sums (at least ``N_TERMS`` values), the masked entropy sum and the valid-token
    count (>= 1): detached 0-dim fp32 tensors ``kl``, ``entropy``, ``clip_ratio/{low,high,region}_mean`` and, for
    cispo, ``cispo_clip_ratio``."""
    with torch.no_grad():
        count = count.double()
        mean = (sums[:N_TERMS].double() / count).float()
        metrics = {
            "kl": mean[KL] if has_ref else torch.zeros((), device=sums.device),
            "entropy": (entropy_sum.detach().double() / count).float(),
            "clip_ratio/low_mean": mean[CLIP_LOW],
            "clip_ratio/high_mean": mean[CLIP_HIGH],
            "clip_ratio/region_mean": mean[CLIP_REGION],
        }
        if LOSS_TABLE[loss_type].policy == "cispo":
            metrics["cispo_clip_ratio"] = mean[CISPO_CLIPPED]
    return metrics
