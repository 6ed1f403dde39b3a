"""The work model: what each provider really computes, behind the report's throughput and "% of ceiling".

Every provider declares (``providers.py``, field ``work``) how it runs the lm_head and which rows it computes;
``work(...)`` turns that into the amount of one call:

- linear / logprob paths: **matmul FLOPs**, as a multiple of R * H * V (R = rows computed, one GEMM = 2RHV):

  | strategy | forward | backward | fwd+bwd | frozen head (no dW) fwd+bwd |
  |---|---|---|---|---|
  | ``materialize`` (eager, torch.compile: logits kept for the backward) | 2 | 4 | 6 | 4 |
  | ``recompute`` (ours, TRL chunked: backward recomputes the logits) | 2 | 6 | 8 | 6 |
  | ``grads-in-forward`` (Liger chunked: forward does logits, recompute, dH, dW) | 8 | 0 | 8 | 6 |

  and 2 for the no-grad log-probs (one GEMM) whatever the strategy.
- logits path: **bytes of B x T x V traffic**: forward reads each computed row once; backward reads each computed
  row once and writes d logits for every row (zeros at skipped rows). That is exactly what the one-sweep Triton
  kernels (ours, Liger's, TRL's) do; for eager, torch.compile and our chunked CPU path, which make several passes,
  it is a lower bound (``exact=False``), so their rate and "% of ceiling" are lower bounds too.
- rows computed R: all N, or only the valid (unpadded) rows for a provider that skips padding on that path.

With these amounts, a rate above 100% of a ceiling measured in the same run would mean the model or the ceiling is
wrong; the report flags such a row instead of hiding it.
"""
from __future__ import annotations

import dataclasses

STRATEGIES = ("materialize", "recompute", "grads-in-forward")

# multiples of R*H*V: (forward, backward) with the weight trainable, and the dW share of the backward
_LINEAR = {"materialize": (2, 4), "recompute": (2, 6), "grads-in-forward": (8, 0)}
_DW = 2


@dataclasses.dataclass(frozen=True)
class WorkDecl:
    """What a provider declares about its own work.

    linear: the strategy of its lm_head (None: it has no linear path);
    skips_padded: path -> "always" | "triton": paths on which only valid rows are computed (with "triton", only
    when the provider runs its Triton kernels there, on CUDA or under the interpreter);
    exact_logits_traffic: "always" | "triton" | "never": whether the logits-path byte count is exact (one sweep
    forward, one backward) or a lower bound (several passes);
    source: where this was read (the provider's own code), for the report.
    """

    linear: str | None = None
    skips_padded: dict = dataclasses.field(default_factory=dict)
    exact_logits_traffic: str = "always"
    source: str = ""

    def __post_init__(self):
        if self.linear is not None and self.linear not in STRATEGIES:
            raise ValueError(f"linear must be one of {STRATEGIES}, got {self.linear!r}")
        for how in (*self.skips_padded.values(), self.exact_logits_traffic):
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


def matmul_multiple(decl: WorkDecl, mode: str, frozen: bool) -> int:
    """FLOPs of one call in units of R*H*V."""
    if mode == "nograd":
        return 2
    if decl.linear is None:
        raise ValueError("this provider declares no linear strategy")
    fwd, bwd = _LINEAR[decl.linear]
    if frozen:
        if decl.linear == "grads-in-forward":
            fwd -= _DW
        else:
            bwd -= _DW
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode]


def work(decl: WorkDecl, path: str, mode: str, *, N: int, H: int, V: int, valid_rows: int, frozen: bool = False,
         triton: bool = False, element_size: int = 2) -> Work:
    """The work of one call of ``mode`` ("fwd", "bwd", "fwdbwd", "nograd") on ``path``."""
    R = rows_computed(decl, path, N, valid_rows, triton)
    if path == "logits":
        reads = {"fwd": 1, "bwd": 1, "fwdbwd": 2}[mode]
        writes = 0 if mode == "fwd" else 1
        amount = float(element_size) * V * (reads * R + writes * N)
        exact = _holds(decl.exact_logits_traffic, triton)
        formula = (f"{reads if reads > 1 else ''}RV read" + (" + NV write" if writes else "")
                   + ("" if exact else " (lower bound)"))
        return Work(amount, "B", R, formula, exact)
    k = matmul_multiple(decl, mode, frozen)
    return Work(float(k) * R * H * V, "FLOP", R, f"{k}RHV", True)
