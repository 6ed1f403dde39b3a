"""Triton kernels over given logits: per-token log-prob, logsumexp and entropy in one vocab sweep, and the
backward that writes d logits (optionally into the logits buffer itself).

Layout: logits (B, T, V) with any batch/time strides and a unit vocab stride (slices such as
``logits[:, :-1]`` need no copy); one program per token on a 1-D grid over B*T (a 2-D grid breaks at
T >= 65536); int64 offsets (B*T*V exceeds 2^31 at real sizes); fp32 accumulation for every input dtype.
Lengths, the temperature and the soft cap's value are runtime arguments, so a new T, V, temperature or cap does
not recompile; whether there is a cap at all is a constexpr (``SOFTCAP``: the kernels without it are the same code
as before the cap existed).
"""
from __future__ import annotations

import torch

from .._checks import alloc
from .._triton import import_triton
from .launch import launch
from .common import soft_cap
from .host import as_btv, cap_args, dlogits_result
from .logits_rows import row_logsumexp_entropy, tiles, vec_for, write_row_dlogits

triton, tl = import_triton()


# Why T alone is not specialized: a new completion length must not compile a new variant; V keeps its
# divisibility-by-16 class so that the row sweeps vectorize (see logits_rows).
@triton.jit(do_not_specialize=["T"])
def logits_logprobs_fwd(logits_ptr, ids_ptr, mask_ptr, logp_ptr, lse_ptr, entropy_ptr,
                        T, V, stride_b, stride_t, inv_temperature, softcap,
                        HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    # Why one row per program: a token's statistics need the whole vocab row; rows are independent.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // T) * stride_b + (row % T) * stride_t
    # Why the row mask: padded tokens (often a third of a GRPO batch) skip the sweep and read nothing;
    # their outputs are 0, which the loss masks out.
    if HAS_MASK:
        keep = tl.load(mask_ptr + row) != 0
    else:
        keep = row >= 0
    lse, entropy = row_logsumexp_entropy(base, V, keep, inv_temperature, softcap, SOFTCAP, BLOCK_V, VEC, "")
    # Why a scalar load for the target: gathering inside the sweep would cost a compare per element.
    target = tl.load(ids_ptr + row)
    x_target = tl.load(base + target, mask=keep, other=0.0).to(tl.float32)
    z_target = soft_cap(x_target, softcap, SOFTCAP) * inv_temperature
    tl.store(logp_ptr + row, tl.where(keep, z_target - lse, 0.0))
    tl.store(lse_ptr + row, lse)
    tl.store(entropy_ptr + row, entropy)


@triton.jit(do_not_specialize=["T"])
def logits_logprobs_bwd(logits_ptr, ids_ptr, lse_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr,
                        dlogits_ptr, T, V, stride_b, stride_t, out_stride_b, out_stride_t, inv_temperature, softcap,
                        SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
                        VEC: tl.constexpr):
    # Why recompute p from the saved logsumexp: storing softmax would be a second B x T x V tensor.
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    g = tl.load(grad_logp_ptr + row)
    target = tl.load(ids_ptr + row)
    active = g != 0.0
    g_h = 0.0
    h = 0.0
    if HAS_ENTROPY_GRAD:
        g_h = tl.load(grad_entropy_ptr + row)
        h = tl.load(entropy_ptr + row)
        active = active | (g_h != 0.0)
    # Why `active`: a token without gradient (padding) writes zeros and reads nothing.
    # Why store in the logits dtype: in-place mode writes back into the logits buffer; the target's raw logit is
    # read before the sweep overwrites it (write_row_dlogits caps it from that register value).
    base = logits_ptr + b * stride_b + t * stride_t
    z_target = tl.load(base + target, mask=active & (target >= 0) & (target < V), other=0.0).to(tl.float32)
    # Why the barrier: in place, the sweep's stores (any warp's) may overwrite the target's logit; every thread's
    # read of it must be performed before any thread stores (bar.sync orders memory across the block like a
    # membar.cta). Once per row, outside the sweep loops.
    tl.debug_barrier()
    write_row_dlogits(base, dlogits_ptr + b * out_stride_b + t * out_stride_t, V, active, target, z_target,
                      tl.load(lse_ptr + row), h, g, g_h, inv_temperature, softcap, SOFTCAP, HAS_ENTROPY_GRAD,
                      BLOCK_V, VEC)


def logits_logprobs_forward(logits: torch.Tensor, ids: torch.Tensor, temperature: float,
                            softcap: float | None = None, block_v: int | None = None,
                            row_mask: torch.Tensor | None = None, round_logits: str | None = None):
    """logits (B, T, V) or (N, V) fp32/bf16/fp16, ids like logits[..., 0] -> (logp, lse, entropy), fp32 (N,).

    lse is the logsumexp of ``z = logits / temperature``, or of ``z = softcap * tanh(logits / softcap) /
    temperature`` with ``softcap``, of the logits rounded to ``round_logits`` first when given (bf16 / fp16); the
    caller has validated ids and shapes. Rows where ``row_mask`` (shaped like ids) is 0 are skipped and get 0 in all
    three outputs.
    """
    x = as_btv(logits)
    B, T, V = x.shape
    N = B * T
    ids_flat = ids.reshape(N).contiguous()  # a strided view (ids[:, ::2]) must not be read with unit stride
    logp, lse, entropy = (alloc((N,), torch.float32, x.device) for _ in range(3))
    if N:
        cfg = tiles("forward", x, block_v)
        mask = None if row_mask is None else (row_mask.reshape(N) != 0).to(torch.int8)
        launch(logits_logprobs_fwd, (N,), x, ids_flat, mask if mask is not None else ids_flat, logp, lse, entropy,
               T, V, x.stride(0), x.stride(1), 1.0 / temperature, **cap_args(softcap, round_logits),
               HAS_MASK=mask is not None,
               BLOCK_V=cfg.block_v, VEC=vec_for(cfg.block_v, x.dtype),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return logp, lse, entropy


def logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, temperature: float,
                             softcap: float | None = None, inplace: bool = False,
                             block_v: int | None = None, round_logits: str | None = None) -> torch.Tensor:
    """d loss / d logits from per-token grads of logp and entropy (fp32 (N,); grad_entropy may be None), with
    ``softcap`` the same as the forward's (lse / entropy are then the capped row's; the cap's derivative is applied)
    and ``round_logits`` too (the rounding passes the gradient through: straight-through).

    Returns a tensor shaped like ``logits`` in its dtype: a new buffer, or ``logits`` itself when ``inplace`` (any
    non-overlapping view: ``dlogits_result``).
    """
    x = as_btv(logits)
    B, T, V = x.shape
    N = B * T
    out = x if inplace else alloc((B, T, V), x.dtype, x.device)
    if N:
        cfg = tiles("backward", x, block_v)
        has_h = grad_entropy is not None
        launch(logits_logprobs_bwd, (N,), x, ids.reshape(N).contiguous(), lse, entropy, grad_logp.contiguous(),
               grad_entropy.contiguous() if has_h else grad_logp, out,
               T, V, x.stride(0), x.stride(1), out.stride(0), out.stride(1), 1.0 / temperature,
               **cap_args(softcap, round_logits), HAS_ENTROPY_GRAD=has_h, BLOCK_V=cfg.block_v,
               VEC=vec_for(cfg.block_v, x.dtype),
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dlogits_result(logits, x, out, inplace)


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: each calls the launchers above on small CPU tensors of the
    GPU shape class (V = 151936, a multiple of 16 like real vocabularies) so that the recorded launches carry
    the argument types and constexprs of a real launch."""
    scenarios = []
    for dtype, ty in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        def inputs(dtype=dtype):
            logits = torch.zeros(2, 3, 151936, dtype=dtype)
            return logits, torch.zeros(2, 3, dtype=torch.long), torch.zeros(6), torch.zeros(6)

        def forward(masked, inputs=inputs):
            logits, ids, _, _ = inputs()
            logits_logprobs_forward(logits, ids, 1.0, row_mask=torch.ones(2, 3, dtype=torch.bool) if masked else None)

        def backward(entropy_grad, inputs=inputs):
            logits, ids, lse, grad = inputs()
            logits_logprobs_backward(logits, ids, lse, lse, grad, grad if entropy_grad else None, 1.0)

        for masked in (False, True):
            scenarios.append((f"logits_fwd_{ty}{'_masked' if masked else ''}", lambda f=forward, m=masked: f(m)))
        for entropy_grad in (False, True):
            scenarios.append((f"logits_bwd_{ty}_{'entropy' if entropy_grad else 'logp'}",
                              lambda f=backward, e=entropy_grad: f(e)))

    # The V % 16 != 0 variant, on a view of a padded buffer (aligned rows): a vectorized main loop, a scalar tail.
    def odd_vocab(backward):
        logits = torch.zeros(2, 3, 151936, dtype=torch.bfloat16)[..., :151930]
        ids, lse = torch.zeros(2, 3, dtype=torch.long), torch.zeros(6)
        if backward:
            logits_logprobs_backward(logits, ids, lse, lse, lse, None, 1.0)
        else:
            logits_logprobs_forward(logits, ids, 1.0)
    scenarios += [("logits_fwd_bf16_vodd", lambda: odd_vocab(False)), ("logits_bwd_bf16_logp_vodd",
                                                                      lambda: odd_vocab(True))]

    # The soft cap on, every dtype (suffix _softcap: reported with its own cost, not held to the budget of the sweeps
    # without it).
    def capped(kind, dtype):
        logits = torch.zeros(2, 3, 151936, dtype=dtype)
        ids, lse = torch.zeros(2, 3, dtype=torch.long), torch.zeros(6)
        if kind == "fwd":
            logits_logprobs_forward(logits, ids, 1.0, softcap=30.0)
        else:
            logits_logprobs_backward(logits, ids, lse, lse, lse, lse if kind == "entropy" else None, 1.0,
                                     softcap=30.0)
    scenarios += [(f"logits_{name.format(ty)}_softcap", lambda k=kind, d=dtype: capped(k, d))
                  for dtype, ty in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"))
                  for name, kind in (("fwd_{}", "fwd"), ("bwd_{}_logp", "logp"), ("bwd_{}_entropy", "entropy"))]
    return scenarios
