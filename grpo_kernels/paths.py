"""The names of the paths a call can take, and what each is, defined once: the planner chooses among them
(``planner/``), the path modules and ``explain`` compare with them, never with string literals (docs/DESIGN.md,
"The planner and the paths").
"""
from __future__ import annotations

LOGITS_FAST = "logits.fast"
LOGITS_SWEEP = "logits.sweep"
LOGITS_TORCH = "logits.torch"
HEAD_FAST = "head.fast"
HEAD_FAST_SEQUENCE = "head.fast_sequence"
HEAD_FAST_VOCAB_PARALLEL = "head.fast_vocab_parallel"
HEAD_LIGHT = "head.light"
HEAD_NO_GRAD = "head.no_grad"
HEAD_TORCH = "head.torch"

# The paths behind ``head.light``'s one log-prob Function / op (``head/light.py``), in the op options' order.
HEAD_LOGPROB_PATHS = (HEAD_LIGHT, HEAD_NO_GRAD, HEAD_TORCH)
# The paths that compute the loss's gradients in the forward and hand them out in the backward.
HEAD_FAST_PATHS = (HEAD_FAST, HEAD_FAST_SEQUENCE, HEAD_FAST_VOCAB_PARALLEL)
# The paths that run cuBLAS GEMMs (``explain`` adds the fp32-output GEMM status).
HEAD_GEMM_PATHS = HEAD_FAST_PATHS + (HEAD_NO_GRAD, HEAD_LIGHT)

PATHS = {
    LOGITS_FAST: "one Triton kernel per row: logsumexp, per-token loss and its gradient, d logits written in the "
                 "forward; the backward only scales them",
    LOGITS_SWEEP: "Triton log-prob sweep, the per-token stage, then a d-logits sweep in the backward",
    LOGITS_TORCH: "chunked eager PyTorch over rows of logits",
    HEAD_FAST: "per row chunk: cuBLAS fp32 logits, one Triton epilogue (loss, d logits), cuBLAS dH / dW: gradients "
               "made in the forward, 6NHV (4NHV frozen head)",
    HEAD_FAST_SEQUENCE: "the fast head path with chunks of whole sequences (sequence-level ratios, vespo, the "
                        "off-policy mask)",
    HEAD_LIGHT: "memory-light: an O(N) Triton forward, then a recompute backward over vocab chunks, 8NHV",
    HEAD_NO_GRAD: "no gradient wanted: per row chunk, cuBLAS fp32 logits + the fold kernel, 2NHV",
    HEAD_TORCH: "tiled eager PyTorch with an online logsumexp, tiles recomputed in the backward",
    HEAD_FAST_VOCAB_PARALLEL: "vocab-parallel fast path: per chunk of whole sequences, each rank's shard logits, "
                              "an all-gather of 3 numbers per row and rank for the global logsumexp, then the "
                              "epilogue and local dW: 6NHV / TP per rank",
}

# ---------------------------------------------------------------------------------------------- distillation
# The two-head divergence (``linear_token_divergence``, ``fused_linear_distill_loss``; docs/DESIGN.md,
# "Distillation"), planned by ``planner.plan_distill``.
DISTILL_FAST = "distill.fast"
DISTILL_LIGHT = "distill.light"
DISTILL_NO_GRAD = "distill.no_grad"
DISTILL_TORCH = "distill.torch"
DISTILL_TORCH_FAST = "distill.torch_fast"
# In the options' order (``head/distill.py``'s registered ops take the path as its index).
DISTILL_PATHS = (DISTILL_FAST, DISTILL_LIGHT, DISTILL_NO_GRAD, DISTILL_TORCH, DISTILL_TORCH_FAST)
# The distillation paths that run cuBLAS GEMMs (``explain`` adds the fp32-output GEMM status).
DISTILL_GEMM_PATHS = (DISTILL_FAST, DISTILL_LIGHT, DISTILL_NO_GRAD)

PATHS.update({
    DISTILL_FAST: "per row chunk: cuBLAS fp32 logits of both heads, one Triton epilogue per row (both logsumexps, "
                  "the divergence, the student's entropy, d student logits in place), cuBLAS dH / dW: gradients made "
                  "in the forward, 8NHV (6NHV frozen student head)",
    DISTILL_LIGHT: "memory-light: per tile of rows x vocabulary both heads' cuBLAS fp32 logits folded by Triton "
                   "(online logsumexps; the JSD a second pass when the tile is narrower than V), recomputed in the "
                   "backward: 12NHV (16NHV for the JSD over vocabulary tiles)",
    DISTILL_NO_GRAD: "no gradient wanted: per tile, cuBLAS fp32 logits of both heads and the Triton fold, 4NHV",
    DISTILL_TORCH: "chunked eager PyTorch over rows of both heads' logits (whole vocabulary), recomputed in the "
                   "backward",
    DISTILL_TORCH_FAST: "chunked eager PyTorch over rows of both heads' logits, the student's gradients made in the "
                        "forward",
})
