"""The fast path of ``fused_linear_grpo_loss``: the loss and its gradients computed in the forward pass.

For every configuration whose per-token gradient is known once a token's log-prob is
(``loss_types.per_token_gradient_known``: token-level ratios, not vespo, no off-policy or top-entropy mask), the
reduction is a per-token weight known before the sweep, so each row chunk goes logits (cuBLAS, fp32) -> fold,
loss terms and d logits (one Triton epilogue) -> dH, dW, dbias (cuBLAS): 6NHV instead of the recompute design's
8NHV, 4NHV for a frozen head (``kernels/linear_epilogue_kernels.py``). The backward only scales the stored gradients
by the incoming gradient.

Configurations whose per-token gradient needs only its own sequence (GSPO's sequence ratio, vespo's row weights,
the off-policy row mask) take the same route with chunks of whole sequences, when every sequence's valid tokens
fit in one chunk: per chunk the fold kernel gives log-probs and entropies, autograd through the reference loss on
the chunk's sequences gives their gradients (``fused_linear_sequence_loss_in_forward``), and the d-logits epilogue
and GEMMs follow. The top-entropy mask (a quantile over the whole batch) stays on the memory-light path.

Memory: ``GRPOLossConfig.memory_budget`` bytes (default ``DEFAULT_MEMORY_BUDGET`` = 1 GiB) bound the fp32 logits
chunk, R = min(N, budget // (4 V)) rows; when fewer than ``min(N, FAST_PATH_MIN_ROWS)`` rows fit, the memory-light
path runs instead (its d-logits chunk then gets the budget). Besides the chunk: the fp32 dW accumulator (4 V H,
trainable head) and dbias (4 V), the d hidden result (N H in hidden's dtype) and ~60 bytes per token.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .config import GRPOLossConfig
from .inputs import HeadInputs, LossInputs
from .loss_types import LOSS_TABLE, per_token_gradient_known, reduction_weights
from .reference import loss_from_logps

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
        return (*_hand_out(ctx, grad_loss), None, None, None, None, None)


def _hand_out(ctx, grad_loss):
    """The gradients stored by a gradient-in-forward pass, scaled by the incoming gradient of the loss."""
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
    return out


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


# ------------------------------------------------------------------ sequence-level losses (GSPO, vespo, off-policy)


def sequence_chunks(cfg: GRPOLossConfig, impl: str, row_counts: list, V: int) -> list | None:
    """Chunks of whole sequences for the sequence-level gradient-in-forward path, as (first sequence, end
    sequence, first row, end row) in compact valid rows, or None: the memory-light path.

    For configurations whose per-token gradient needs only its own sequence (GSPO's sequence ratio, vespo, the
    off-policy row mask; not the top-entropy quantile, a statistic of the whole batch), when every sequence's
    valid tokens fit in one chunk of fp32 logits within memory_budget. row_counts: valid tokens per sequence."""
    if impl != "triton" or not cfg.grad_in_forward or per_token_gradient_known(cfg) or cfg.top_entropy_quantile < 1:
        return None
    budget = DEFAULT_MEMORY_BUDGET if cfg.memory_budget is None else cfg.memory_budget
    max_rows = budget // (4 * V)
    N = sum(row_counts)
    if max_rows < min(N, FAST_PATH_MIN_ROWS) or max(row_counts, default=0) > max_rows:
        return None
    chunks, b0, r0, rows = [], 0, 0, 0
    for b, n in enumerate(row_counts):
        if rows + n > max_rows:
            chunks.append((b0, b, r0, r0 + rows))
            b0, r0, rows = b, r0 + rows, 0
        rows += n
    chunks.append((b0, len(row_counts), r0, r0 + rows))
    return chunks


class _HeadSequenceGradsInForward(torch.autograd.Function):
    """(hidden, weight, bias, ids) -> (anchor, logp, entropy): the gradients are made in forward and handed out
    by the backward of ``anchor``, a 0 added to the loss (whose value comes from the reference on logp, entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, bounds, token_grads, temperature):
        from .kernels.linear_epilogue_kernels import head_sequence_grads  # lazy: creates the Triton kernels
        needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:3], (hidden, weight, bias))]
        with torch.autocast(hidden.device.type, enabled=False):
            logp, ent, dh, dw32, db32 = head_sequence_grads(hidden, weight, bias, ids, bounds, token_grads,
                                                            temperature, *needs)
        ctx.grads = (dh, dw32, db32)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(logp, ent)
        return torch.zeros((), dtype=torch.float32, device=hidden.device), logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_anchor, _grad_logp, _grad_ent):
        return (*_hand_out(ctx, grad_anchor), None, None, None, None)


def fused_linear_sequence_loss_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig,
                                          valid, chunks: list):
    """(loss, metrics) on the sequence-level gradient-in-forward path; ``valid``: the compact rows (or None).

    Per chunk of whole sequences, d loss / d logp and d loss / d entropy come from autograd through the reference
    loss on those sequences alone (one definition of the maths), rescaled from the sub-batch's reduction weights
    to the batch's: within a sequence every reduction weights its tokens alike, so the rescale is exact."""
    B, T = inputs.shape
    dev = inputs.hidden.device
    mask_b = torch.ones(B, T, dtype=torch.bool, device=dev) if batch.mask is None else batch.mask.bool()
    mask_f = mask_b.float()
    n_valid = mask_f.sum().clamp(min=1)
    weights = reduction_weights(mask_f, cfg.loss_type, batch.num_items_in_batch, cfg.max_completion_length)
    hidden, ids = inputs.hidden, inputs.ids
    if valid is not None:
        hidden, ids = hidden.index_select(0, valid), ids.index_select(0, valid)
    sequences_of = {r0: (b0, b1) for b0, b1, r0, _ in chunks}
    bounds = [0] + [r1 for *_, r1 in chunks]

    def rows_of(x, b0, b1):
        return None if x is None else x[b0:b1]

    def token_grads(r0, r1, logp, ent):
        b0, b1 = sequences_of[r0]
        sub_mask = mask_b[b0:b1]
        with torch.enable_grad():
            x = torch.zeros(sub_mask.shape, dtype=torch.float32, device=dev)
            x[sub_mask] = logp
            x.requires_grad_(True)
            e = None
            if cfg.entropy_coef != 0.0:
                e = torch.zeros(sub_mask.shape, dtype=torch.float32, device=dev)
                e[sub_mask] = ent
                e.requires_grad_(True)
            sub_loss, _ = loss_from_logps(x, batch.advantages[b0:b1], sub_mask,
                                          old_logps=rows_of(batch.old_logps, b0, b1),
                                          ref_logps=rows_of(batch.ref_logps, b0, b1),
                                          is_ratio=rows_of(batch.is_ratio, b0, b1), entropy=e,
                                          num_items_in_batch=None,
                                          sampling_logps=rows_of(batch.sampling_logps, b0, b1), config=cfg)
            grads = torch.autograd.grad(sub_loss, [x] if e is None else [x, e])
        sub_w = reduction_weights(sub_mask.float(), cfg.loss_type, None, cfg.max_completion_length)
        scale = (weights[b0:b1][sub_mask] / sub_w[sub_mask])
        g = grads[0][sub_mask] * scale
        g_h = None if e is None else grads[1][sub_mask] * (sub_mask.sum().clamp(min=1) / n_valid)
        return g.float(), None if g_h is None else g_h.float()

    anchor, logp, ent = _HeadSequenceGradsInForward.apply(hidden, inputs.weight, inputs.bias, ids, bounds,
                                                          token_grads, inputs.temperature)
    if valid is not None:
        logp, ent = (torch.zeros(B * T, dtype=t.dtype, device=dev).index_copy(0, valid, t) for t in (logp, ent))
    with torch.no_grad():
        loss, metrics = loss_from_logps(logp.view(B, T), batch.advantages, batch.mask, old_logps=batch.old_logps,
                                        ref_logps=batch.ref_logps, is_ratio=batch.is_ratio, entropy=ent.view(B, T),
                                        num_items_in_batch=batch.num_items_in_batch,
                                        sampling_logps=batch.sampling_logps, config=cfg)
    return loss.float() + anchor, metrics


def gradient_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig):
    """(loss, metrics) of ``fused_linear_grpo_loss`` on a gradient-in-forward path, or None when the memory-light
    path must run (PyTorch implementation, grad_in_forward=False, the top-entropy mask, a budget too small)."""
    B, T = inputs.shape
    V = inputs.weight.shape[0]
    rows = fast_path_rows(cfg, inputs.impl, B * T, V)
    if rows:
        return fused_linear_loss_in_forward(inputs, batch, cfg, rows)
    if inputs.impl != "triton" or not cfg.grad_in_forward or cfg.top_entropy_quantile < 1 or B * T == 0:
        return None
    mask_b = None if batch.mask is None else batch.mask.bool()
    counts = [T] * B if mask_b is None else mask_b.sum(-1).tolist()  # one host sync: the chunks' sizes
    chunks = sequence_chunks(cfg, inputs.impl, counts, V)
    if chunks is None:
        return None
    valid = None
    if mask_b is not None and sum(counts) != B * T:
        valid = mask_b.reshape(-1).nonzero().squeeze(1)
    return fused_linear_sequence_loss_in_forward(inputs, batch, cfg, valid, chunks)
