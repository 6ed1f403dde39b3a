"""The pass rules of the numeric tests (docs/DESIGN.md section 6).

1. The three-way rule: a result in dtype D passes when ``err(ours) <= K * err(torch in D) + ATOL[D]``, errors
   measured against float64 ground truth on the same (rounded) inputs, in the same run: our kernels may not be much
   worse than what plain PyTorch in the same precision achieves *on this machine* (its BLAS, its vector width, its
   thread count), so the bound moves with the machine instead of being fitted to one. ``ATOL[D]`` is the floor for
   results where plain PyTorch happens to be exact, a function of the unit roundoff (``atol_of`` below): a sum of
   ``FLOOR_TERMS`` terms in the precision ours computes in (fp32 for every input dtype but float64) plus one rounding
   of the result to D.
2. Where no plain computation in D exists (it overflows, or there is no float64 truth), a bound derived from the
   unit roundoff ``U[D]`` and the operation count (``gamma``), with the derivation written next to it.
3. Exact equalities (integer counts, bitwise determinism, the same code on the same inputs) need no tolerance.
"""
import torch

K = 2.0
# Unit roundoff u (half an ulp of 1): a correctly rounded operation has relative error <= u.
U = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# The longest reduction the floor covers: the test cases' vocabularies, rows and token counts are at most a few
# hundred. A sum of n terms in any order is within gamma(n) ~ n u of exact, relative to the sum of |terms|: for the
# log-softmax's sum of probabilities that is the sum itself (an absolute error of n u in its log), and for the means
# of the loss and metrics it is at most the rule's scale (max |truth|, at least 1) where the terms are no larger.
FLOOR_TERMS = 256


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision every path computes in for inputs in ``dtype``: float64 for float64, fp32 for the others."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def atol_of(dtype: torch.dtype) -> float:
    """The three-way rule's floor for results in ``dtype``: the accumulation error of a ``FLOOR_TERMS``-term sum in
    the compute precision, ``FLOOR_TERMS * u(compute)``, plus one rounding to ``dtype`` (``u(dtype)``, relative to
    the scale, which no element exceeds). The second term is what a gradient in fp16 / bf16 needs: ours may round it
    to the dtype twice (d logits written in the dtype, then scaled by the upstream gradient in the dtype), the plain
    computation once, and the second rounding moves an element by up to u(dtype) of itself. Values: fp32 1.5e-5
    (257 u), fp16 5.0e-4 and bf16 3.9e-3 (about one u of the dtype), float64 2.9e-14 (257 u)."""
    return FLOOR_TERMS * U[compute_dtype(dtype)] + U[dtype]


ATOL = {dtype: atol_of(dtype) for dtype in U}


def gamma(n: int, dtype=torch.float32) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of a product or quotient of n + 1 rounded
    factors, and (times the sum of the absolute values of the terms) of a sum of n + 1 terms in any order."""
    nu = n * U[dtype]
    assert nu < 1, "gamma_n is only defined for n u < 1"
    return nu / (1 - nu)


def max_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    return (x.double() - truth.double()).abs().max().item() if x.numel() else 0.0


def assert_three_way(ours, torch_same_dtype, truth, dtype, what: str, scale: float | None = None):
    """Relative to ``scale`` (default: max |truth|, at least 1) so that large values do not dominate. Tensors or
    Python numbers (metrics)."""
    ours, torch_same_dtype, truth = (torch.as_tensor(x) for x in (ours, torch_same_dtype, truth))
    s = scale if scale is not None else max(truth.abs().max().item() if truth.numel() else 1.0, 1.0)
    assert torch.isfinite(ours).all(), f"{what}: non-finite values"
    assert_errors_three_way(max_err(ours, truth), max_err(torch_same_dtype, truth), dtype, what, s)


def assert_errors_three_way(e_ours: float, e_torch: float, dtype, what: str, scale: float = 1.0):
    """The rule on errors measured elsewhere (a worker process): ``e_ours`` and ``e_torch`` are the largest absolute
    errors of ours and of the plain computation against the same float64 truth, ``scale`` as in assert_three_way."""
    e_ours, e_torch = e_ours / scale, e_torch / scale
    bound = K * e_torch + ATOL[dtype]
    assert e_ours <= bound, f"{what}: error {e_ours:.3e} > {K} * {e_torch:.3e} + {ATOL[dtype]:.1e} ({dtype})"


def same_maths_slack(dtype) -> float:
    """How far two evaluations of the same maths in ``dtype`` may lie apart, relative to max(1, max |value|), when
    only the order or grouping of their sums differs (two layouts, shards, chunks): each is within the rule's floor
    ATOL[dtype] of exact (sums of up to FLOOR_TERMS terms no larger than the scale, one rounding to the dtype), so
    the two are within twice that."""
    return 2 * ATOL[dtype]


def assert_same_maths(got, want, dtype, what: str = "", scale: float | None = None):
    """``got`` and ``want`` within ``same_maths_slack(dtype)`` of each other, relative to ``scale`` (default
    max(1, max |want|); a gradient: its own largest value, ``grad_scale``)."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    s = scale if scale is not None else max(want.abs().max().item() if want.numel() else 1.0, 1.0)
    err = max_err(got, want) / s
    assert err <= same_maths_slack(dtype), f"{what}: {err:.3e} apart > {same_maths_slack(dtype):.1e} ({dtype})"


def grad_scale(truth: torch.Tensor) -> float:
    """The scale of a gradient for the three-way rule: max |truth| itself (gradients are often far below 1, where
    the default floor of 1 would hide any error), 1 for an all-zero gradient."""
    s = truth.abs().max().item() if truth.numel() else 0.0
    return s if s > 0 else 1.0


def naive_logprobs_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float, softcap=None):
    """What plain PyTorch computes in the logits' own dtype (the middle term of the rule), soft cap included when
    given; a -inf logit (a banned token, p = 0) adds 0 to the entropy as in the reference (not 0 * -inf = NaN)."""
    from grpo_kernels.reference import soft_cap

    z = soft_cap(logits, softcap) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    out = torch.float64 if logits.dtype == torch.float64 else torch.float32  # as the reference and ours
    return logp.to(out), entropy.to(out)


def token_truth_and_same_dtype(logits, ids, temperature, a, b, softcap=None):
    """(logp, entropy, d logits of sum(a logp + b entropy)) in float64 (ground truth) and from plain PyTorch in the
    logits' own dtype (the first two terms of the rule for ``token_logprobs``)."""
    from grpo_kernels.reference import logprobs_and_entropy

    out = []
    for x, fn in ((logits.double(), lambda x: logprobs_and_entropy(x, ids, temperature, softcap)),
                  (logits.clone(), lambda x: naive_logprobs_entropy(x, ids, temperature, softcap))):
        x.requires_grad_(True)
        logp, entropy = fn(x)
        (grad,) = torch.autograd.grad((a * logp + b * entropy).sum(), x)
        out.append((logp.detach(), entropy.detach(), grad))
    return out


def loss_truth_and_same_dtype(inputs: dict, config, with_metrics: bool = False):
    """The first two terms of the rule for a loss on logits: (loss, d logits) in float64 (ground truth) and from
    plain PyTorch in the logits' own dtype (naive log-softmax, soft cap included, then the reference loss stage);
    with_metrics: (loss64, grad64, metrics64, loss_d, grad_d, metrics_d).

    inputs: ``tests.support.cases.make_inputs`` output (logits, ids, advantages, mask and the optional per-token
    tensors).
    """
    from grpo_kernels.reference import loss_from_logps, reference_grpo_loss

    from .cases import optional_inputs

    rest = optional_inputs(inputs)
    x64 = inputs["logits"].double().requires_grad_(True)
    loss64, metrics64 = reference_grpo_loss(x64, inputs["ids"], inputs["advantages"], inputs["mask"], config=config,
                                            **rest)
    (grad64,) = torch.autograd.grad(loss64, x64)
    xd = inputs["logits"].clone().requires_grad_(True)
    logp_d, ent_d = naive_logprobs_entropy(xd, inputs["ids"], config.temperature, config.softcap)
    loss_d, metrics_d = loss_from_logps(logp_d, inputs["advantages"], inputs["mask"], entropy=ent_d, config=config,
                                        **rest)
    (grad_d,) = torch.autograd.grad(loss_d, xd)
    if with_metrics:
        return loss64.detach(), grad64, metrics64, loss_d.detach(), grad_d, metrics_d
    return loss64.detach(), grad64, loss_d.detach(), grad_d
