"""Shared pieces of the fused linear head's Triton kernels: the tile table, launch parameters per GPU generation,
and the @triton.jit helpers both the forward (``linear_forward_kernels.py``) and the backward
(``linear_backward_kernels.py``) use: the on-chip logit tile, the d-logits tile, the tile swizzle.

Imported lazily (by the kernel modules, which the autograd layer imports on the first launch), so TRITON_INTERPRET
set any time before then takes effect (docs/DESIGN.md section 5). Kernels live at module level: Triton's
interpreter re-executes a kernel's source against its module globals only.

Notation: hidden h (N, H), weight W (V, H), optional bias b (V,), logits = h W^T + b,
z = soft_cap(logits) * inv_temperature (``common.soft_cap``; the identity unless SOFTCAP). Pointers to
hidden/weight/bias share one dtype (fp32, bf16 or fp16); every statistic and accumulator is fp32. N, V, H, strides,
inv_temperature and softcap are runtime arguments (a new length, temperature or cap does not recompile); only block
sizes and HAS_* / NEED_* / SOFTCAP / DOT_FP32 flags are constexpr. Row/column offsets are
int64 (N*V and V*H exceed 2^31).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._precision import fp32_matmuls_use_tf32
from .._triton import import_triton, interpreting
from .._testing import knobs
from .common import soft_cap, soft_cap_grad
from .host import TRITON_DTYPES, generation, num_sms
from .launch import as_cuda

triton, tl = import_triton()

# Programs per SM the vocab split aims at (about two waves of one-CTA-per-SM programs).
WAVES = 2
# Pretend SM count under TRITON_INTERPRET, small so that CPU tests see several vocab splits.
INTERPRET_SMS = 4


@dataclass(frozen=True)
class Tile:
    """Block sizes and launch options of one kernel (block sizes are the only shape constexprs)."""

    block_m: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int


# (arch, kernel kind, dot class) -> Tile. "half" = bf16/fp16 (tensor-core dots, wgmma on sm_90 needs
# BLOCK_M >= 64 and 4 or 8 warps); "fp32" = IEEE fp32 FMA dots (no TF32), smaller tiles; "tf32" = fp32 inputs while
# torch's fp32 matmuls use TF32 (tensor-core dots): the fp32 tiles, except the atomic backward's. Why 64 x 64 x 32 on
# 8 warps there: the fp32 tile (32 x 32 x 32, 4 warps) spilled 8 B under TF32 with Triton 3.9 on sm_90 (80
# registers), and at BLOCK_K 16 it would stay a 32 x 32 tensor-core tile with twice the atomics per FLOP of a
# 64 x 64 one; 64 x 64 x 32 on 8 warps takes 100-124 registers on both Triton versions, no spill, HGMMA on sm_90
# (not measured on a GPU yet). "fwd_extras": the forward with extra statistics (``config.TokenExtras``); why half
# the vocab tile for half precision: the 128 x 128 tile takes 252 of 255 registers already, and the extras' per-row
# sums and the is_top1 column mask spilled it (4-8 B on sm_90, 120 B on sm_80 with all three, Triton 3.9). The AOT
# test checks that none of them spills on sm_90 / sm_80 with Triton 3.6 and 3.9, that bf16 lowers to HGMMA on sm_90,
# IEEE fp32 to no tensor-core MMA and TF32 to HGMMA / HMMA.
TILES = {
    (90, "fwd", "half"): Tile(128, 128, 64, 8, 3),
    (90, "bwd", "half"): Tile(128, 128, 64, 8, 3),
    (90, "dlogits", "half"): Tile(128, 64, 64, 8, 3),
    (80, "fwd", "half"): Tile(128, 128, 32, 8, 3),
    (90, "fwd_extras", "half"): Tile(128, 64, 64, 8, 3),
    (80, "fwd_extras", "half"): Tile(128, 64, 32, 8, 3),
    (80, "bwd", "half"): Tile(128, 128, 32, 8, 2),
    (80, "dlogits", "half"): Tile(128, 128, 32, 8, 3),
    **{(arch, kind, cls): Tile(64, 64, 16, 4, 2) for arch in (90, 80) for kind in ("fwd", "fwd_extras", "dlogits")
       for cls in ("fp32", "tf32")},
    **{(arch, "bwd", "fp32"): Tile(32, 32, 32, 4, 2) for arch in (90, 80)},
    **{(arch, "bwd", "tf32"): Tile(64, 64, 32, 8, 2) for arch in (90, 80)},
}
# Token blocks per group of the (token block, vocab block) swizzle of the backward kernels.
GROUP_M = 8
# CPU interpreter: small blocks, so that small awkward test shapes cross every block boundary.
INTERPRET_TILE = Tile(16, 32, 16, 4, 1)



# DOT_FP32 values: how the kernels' tl.dot multiplies (see mma).
DOT_NATIVE, DOT_IEEE, DOT_TF32, DOT_BY_ELEMENTS = 0, 1, 2, 3


def launch_params(kind: str, dtype: torch.dtype, device: torch.device) -> tuple[Tile, int, int]:
    """(tile, number of SMs, DOT_FP32) for a launch on ``device`` (or for ``target_arch()`` while recording).
    The tile table's key is the GPU generation's (``common.GENERATIONS``) and the dot class: "half" (bf16 / fp16),
    "fp32" (IEEE fp32 dots) or "tf32" (fp32 inputs while torch's fp32 matmuls use TF32)."""
    if not as_cuda(device):
        assert interpreting(), "CPU tensors need TRITON_INTERPRET=1 (the API layer chooses the implementation)"
        # Why products summed in k order here (mma): the interpreter's tl.dot is numpy's BLAS, whose result for a
        # row depends on the row's place in the tile (a compiled MMA's does not: batch invariance holds on the GPU
        # and must be seen in the tests), and whose bf16 dot returns garbage (docs/DESIGN.md section 6).
        return (knobs().interpret_tile or INTERPRET_TILE, knobs().interpret_sms or INTERPRET_SMS, DOT_BY_ELEMENTS)
    # A CUDA launch, or one recorded as a CUDA run would make it (launch.as_cuda): fp32 follows torch's fp32 matmul
    # precision (TF32 or IEEE), and the tiles are per dot class ("tf32" has its own: tensor-core dots).
    if dtype != torch.float32:
        dot, cls = DOT_NATIVE, "half"
    elif fp32_matmuls_use_tf32():
        dot, cls = DOT_TF32, "tf32"
    else:
        dot, cls = DOT_IEEE, "fp32"
    return TILES[(generation(device).tiles, kind, cls)], num_sms(device), dot


# The value of padded tile columns and the fused-linear forward's empty running max: finite, so that a padded
# column's weight 2^((-1e30 - m) c) is exactly 0 and its entropy product 0 * finite stays 0 (the merge kernel's
# rescaling likewise never meets inf - inf).
NEG_BIG = tl.constexpr(-1e30)


@triton.jit
def mma(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    DOT_FP32: 0 (DOT_NATIVE) multiplies the tiles as they are: compiled bf16/fp16 dots lower to HGMMA/HMMA.
    1 (DOT_IEEE) upcasts both tiles to fp32 and multiplies in IEEE fp32: fp32 inputs under torch's default
    precision. 2 (DOT_TF32): fp32 inputs while torch's fp32 matmuls use TF32 (grpo_kernels/_precision.py: one rule
    for Triton and cuBLAS). 3 (DOT_BY_ELEMENTS, TRITON_INTERPRET only): the products summed over k in fp64 and rounded to
    fp32 once, the same for every row of the tile as a compiled MMA is (numpy's matmul is not).
    """
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if DOT_FP32 == 3:
        # Why in fp64, rounded once: a k-order fp32 sum would be less accurate than the MMA it stands for (and a
        # near-zero gradient element's sign, which Adam's first step turns into a whole step, would follow it)
        acc += tl.sum(a.to(tl.float64)[:, :, None] * b.to(tl.float64)[None, :, :], axis=1).to(tl.float32)
    elif DOT_FP32 == 2:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def to_input_dtype(x, dtype: tl.constexpr, DOT_FP32: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even into ``dtype`` (the hidden/weight dtype).

    Why by hand for bf16 under DOT_FP32: that pair occurs only under TRITON_INTERPRET, whose fp32 -> bf16 cast
    truncates (and whose "rtne" mode drops the carry into the exponent); compiled code casts with cvt.rn.
    """
    if DOT_FP32 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def logits_tile(h_ptr, w_ptr, b_ptr, rows_c, cols_c, H, stride_h, stride_w, inv_temperature, softcap,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """z tile (BLOCK_M, BLOCK_V) fp32 = soft_cap(h[rows_c] @ W[cols_c]^T + b[cols_c]) * inv_temperature (the cap
    only when SOFTCAP).

    rows_c / cols_c are already clamped into [0, N) / [0, V): out-of-range lanes recompute a valid row or column
    (discarded by the caller) instead of carrying a mask on every load, so only the H tail is masked.
    """
    # Why int64 row offsets: V * H and N * H exceed 2^31 at real sizes (V = 262144, H = 8192).
    h_rows = h_ptr + rows_c.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols_c.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    # Why a K loop inside each vocab tile: the (BLOCK_M, BLOCK_V) logit tile lives only in registers; N x V logits
    # are never written to memory.
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < H)[None, :]
        h = tl.load(h_rows + ks[None, :], mask=k_ok, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=k_ok, other=0.0)
        acc = mma(h, tl.trans(w), acc, DOT_FP32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
    # Why no mask after the cap: every lane holds a valid (clamped) row and column; the callers mask by position.
    return soft_cap(acc, softcap, SOFTCAP) * inv_temperature


@triton.jit
def grouped_tile(pid, n_m_blocks, n_v_blocks, GROUP_M: tl.constexpr):
    """(token block, vocab block) of program ``pid``, GROUP_M token blocks at a time (matmul-style swizzle).

    Why: programs running together then form a roughly square patch of tiles and share both their hidden
    blocks and their W blocks through L2, instead of streaming all of W (or all of hidden) per wave.
    """
    per_group = GROUP_M * n_v_blocks
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def dlogits_tile(z, rows_c, cols, row_ok, col_ok, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, inv_temperature,
                  softcap, HAS_ENTROPY_GRAD: tl.constexpr, SOFTCAP: tl.constexpr):
    """d loss / d logits tile (fp32) from the z tile of ``logits_tile``: (g (onehot - p) - g_H p (log p + H)) *
    inv_temperature, times the soft cap's derivative 1 - (y / softcap)^2 when SOFTCAP (y = z * temperature, the
    capped logit), so the result is the gradient with respect to the raw logits.

    Zero outside the valid rows and columns, so padded lanes add nothing to dW, dbias or dh.
    """
    lse = tl.load(lse_ptr + rows_c)
    g = tl.load(gl_ptr + rows_c)
    target = tl.load(ids_ptr + rows_c)
    # Why recompute p from the saved lse: the softmax is never stored; one exp per element.
    logp = z - lse[:, None]
    p = tl.exp(logp)
    dz = tl.where(cols[None, :] == target[:, None], g[:, None], 0.0) - g[:, None] * p
    if HAS_ENTROPY_GRAD:
        # Why a constexpr: without an entropy bonus this term (two loads, three FLOPs per element) is not compiled.
        g_h = tl.load(ge_ptr + rows_c)
        ent = tl.load(ent_ptr + rows_c)
        dz -= g_h[:, None] * p * tl.where(p > 0.0, logp + ent[:, None], 0.0)
    # Why the cap's derivative from z with softcap * inv_temperature: z / (softcap / temperature) = y / softcap, so
    # the capped logit itself is never formed (no extra instruction per element).
    dz = soft_cap_grad(dz * inv_temperature, z, softcap * inv_temperature, SOFTCAP)
    return tl.where(row_ok[:, None] & col_ok[None, :], dz, 0.0)




def aot_inputs(dtype: torch.dtype, has_bias: bool, N: int = 256, V: int = 2048, H: int = 64):
    """Small CPU inputs of the GPU shape class (N, V, H multiples of 16, unit stride on H) for the ``aot_launches``
    scenarios of the linear kernel modules: the recorded launches get the types and specializations of a real
    launch at N = 8192, V = 151936, H = 4096 without allocating a real lm_head."""
    hidden, weight = torch.zeros(N, H, dtype=dtype), torch.zeros(V, H, dtype=dtype)
    bias = torch.zeros(V, dtype=dtype) if has_bias else None
    return hidden, weight, bias, torch.zeros(N, dtype=torch.long)
