"""Fused linear head in Triton: hidden states and the lm_head weight in, per-token log-prob, logsumexp and entropy
out, and their gradients, without ever writing the N x V logits (or their gradient) to memory in full.

Launchers (signatures of docs/API_SPEC.md; the lead's API layer validates user input, these only assert their own
contract): ``linear_logprobs_forward`` and ``linear_logprobs_backward``. The kernels are in
``linear_kernels_jit.py``, imported on the first launch.

Shapes: hidden (N, H), weight (V, H), bias (V,) or None, all of one dtype (fp32, bf16 or fp16), unit stride on H;
ids (N,) int64 in [0, V); logits = hidden @ weight.T + bias, z = logits / temperature. fp32 accumulation always.

Forward (2 launches). Grid: n_m_blocks x n_splits programs, split fastest. A program keeps a
(BLOCK_M, BLOCK_V) logit tile on chip (tl.dot over H in BLOCK_K chunks) and folds it into per-token online
statistics (max m, sum e^(z-m), sum e^(z-m) (z-m), target z) over its vocab split; it writes them as fp32 partials
(4, n_splits, N). n_splits is chosen so the grid is about two waves of the GPU (N / BLOCK_M = 32 programs at
N = 4k would leave 100 of 132 SMs idle). A tiny merge kernel combines the splits in a fixed order: deterministic.

Backward, ``deterministic=False`` (default): CCE-style grid n_m_blocks x n_v_blocks (GROUP_M swizzle, so that
concurrent programs share hidden and W blocks in L2); each program recomputes its
logit tile, forms d logits in registers, then for each H chunk adds dl @ W[vblock] into dh and dl^T @ h[mblock]
into dW with relaxed fp32 atomics (dbias: column sums of dl). dh, dW and dbias are each compiled in only when
requested (NEED_* constexprs): a frozen / LoRA head pays for neither the dW dot nor its atomics. Results vary in
the last bits from run to run (the float add order varies).

Backward, ``deterministic=True``: no float atomics anywhere. The vocab is cut into chunks of Vc columns; per
chunk a kernel writes d logits (N, Vc) in the input dtype (every program owns its output tile), then fixed-order
cuBLAS/torch ops finish the job: dW[chunk] = dl^T @ hidden (complete, written once), dbias[chunk] = column sum,
dh += dl @ W[chunk] (accumulated over chunks in fp32 for bf16/fp16). Vc is the largest multiple of BLOCK_V with
N * Vc * itemsize <= ``DETERMINISTIC_CHUNK_BYTES`` (256 MiB; at least BLOCK_V columns). cuBLAS is run-to-run
deterministic on a given GPU and library version (set CUBLAS_WORKSPACE_CONFIG=:4096:8 when streams vary). With fp32
inputs the matmuls follow torch's fp32 matmul precision setting ("highest" by default, i.e. no TF32).

Extra device memory beyond inputs, outputs and the returned gradients (it = itemsize of the input dtype):
- forward: 16 * n_splits * N bytes of partials (n_splits <= ~2 * SMs / (N / BLOCK_M); kilobytes to a few MB).
- backward, atomic: fp32 accumulators that are then cast to the input dtype, only for bf16/fp16 inputs
  (for fp32 inputs they are the outputs): 4 N H if dh is requested, 4 V H if dW, 4 V if dbias. For bf16 weights
  the dW accumulator is twice the weight's size (2.5 GB at V = 152k, H = 4096).
- backward, deterministic: the d logits chunk, N * min(V, Vc) * it bytes, i.e. about
  min(N V it, max(DETERMINISTIC_CHUNK_BYTES, N BLOCK_V it)); plus 4 V (fp32 dbias) when dbias is requested with
  bf16/fp16; plus (4 + it) N H (fp32 dh accumulator and one matmul output) when dh is requested with bf16/fp16
  and V needs more than one chunk.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from .._checks import alloc
from .._triton import interpreting

# d logits chunk of the deterministic backward (bytes); tests shrink it to exercise several chunks.
DETERMINISTIC_CHUNK_BYTES = 256 << 20
MERGE_BLOCK_N = 256
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


# (arch, kernel kind, dtype class) -> Tile. "half" = bf16/fp16 (tensor-core dots, wgmma on sm_90 needs
# BLOCK_M >= 64 and 4 or 8 warps); "fp32" = IEEE fp32 FMA dots (no TF32), smaller tiles. The AOT test checks
# that none of them spills on sm_90 / sm_80 and that bf16 lowers to HGMMA on sm_90.
TILES = {
    (90, "fwd", "half"): Tile(128, 128, 64, 8, 3),
    (90, "bwd", "half"): Tile(128, 128, 64, 8, 3),
    (90, "dlogits", "half"): Tile(128, 64, 64, 8, 3),
    (80, "fwd", "half"): Tile(128, 128, 32, 8, 3),
    (80, "bwd", "half"): Tile(128, 128, 32, 8, 2),
    (80, "dlogits", "half"): Tile(128, 128, 32, 8, 3),
    **{(arch, kind, "fp32"): Tile(64, 64, 16, 4, 2) for arch in (90, 80) for kind in ("fwd", "dlogits")},
    **{(arch, "bwd", "fp32"): Tile(32, 32, 32, 4, 2) for arch in (90, 80)},
}
# Token blocks per group of the (token block, vocab block) swizzle of the backward kernels.
GROUP_M = 8
# CPU interpreter: small blocks, so that small awkward test shapes cross every block boundary.
INTERPRET_TILE = Tile(16, 32, 16, 4, 1)

_TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _jit():
    """The kernel module, imported on first use so TRITON_INTERPRET is read then (DESIGN.md section 4)."""
    return importlib.import_module(".linear_kernels_jit", __package__)


@functools.lru_cache(maxsize=None)
def _arch_and_sms(device: torch.device) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    # Why 80 for everything but sm_90/sm_100: the sm_90 tiles need up to 161 KiB of shared memory per block,
    # sm_86/89/120 offer about 100 KiB. (sm_100 reuses the sm_90 tiles; only sm_90/sm_80 are AOT-checked.)
    return (90 if props.major in (9, 10) else 80), props.multi_processor_count


def _launch_params(kind: str, dtype: torch.dtype, device: torch.device) -> tuple[Tile, int, bool]:
    """(tile, number of SMs, DOT_FP32) for a launch on ``device``."""
    if device.type != "cuda":
        assert interpreting(), "CPU tensors need TRITON_INTERPRET=1 (the API layer chooses the implementation)"
        # Why DOT_FP32 for bf16 here: the interpreter's bf16 tl.dot returns garbage (DESIGN.md section 4).
        return INTERPRET_TILE, INTERPRET_SMS, dtype in (torch.float32, torch.bfloat16)
    arch, sms = _arch_and_sms(device)
    return TILES[(arch, kind, "fp32" if dtype == torch.float32 else "half")], sms, dtype == torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_inputs(hidden, weight, bias, ids) -> tuple[int, int, int]:
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1], "hidden (N,H), weight (V,H)"
    assert hidden.dtype == weight.dtype and hidden.dtype in _TRITON_DTYPES, "hidden/weight: one of fp32/bf16/fp16"
    assert hidden.stride(1) == 1 and weight.stride(1) == 1, "hidden/weight need a unit stride on H"
    assert ids.shape == hidden.shape[:1] and ids.dtype == torch.int64 and ids.is_contiguous(), "ids (N,) int64"
    assert bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()), "bias (V,) contiguous"
    return hidden.shape[0], weight.shape[0], hidden.shape[1]


def _vec(t, n: int) -> torch.Tensor:
    """A per-token fp32 (N,) tensor, made contiguous (autograd hands out expanded, stride-0 gradients)."""
    assert t.shape == (n,) and t.dtype == torch.float32, "per-token tensors: fp32 (N,)"
    return t.contiguous()


def linear_logprobs_forward(hidden: torch.Tensor, weight: torch.Tensor, bias, ids: torch.Tensor,
                            temperature: float):
    """(logp, lse, entropy), each fp32 (N,), of z = (hidden @ weight.T + bias) / temperature at ``ids``.

    hidden (N, H) and weight (V, H) of one dtype (fp32/bf16/fp16), bias (V,) or None, ids (N,) int64 in [0, V).
    lse = logsumexp(z); entropy = lse - sum softmax(z) * z. Extra memory: 16 * n_splits * N bytes.
    """
    N, V, H = _check_inputs(hidden, weight, bias, ids)
    dev = hidden.device
    logp, lse, ent = (alloc((N,), torch.float32, dev) for _ in range(3))
    if N == 0:
        return logp, lse, ent
    k = _jit()
    tile, sms, dot_fp32 = _launch_params("fwd", hidden.dtype, dev)
    n_m = _cdiv(N, tile.block_m)
    n_vb = _cdiv(V, tile.block_v)
    # Why: enough (token block, vocab split) programs for ~WAVES waves, each split at least one vocab block.
    v_per_split = _cdiv(n_vb, min(n_vb, max(1, _cdiv(WAVES * sms, n_m)))) * tile.block_v
    n_splits = _cdiv(V, v_per_split)
    part = alloc((4, n_splits, N), torch.float32, dev)
    k.linear_fwd_partial_kernel[(n_m * n_splits,)](
        hidden, weight, weight if bias is None else bias, ids, part,
        N, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, n_m, n_splits, v_per_split,
        HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_V=tile.block_v, BLOCK_K=tile.block_k,
        DOT_FP32=dot_fp32, num_warps=tile.num_warps, num_stages=tile.num_stages)
    k.linear_fwd_merge_kernel[(_cdiv(N, MERGE_BLOCK_N),)](part, logp, lse, ent, N, n_splits,
                                                          BLOCK_N=MERGE_BLOCK_N, num_warps=4)
    return logp, lse, ent


def linear_logprobs_backward(hidden, weight, bias, ids, lse, entropy, grad_logp, grad_entropy, temperature: float,
                             need_hidden: bool, need_weight: bool, need_bias: bool, deterministic: bool):
    """(d_hidden | None, d_weight | None, d_bias | None) in hidden's / weight's / bias' dtype.

    Inputs as in ``linear_logprobs_forward`` plus the forward's lse and entropy and the per-token grads grad_logp
    and grad_entropy (fp32 (N,); grad_entropy may be None: its term is then not compiled in). Per element
    dz_v = grad_logp (onehot_v - p_v) - grad_entropy p_v (log p_v + entropy), d logits = dz / temperature.
    ``deterministic`` selects the atomic-free path (see the module docstring for both paths and their memory).
    """
    N, V, H = _check_inputs(hidden, weight, bias, ids)
    need_bias = bool(need_bias) and bias is not None
    dev = hidden.device
    f32 = torch.float32
    lse, grad_logp = _vec(lse, N), _vec(grad_logp, N)
    has_ent = grad_entropy is not None
    if has_ent:
        grad_entropy, entropy = _vec(grad_entropy, N), _vec(entropy, N)
    if N == 0 or not (need_hidden or need_weight or need_bias):
        return (torch.zeros_like(hidden) if need_hidden else None, torch.zeros_like(weight) if need_weight else None,
                torch.zeros_like(bias) if need_bias else None)
    common = dict(hidden=hidden, weight=weight, bias=bias, ids=ids, lse=lse, entropy=entropy if has_ent else lse,
                  grad_logp=grad_logp, grad_entropy=grad_entropy if has_ent else grad_logp,
                  inv_temp=1.0 / temperature, has_ent=has_ent)
    if deterministic:
        return _backward_chunked(common, N, V, H, need_hidden, need_weight, need_bias)
    tile, _, dot_fp32 = _launch_params("bwd", hidden.dtype, dev)
    dh = torch.zeros((N, H), dtype=f32, device=dev) if need_hidden else None
    dw = torch.zeros((V, H), dtype=f32, device=dev) if need_weight else None
    db = torch.zeros((V,), dtype=f32, device=dev) if need_bias else None
    n_m, n_v = _cdiv(N, tile.block_m), _cdiv(V, tile.block_v)
    _jit().linear_bwd_atomic_kernel[(n_m * n_v,)](
        hidden, weight, weight if bias is None else bias, ids, common["lse"], common["entropy"], grad_logp,
        common["grad_entropy"], lse if dh is None else dh, lse if dw is None else dw, lse if db is None else db,
        N, V, H, hidden.stride(0), weight.stride(0), common["inv_temp"], n_m, n_v,
        HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=has_ent, NEED_H=need_hidden, NEED_W=need_weight,
        NEED_B=need_bias, BLOCK_M=tile.block_m, BLOCK_V=tile.block_v, BLOCK_K=tile.block_k, GROUP_M=GROUP_M,
        DOT_FP32=dot_fp32,
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))


def _backward_chunked(c: dict, N: int, V: int, H: int, need_hidden: bool, need_weight: bool, need_bias: bool):
    """Deterministic backward: d logits per vocab chunk from a kernel, then fixed-order matmuls and sums."""
    hidden, weight, bias = c["hidden"], c["weight"], c["bias"]
    dtype, dev = hidden.dtype, hidden.device
    tile, _, dot_fp32 = _launch_params("dlogits", dtype, dev)
    bv = tile.block_v
    chunk = max(bv, DETERMINISTIC_CHUNK_BYTES // (N * hidden.element_size()) // bv * bv)
    chunk = min(chunk, _cdiv(V, bv) * bv)
    n_chunks = _cdiv(V, chunk)
    buf = alloc((N, min(chunk, V)), dtype, dev)
    direct_dh = n_chunks == 1 or dtype == torch.float32
    d_hidden = d_weight = db32 = dh32 = tmp = None
    if need_hidden:
        if n_chunks == 1:
            d_hidden = alloc((N, H), dtype, dev)
        elif dtype == torch.float32:
            d_hidden = torch.zeros((N, H), dtype=dtype, device=dev)
        else:
            dh32, tmp = torch.zeros((N, H), dtype=torch.float32, device=dev), alloc((N, H), dtype, dev)
    if need_weight:
        d_weight = alloc(tuple(weight.shape), weight.dtype, dev)
    if need_bias:
        db32 = alloc((V,), torch.float32, dev)
    n_m = _cdiv(N, tile.block_m)
    kernel = _jit().linear_dlogits_kernel
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        dl = buf[:, : v1 - v0]
        n_v = _cdiv(v1 - v0, bv)
        kernel[(n_m * n_v,)](
            hidden, weight, weight if bias is None else bias, c["ids"], c["lse"], c["entropy"], c["grad_logp"],
            c["grad_entropy"], buf, N, V, H, hidden.stride(0), weight.stride(0), buf.stride(0), c["inv_temp"],
            n_m, n_v, v0, v1, HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=c["has_ent"], BLOCK_M=tile.block_m,
            BLOCK_V=bv, BLOCK_K=tile.block_k, GROUP_M=GROUP_M, DOT_FP32=dot_fp32, num_warps=tile.num_warps,
            num_stages=tile.num_stages)
        # Why these three ops are deterministic: each is a fixed-shape cuBLAS GEMM or a torch reduction, and
        # every output element is produced by exactly one of them per chunk (no cross-program float atomics).
        if need_weight:
            torch.mm(dl.t(), hidden, out=d_weight[v0:v1])
        if need_bias:
            torch.sum(dl, dim=0, dtype=torch.float32, out=db32[v0:v1])
        if need_hidden:
            w_chunk = weight[v0:v1]
            if n_chunks == 1:
                torch.mm(dl, w_chunk, out=d_hidden)
            elif direct_dh:
                d_hidden.addmm_(dl, w_chunk)
            else:
                torch.mm(dl, w_chunk, out=tmp)
                dh32.add_(tmp)
    if dh32 is not None:
        d_hidden = dh32.to(dtype)
    return d_hidden, d_weight, None if db32 is None else db32.to(bias.dtype)


def aot_configs(arch: int = 90):
    """(name, kernel, signature, constexprs) for every kernel config launched on a GPU of ``arch`` (90 or 80).

    signature maps each argument to its Triton type; ``:16`` marks a value the JIT would specialize as divisible
    by 16 (pointers are always taken as 16-byte aligned by ``grpo_kernels.kernels.aot``). constexprs also carries
    the launch options ``num_warps`` / ``num_stages`` (names Triton reserves, so they cannot clash).
    """
    k = _jit()
    configs = []
    for dtype, ty in _TRITON_DTYPES.items():
        cls = "fp32" if dtype == torch.float32 else "half"
        dot_fp32 = dtype == torch.float32
        head = {"h_ptr": f"*{ty}", "w_ptr": f"*{ty}", "b_ptr": f"*{ty}", "ids_ptr": "*i64"}
        shape = {"N": "i32", "V": "i32", "H": "i32:16", "stride_h": "i32:16", "stride_w": "i32:16"}
        grads = {"lse_ptr": "*fp32", "ent_ptr": "*fp32", "gl_ptr": "*fp32", "ge_ptr": "*fp32"}

        def blocks(kind):
            t = TILES[(arch, kind, cls)]
            group = {} if kind == "fwd" else {"GROUP_M": GROUP_M}
            return {"BLOCK_M": t.block_m, "BLOCK_V": t.block_v, "BLOCK_K": t.block_k, **group, "DOT_FP32": dot_fp32,
                    "num_warps": t.num_warps, "num_stages": t.num_stages}

        for has_bias in (False, True):
            b = "bias" if has_bias else "nobias"
            configs.append((f"linear_fwd_partial_{ty}_{b}", k.linear_fwd_partial_kernel,
                            {**head, "part_ptr": "*fp32", **shape, "inv_temp": "fp32", "n_m_blocks": "i32",
                             "n_splits": "i32", "v_per_split": "i32"},
                            {"HAS_BIAS": has_bias, **blocks("fwd")}))
            for has_ent in (False, True):
                e = "ent" if has_ent else "noent"
                configs.append((f"linear_dlogits_{ty}_{b}_{e}", k.linear_dlogits_kernel,
                                {**head, **grads, "dl_ptr": f"*{ty}", **shape, "stride_dl": "i32",
                                 "inv_temp": "fp32", "n_m_blocks": "i32", "n_v_blocks": "i32", "v_begin": "i32",
                                 "v_end": "i32"},
                                {"HAS_BIAS": has_bias, "HAS_ENTROPY_GRAD": has_ent, **blocks("dlogits")}))
                for need in _need_combos(has_bias):
                    configs.append((f"linear_bwd_atomic_{ty}_{b}_{e}_{''.join(n for n, f in zip('hwb', need) if f)}",
                                    k.linear_bwd_atomic_kernel,
                                    {**head, **grads, "dh_ptr": "*fp32", "dw_ptr": "*fp32", "db_ptr": "*fp32",
                                     **shape, "inv_temp": "fp32", "n_m_blocks": "i32", "n_v_blocks": "i32"},
                                    {"HAS_BIAS": has_bias, "HAS_ENTROPY_GRAD": has_ent, "NEED_H": need[0],
                                     "NEED_W": need[1], "NEED_B": need[2], **blocks("bwd")}))
    configs.append(("linear_fwd_merge", k.linear_fwd_merge_kernel,
                    {"part_ptr": "*fp32", "logp_ptr": "*fp32", "lse_ptr": "*fp32", "ent_ptr": "*fp32", "N": "i32",
                     "n_splits": "i32"},
                    {"BLOCK_N": MERGE_BLOCK_N, "num_warps": 4, "num_stages": 1}))
    return configs


def _need_combos(has_bias: bool):
    """(NEED_H, NEED_W, NEED_B) combinations the atomic backward is launched with (at least one set)."""
    bias_opts = (False, True) if has_bias else (False,)
    return [(h, w, b) for h in (False, True) for w in (False, True) for b in bias_opts if h or w or b]
