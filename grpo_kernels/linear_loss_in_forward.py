"""The fast path of ``fused_linear_grpo_loss``: the loss and its gradients computed in the forward pass.

For every configuration whose per-token gradient is known once a token's log-prob is
(``loss_types.per_token_gradient_known``: token-level ratios, not vespo, no off-policy or top-entropy mask), the
reduction is a per-token weight known before the sweep, so each row chunk goes logits (cuBLAS, fp32) -> fold,
loss terms and d logits (one Triton epilogue) -> dH, dW, dbias (cuBLAS): 6NHV instead of the recompute design's
8NHV, 4NHV for a frozen head (``kernels/linear_epilogue_kernels.py``). The backward only scales the stored gradients
by the incoming gradient. GSPO (sequence-level ratios) is not on this path: its ratio needs the whole sequence.

Memory: ``GRPOLossConfig.memory_budget`` bytes (default ``DEFAULT_MEMORY_BUDGET`` = 1 GiB) bound the fp32 logits
chunk, R = min(N, budget // (4 V)) rows; when fewer than ``min(N, FAST_PATH_MIN_ROWS)`` rows fit, the memory-light
path runs instead (its d-logits chunk then gets the budget). Besides the chunk: the fp32 dW accumulator (4 V H,
trainable head) and dbias (4 V), the d hidden result (N H in hidden's dtype) and 40 bytes per token.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .config import GRPOLossConfig
from .inputs import HeadInputs, LossInputs
from .loss_types import LOSS_TABLE, per_token_gradient_known, reduction_weights

# Bytes of the fp32 logits chunk of the gradient-in-forward path when memory_budget is None.
DEFAULT_MEMORY_BUDGET = 1 << 30
# Fewest rows per chunk worth the fast path: below ~256 rows the per-chunk read + write of the fp32 dW
# accumulator (8 V H bytes) costs more than the chunk's GEMMs (6 R V H FLOPs) on an H100/H200.
FAST_PATH_MIN_ROWS = 256


def fast_path_rows(cfg: GRPOLossConfig, impl: str, N: int, V: int) -> int:
    """Rows per chunk of the gradient-in-forward path for N tokens and V classes, or 0: the memory-light path."""
    if impl != "triton" or not cfg.grad_in_forward or not per_token_gradient_known(cfg):
        return 0
    budget = DEFAULT_MEMORY_BUDGET if cfg.memory_budget is None else cfg.memory_budget
    max_rows = budget // (4 * V)
    if N == 0:
        return 1
    if max_rows < min(N, FAST_PATH_MIN_ROWS):
        return 0
    n_chunks = -(-N // max_rows)
    return -(-N // n_chunks)  # evenly spread: no small last chunk


def light_path_chunk_bytes(cfg: GRPOLossConfig) -> int | None:
    """Bytes of the memory-light path's d-logits chunk: memory_budget, or None: the backward's default,
    ``linear_backward_kernels.DETERMINISTIC_CHUNK_FRACTION`` (1%) of the fp32 logits of the valid rows."""
    return cfg.memory_budget


class _HeadLossInForward(torch.autograd.Function):
    """(hidden (N, H), weight, bias, ids, per-token inputs) -> (loss, metric sums); gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, tokens, cfg, rows, entropy_scale):
        from .kernels.linear_epilogue_kernels import head_loss_and_grads  # lazy: creates the Triton kernels
        needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:3], (hidden, weight, bias))]
        with torch.autocast(hidden.device.type, enabled=False):  # fp32 accumulation is the kernels' own
            logp, ent, terms, dh, dw32, db32 = head_loss_and_grads(
                hidden, weight, bias, ids, tokens, cfg, LOSS_TABLE[cfg.loss_type].policy_kind, rows, *needs)
        # Fixed-order fp64 sums of the per-token terms: deterministic, and no precision lost over many tokens.
        sums = torch.cat([terms.double().sum(0), ent.double().sum().reshape(1)])
        loss = sums[0] - cfg.entropy_coef * sums[-1] * entropy_scale
        ctx.grads = (dh, dw32, db32)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(sums)
        return loss.float(), sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        # Why only a scale: the forward already holds d loss / d (hidden, weight, bias) at grad_loss = 1.
        if ctx.grads is None:
            raise RuntimeError("fused_linear_grpo_loss computed its gradients in the forward and has already handed "
                               "them out (a second backward through the same graph, e.g. retain_graph=True): pass "
                               "grad_in_forward=False for repeated backward passes")
        out = []
        for grad, dtype in zip(ctx.grads, ctx.dtypes):
            if grad is None:
                out.append(None)
            elif grad.dtype == dtype:
                out.append(grad.mul_(grad_loss.to(grad.device)))  # in place: no second V x H buffer
            else:
                scaled = torch.empty(grad.shape, dtype=dtype, device=grad.device)
                torch.mul(grad, grad_loss.to(grad.device), out=scaled)  # one rounding from the fp32 accumulator
                out.append(scaled)
        ctx.grads = None  # handed out (and partly scaled in place): release them with this backward
        return (*out, None, None, None, None, None)


def _per_token(x, B: int, T: int, rows):
    """A (B,), (B, 1) or (B, T) tensor as fp32 (N_valid,) contiguous values at the valid tokens."""
    if x is None:
        return None
    x = x.float()
    x = x.reshape(B, 1).expand(B, T) if x.dim() == 1 or x.shape[-1] == 1 else x
    x = x.reshape(-1)
    return (x if rows is None else x.index_select(0, rows)).contiguous()


def fused_linear_loss_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig, rows: int):
    """(loss, metrics) of ``fused_linear_grpo_loss`` on the gradient-in-forward path, chunks of ``rows`` tokens."""
    B, T = inputs.shape
    dev = inputs.hidden.device
    mask_b = torch.ones(B, T, dtype=torch.bool, device=dev) if batch.mask is None else batch.mask.bool()
    mask_f = mask_b.float()
    n_valid = mask_f.sum()
    weights = reduction_weights(mask_f, cfg.loss_type, batch.num_items_in_batch, cfg.max_completion_length)
    hidden, ids, valid = inputs.hidden, inputs.ids, None
    if batch.mask is not None:
        valid = mask_b.reshape(-1).nonzero().squeeze(1)  # one host sync: the compact batch's size
        if valid.numel() == B * T:
            valid = None
        else:  # padded rows cost neither GEMMs nor epilogue: gather the valid ones (differentiable)
            hidden, ids = hidden.index_select(0, valid), ids.index_select(0, valid)
    tokens = {"adv": _per_token(batch.advantages, B, T, valid), "w": _per_token(weights, B, T, valid),
              "old": _per_token(batch.old_logps, B, T, valid), "ref": _per_token(batch.ref_logps, B, T, valid),
              "isr": _per_token(batch.is_ratio, B, T, valid)}
    count = n_valid.clamp(min=1)
    if cfg.entropy_coef != 0.0:
        # d loss / d entropy of every valid token: loss = ... - entropy_coef * sum(entropy) / n_valid
        tokens["ge"] = (-cfg.entropy_coef / count).reshape(1).float()
    loss, sums = _HeadLossInForward.apply(hidden, inputs.weight, inputs.bias, ids, tokens, cfg, rows,
                                          1.0 / count.double())
    with torch.no_grad():
        ratio = (sums / count.double()).float()
        metrics = {
            "kl": ratio[1] if batch.ref_logps is not None else torch.zeros((), device=dev),
            "entropy": ratio[-1],
            "clip_ratio/low_mean": ratio[2],
            "clip_ratio/high_mean": ratio[3],
            "clip_ratio/region_mean": ratio[4],
        }
        if LOSS_TABLE[cfg.loss_type].policy == "cispo":
            metrics["cispo_clip_ratio"] = ratio[5]
    return loss, metrics
