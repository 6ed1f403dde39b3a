"""Shared test inputs: awkward shapes and every option of the loss contract, with readable ids."""
from __future__ import annotations

import dataclasses

import torch

from grpo_kernels import GRPOLossConfig
from grpo_kernels.config import CLIPPED_LOSS_TYPES, LOSS_TYPES


@dataclasses.dataclass
class Case:
    id: str
    overrides: dict
    old: bool = True             # perturbed old log-probs (ratios away from 1, clipping happens)
    ref: bool = False            # reference log-probs (required when beta != 0)
    adv_2d: bool = False         # (B, T) advantages
    is_ratio: str | None = None  # None, "row" (B,) or "token" (B, T)
    sampling: bool = False       # sampling log-probs for the off-policy mask
    num_items: int | None = None

    @property
    def config(self) -> GRPOLossConfig:
        return GRPOLossConfig(**self.overrides)


_ASYMMETRIC = {"epsilon_low": 0.15, "epsilon_high": 0.28}
CASES = [Case(f"{lt}-token", {"loss_type": lt, **(_ASYMMETRIC if lt in CLIPPED_LOSS_TYPES else {})})
         for lt in LOSS_TYPES]
CASES += [Case(f"{lt}-sequence", {"loss_type": lt, "importance_sampling_level": "sequence"})
          for lt in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "sapo")]
CASES += [
    Case("grpo-beta-kl", {"loss_type": "grpo", "beta": 0.04}, ref=True),
    Case("dapo-beta-no-bias-correction", {"beta": 0.1, "use_bias_correction_kl": False}, ref=True),
    Case("sequence-beta", {"loss_type": "grpo", "beta": 0.04, "importance_sampling_level": "sequence"}, ref=True),
    Case("on-policy", {"loss_type": "grpo", "beta": 0.04}, old=False, ref=True),
    Case("delta", {"loss_type": "grpo", "delta": 1.1, "epsilon_high": 0.28}),
    Case("temperature", {"loss_type": "bnpo", "temperature": 0.7}),
    Case("advantages-2d", {"loss_type": "grpo", "beta": 0.02}, ref=True, adv_2d=True),
    Case("num-items", {"loss_type": "dapo"}, num_items=50),
    Case("dr-grpo-max-len", {"loss_type": "dr_grpo", "max_completion_length": 12}),
    Case("is-ratio-token", {"loss_type": "dapo", "beta": 0.04}, ref=True, is_ratio="token"),
    Case("is-ratio-row", {"loss_type": "grpo"}, is_ratio="row"),
    Case("vespo-is-ratio", {"loss_type": "vespo"}, is_ratio="token"),
    Case("cispo-eps", {"loss_type": "cispo", "epsilon_high": 1.05}),
    Case("sapo-temps", {"loss_type": "sapo", "sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3}),
    Case("off-policy-mask", {"loss_type": "grpo", "off_policy_mask_threshold": 0.05}, sampling=True),
    Case("top-entropy", {"loss_type": "dapo", "top_entropy_quantile": 0.4}),
    Case("entropy-bonus", {"loss_type": "grpo", "entropy_coef": 0.05}),
    Case("everything", {"loss_type": "dapo", "beta": 0.04, "top_entropy_quantile": 0.6, "entropy_coef": 0.02,
                        "off_policy_mask_threshold": 0.0, "temperature": 0.9, "delta": 1.3}, ref=True,
         is_ratio="token", sampling=True),
]


def make_inputs(case: Case, B=4, T=7, V=37, dtype=torch.float32, seed=0, hidden_size=None):
    """Random inputs for ``case``: logits (B, T, V) (or hidden/weight when hidden_size), ids, mask with one fully
    masked row and ragged lengths, advantages with both signs and a zero, and the optional per-token tensors."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    if hidden_size:
        out["hidden"] = (torch.randn(B, T, hidden_size, generator=g) / hidden_size ** 0.25).to(dtype)
        out["weight"] = (torch.randn(V, hidden_size, generator=g) / hidden_size ** 0.25).to(dtype)
        logits64 = out["hidden"].double() @ out["weight"].double().T
    else:
        out["logits"] = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
        logits64 = out["logits"].double()
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0  # a fully masked row
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    logp = torch.log_softmax(logits64 / case.config.temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    adv = torch.randn(B, T, generator=g) if case.adv_2d else torch.randn(B, generator=g)
    adv[0] = 0.0 if not case.adv_2d else adv[0]
    out.update(ids=ids, mask=mask, advantages=adv)
    if case.old:
        out["old_logps"] = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    if case.ref:
        out["ref_logps"] = (logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    if case.is_ratio == "token":
        out["is_ratio"] = torch.rand(B, T, generator=g) + 0.5
    elif case.is_ratio == "row":
        out["is_ratio"] = torch.rand(B, generator=g) + 0.5
    if case.sampling:
        out["sampling_logps"] = (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    if case.num_items is not None:
        out["num_items_in_batch"] = case.num_items
    return out


def optional_inputs(inputs: dict) -> dict:
    """The per-token tensors and options of ``make_inputs`` output: everything but the logits (or hidden and
    weight), ids, advantages and mask, i.e. the keyword arguments the loss entry points take as they are."""
    return {k: v for k, v in inputs.items() if k not in ("logits", "hidden", "weight", "ids", "advantages", "mask")}
