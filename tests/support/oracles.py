"""Independent oracles: TRL's own ``GRPOTrainer._compute_loss`` and Liger's ``LigerFusedLinearGRPOLoss``.

TRL's method runs unmodified on a stand-in ``self`` that carries the trainer attributes it reads; the per-token
log-probs and entropies come from TRL's own ``selective_log_softmax`` / ``entropy_from_logits`` on full logits, so
nothing of ours is on the oracle's side.
"""
from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from grpo_kernels import GRPOLossConfig


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x


def trl_compute_loss(logits, ids, advantages, mask=None, old_logps=None, ref_logps=None, is_ratio=None,
                     num_items_in_batch=None, sampling_logps=None, config: GRPOLossConfig | None = None):
    """Run TRL 1.16's ``GRPOTrainer._compute_loss``; returns (loss, metrics dict of floats)."""
    pytest.importorskip("trl.trainer.grpo_trainer", reason="needs trl with its dependencies (pandas, accelerate, "
                        "datasets), installed by the test extra; GPU images without them skip the TRL oracle")
    from trl import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    cfg = config or GRPOLossConfig()
    # TRL's loss never sees a soft cap (the model applies it): give this oracle capped logits, not a capped config
    assert cfg.softcap is None, "trl_compute_loss takes logits already capped (reference.soft_cap), not config.softcap"
    B, T = ids.shape
    mask = torch.ones(B, T, dtype=torch.long) if mask is None else mask.long()

    def per_token(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        z = logits / cfg.temperature
        return selective_log_softmax(z, ids), entropy_from_logits(z) if compute_entropy else None, None

    args = types.SimpleNamespace(
        use_bias_correction_kl=cfg.use_bias_correction_kl, delta=cfg.delta,
        sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
        vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
        vespo_lambda_neg=cfg.vespo_lambda_neg, steps_per_generation=1, entropy_target=0.0)
    trainer = types.SimpleNamespace(
        args=args, beta=cfg.beta, loss_type=cfg.loss_type, epsilon_low=cfg.epsilon_low,
        epsilon_high=cfg.epsilon_high, importance_sampling_level=cfg.importance_sampling_level,
        top_entropy_quantile=cfg.top_entropy_quantile, off_policy_mask_threshold=cfg.off_policy_mask_threshold,
        max_completion_length=cfg.max_completion_length or T, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=_Accelerator(), aux_loss_enabled=False,
        _entropy_bonus_enabled=cfg.entropy_coef != 0.0, entropy_coef=cfg.entropy_coef, use_adaptive_entropy=False,
        _metrics={"train": defaultdict(list)})
    trainer._get_per_token_logps_and_entropies = types.MethodType(per_token, trainer)
    trainer.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, trainer)
    trainer.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    trainer.get_gamma_weights = GRPOTrainer.get_gamma_weights

    n_items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": ids, "completion_mask": mask, "advantages": advantages,
        "num_items_in_batch": n_items.to(logits.dtype if logits.is_floating_point() else torch.float32),
    }
    if old_logps is not None:
        inputs["old_per_token_logps"] = old_logps
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio if is_ratio.dim() == 2 else is_ratio.unsqueeze(1)
    if sampling_logps is not None:
        inputs["sampling_per_token_logps"] = sampling_logps
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, metrics


def trl_loss_grad_metrics(logits, inputs, config, transform=None, dtype=None):
    """TRL's loss, d logits and metrics (tensors) on ``inputs["logits"]`` (``make_inputs`` output) taken in
    ``dtype`` (the logits' own by default) with the per-token inputs in that precision too; ``transform`` (e.g. a soft
    cap) runs on the logits before TRL sees them, inside the autograd graph. Called once in float64 (the truth) and
    once in fp32 (the middle term), it gives the three-way rule's first two terms with TRL as the oracle."""
    dtype = dtype or logits.dtype
    x = logits.to(dtype).detach().requires_grad_(True)
    rest = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()
            if k not in ("logits", "hidden", "weight", "ids", "advantages", "mask")}
    loss, metrics = trl_compute_loss(x if transform is None else transform(x), inputs["ids"],
                                     inputs["advantages"].to(dtype), inputs["mask"], config=config, **rest)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, {k: torch.tensor(float(v), dtype=torch.float64) for k, v in metrics.items()}


def liger_fused_linear_loss(hidden, weight, ids, advantages, mask, bias=None, old_logps=None, ref_logps=None,
                            is_ratio=None, num_items_in_batch=None, config: GRPOLossConfig | None = None):
    """Liger's chunked fused-linear GRPO loss (chunk_size 1, eager) with our config's options; returns loss."""
    pytest.importorskip("liger_kernel.chunked_loss", reason="needs liger-kernel (test extra)")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    cfg = config or GRPOLossConfig()
    module = LigerFusedLinearGRPOLoss(
        beta=cfg.beta, compiled=False, use_ref_model=cfg.beta != 0.0, chunk_size=1,
        epsilon_low=cfg.epsilon_low, epsilon_high=cfg.epsilon_high, loss_type=cfg.loss_type,
        max_completion_length=cfg.max_completion_length or ids.shape[1],
        importance_sampling_level=cfg.importance_sampling_level, sapo_temperature_pos=cfg.sapo_temperature_pos,
        sapo_temperature_neg=cfg.sapo_temperature_neg, temperature=cfg.temperature, delta=cfg.delta,
        use_bias_correction_kl=cfg.use_bias_correction_kl, vespo_k_pos=cfg.vespo_k_pos,
        vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg, vespo_lambda_neg=cfg.vespo_lambda_neg)
    out = module(hidden, weight, ids, mask.long(), advantages, bias=bias, ref_per_token_logps=ref_logps,
                 old_per_token_logps=old_logps, vllm_is_ratio=is_ratio, num_items_in_batch=num_items_in_batch)
    return out[0] if isinstance(out, tuple) else out
