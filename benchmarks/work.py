"""The work model: what each provider really computes, behind the report's throughput and "% of ceiling".

Every provider declares (``providers.py``, field ``work``) how it runs the lm_head and which rows it computes;
``work(...)`` turns that into the amount of one call:

- linear / logprob paths: **matmul FLOPs**, as a multiple of R * H * V (R = rows computed, one GEMM = 2RHV):

  | strategy | forward | backward | fwd+bwd | frozen head (no dW) fwd+bwd |
  |---|---|---|---|---|
  | ``materialize`` (eager, torch.compile: logits kept for the backward) | 2 | 4 | 6 | 4 |
  | ``recompute`` (ours, TRL chunked: backward recomputes the logits) | 2 | 6 | 8 | 6 |
  | ``grads-in-forward`` (Liger chunked: forward does logits, recompute, dH, dW) | 8 | 0 | 8 | 6 |
  | ``gemm-in-forward`` (ours on Triton: per chunk logits, then dH and dW from the same chunk) | 6 | 0 | 6 | 4 |

  and 2 for the no-grad log-probs (one GEMM) whatever the strategy.
- logits path: **bytes of B x T x V traffic**: forward (and the no-grad forward: log-probs + entropy under
  ``torch.no_grad()``, no gradient-in-forward kernel for anyone) reads each computed row once; backward reads each computed
  row once and writes d logits for every row (zeros at skipped rows). That is exactly what the one-sweep Triton
  kernels (Liger's, TRL's, ours with ``grad_in_forward=False``) do; for eager, torch.compile and our chunked CPU
  path, which make several passes, it is a lower bound (``exact=False``), so their rate and "% of ceiling" are
  lower bounds too. Ours with the gradient in the forward (the Triton default) reads each computed row, re-reads it
  (from L2 when the row is still there) and writes d logits, all in the forward; its backward moves no logits when
  the incoming gradient is 1: counted as one read + one write in the forward, a lower bound of its traffic.
- distill path (two heads: the student's (V, H_s), the teacher's (V, H_t)): **matmul FLOPs** as multiples of
  R V H_s and R V H_t (written k RHV when H_s = H_t); the teacher never gets a gradient:

  | strategy | forward | backward | fwd+bwd (H_s = H_t) |
  |---|---|---|---|
  | ``grads-in-forward`` (ours, Liger fused / chunked: both logits, the student's dH, dW) | 6 H_s + 2 H_t | 0 | 8 |
  | ``materialize`` (eager, torch.compile: both logits kept, autograd's dH and dW) | 2 H_s + 2 H_t | 4 H_s | 8 |
  | ``recompute`` (TRL's ChunkedDivergenceFunction: both heads again) | 2 H_s + 2 H_t | 6 H_s + 2 H_t | 12 |

  plus one more pass over both heads (2 H_s + 2 H_t) per extra forward pass a provider declares for the JSD
  (``distill_jsd_passes``: TRL's forward folds the log-sum-exps, then projects again for the mixture: 16 for the
  JSD), and 2 H_s + 2 H_t per pass for the no-grad divergence.
- rows computed R: all N, or only the valid (unpadded) rows for a provider that skips padding on that path.

With these amounts, a rate above 100% of a ceiling measured in the same run would mean the model or the ceiling is
wrong; the report flags such a row instead of hiding it.
"""
from __future__ import annotations

import dataclasses

STRATEGIES = ("materialize", "recompute", "grads-in-forward", "gemm-in-forward")

# multiples of R*H*V: (forward, backward) with the weight trainable, and the dW share of the backward
_LINEAR = {"materialize": (2, 4), "recompute": (2, 6), "grads-in-forward": (8, 0), "gemm-in-forward": (6, 0)}
_IN_FORWARD = ("grads-in-forward", "gemm-in-forward")
_DW = 2
# distill path: ((forward student, teacher), (backward student, teacher)) multiples of R V H_s, R V H_t
_DISTILL = {"grads-in-forward": ((6, 2), (0, 0)), "materialize": ((2, 2), (4, 0)), "recompute": ((2, 2), (6, 2))}


@dataclasses.dataclass(frozen=True)
class WorkDecl:
    """What a provider declares about its own work.

    linear: the strategy of its lm_head (None: it has no linear path);
    linear_triton: the strategy when it runs its Triton kernels, where that differs (None: ``linear``);
    logits_in_forward: "always" | "triton" | "never": whether its logits path writes d logits in the forward;
    skips_padded: path -> "always" | "triton": paths on which only valid rows are computed (with "triton", only
    when the provider runs its Triton kernels there, on CUDA or under the interpreter);
    exact_logits_traffic: "always" | "triton" | "never": whether the logits-path byte count is exact (one sweep
    forward, one backward) or a lower bound (several passes);
    distill: the strategy of its two-head distillation path (``_DISTILL``; None: it has none);
    distill_jsd_passes: forward passes over both heads for the generalized JSD (0 < beta < 1; the KLs take one);
    source: where this was read (the provider's own code), for the report.
    """

    linear: str | None = None
    skips_padded: dict = dataclasses.field(default_factory=dict)
    linear_triton: str | None = None
    logits_in_forward: str = "never"
    exact_logits_traffic: str = "always"
    source: str = ""
    distill: str | None = None
    distill_jsd_passes: int = 1

    def __post_init__(self):
        for strategy in (self.linear, self.linear_triton):
            if strategy is not None and strategy not in STRATEGIES:
                raise ValueError(f"linear must be one of {STRATEGIES}, got {strategy!r}")
        if self.distill is not None and self.distill not in _DISTILL:
            raise ValueError(f"distill must be one of {tuple(_DISTILL)}, got {self.distill!r}")
        if self.distill_jsd_passes not in (1, 2):
            raise ValueError(f"distill_jsd_passes must be 1 or 2, got {self.distill_jsd_passes!r}")
        for how in (*self.skips_padded.values(), self.exact_logits_traffic, self.logits_in_forward):
            if how not in ("always", "triton", "never"):
                raise ValueError(f"expected 'always', 'triton' or 'never', got {how!r}")


@dataclasses.dataclass(frozen=True)
class Work:
    amount: float  # FLOPs or bytes
    unit: str  # "FLOP" | "B"
    rows: int  # rows computed
    formula: str  # e.g. "8RHV", "2RV+NV bytes"
    exact: bool  # False: a lower bound


def _holds(how: str | None, triton: bool) -> bool:
    return how == "always" or (how == "triton" and triton)


def rows_computed(decl: WorkDecl, path: str, N: int, valid_rows: int, triton: bool) -> int:
    return valid_rows if _holds(decl.skips_padded.get(path), triton) else N


def matmul_multiple(decl: WorkDecl, mode: str, frozen: bool, triton: bool = False) -> int:
    """FLOPs of one call in units of R*H*V."""
    if mode == "nograd":
        return 2
    strategy = decl.linear_triton if triton and decl.linear_triton is not None else decl.linear
    if strategy is None:
        raise ValueError("this provider declares no linear strategy")
    fwd, bwd = _LINEAR[strategy]
    if frozen:
        if strategy in _IN_FORWARD:
            fwd -= _DW
        else:
            bwd -= _DW
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


def distill_multiples(decl: WorkDecl, mode: str, jsd: bool, frozen: bool = False) -> tuple[int, int]:
    """FLOPs of one distillation call in units of (R V H_student, R V H_teacher)."""
    if decl.distill is None:
        raise ValueError("this provider declares no distillation strategy")
    passes = decl.distill_jsd_passes if jsd else 1
    if mode == "nograd":
        return 2 * passes, 2 * passes
    (fs, ft), (bs, bt) = _DISTILL[decl.distill]
    fs, ft = fs + 2 * (passes - 1), ft + 2 * (passes - 1)
    if frozen:  # no dW: where the strategy makes it
        fs, bs = (fs - _DW, bs) if bs == 0 else (fs, bs - _DW)
    return {"fwd": (fs, ft), "bwd": (bs, bt), "fwdbwd": (fs + bs, ft + bt)}[mode]


def _distill_work(decl: WorkDecl, mode: str, R: int, H: int, H_teacher: int, V: int, jsd: bool,
                  frozen: bool) -> Work:
    ks, kt = distill_multiples(decl, mode, jsd, frozen)
    formula = f"{ks + kt}RHV" if H == H_teacher else f"{ks}RVHs+{kt}RVHt"
    return Work(float(ks * H + kt * H_teacher) * R * V, "FLOP", R, formula, True)


def work(decl: WorkDecl, path: str, mode: str, *, N: int, H: int, V: int, valid_rows: int, frozen: bool = False,
         triton: bool = False, element_size: int = 2, H_teacher: int | None = None, jsd: bool = False) -> Work:
    """The work of one call of ``mode`` ("fwd", "bwd", "fwdbwd", "nograd") on ``path``; on the distill path H is
    the student's width, ``H_teacher`` the teacher's (default H) and ``jsd`` whether 0 < beta < 1."""
    R = rows_computed(decl, path, N, valid_rows, triton)
    if path == "distill":
        return _distill_work(decl, mode, R, H, H if H_teacher is None else H_teacher, V, jsd, frozen)
    if path == "logits":
        if mode == "nograd":  # one read per computed row; no gradient, so no d logits written by anyone
            reads, writes, exact = 1, 0, _holds(decl.exact_logits_traffic, triton)
        elif _holds(decl.logits_in_forward, triton):
            reads, writes = (0, 0) if mode == "bwd" else (1, 1)
            exact = False
        else:
            reads = {"fwd": 1, "bwd": 1, "fwdbwd": 2}[mode]
            writes = 0 if mode == "fwd" else 1
            exact = _holds(decl.exact_logits_traffic, triton)
        amount = float(element_size) * V * (reads * R + writes * N)
        formula = ((f"{reads if reads > 1 else ''}RV read" if reads else "no logits traffic")
                   + (" + NV write" if writes else "") + ("" if exact else " (lower bound)"))
        return Work(amount, "B", R, formula, exact)
    k = matmul_multiple(decl, mode, frozen, triton)
    return Work(float(k) * R * H * V, "FLOP", R, f"{k}RHV", True)
