"""The three-way tolerance rule of docs/DESIGN.md section 6.

A result in dtype D passes when ``err(ours) <= K * err(torch in D) + ATOL[D]``, errors measured against float64
ground truth: our kernels may not be much worse than what plain PyTorch in the same precision achieves.
"""
import torch

K = 2.0
ATOL = {torch.float32: 2e-5, torch.float16: 2e-4, torch.bfloat16: 2e-3, torch.float64: 1e-10}


def max_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    return (x.double() - truth.double()).abs().max().item() if x.numel() else 0.0


def assert_three_way(ours, torch_same_dtype, truth, dtype, what: str, scale: float | None = None):
    """Relative to ``scale`` (default: max |truth|, at least 1) so that large values do not dominate."""
    s = scale if scale is not None else max(truth.abs().max().item() if truth.numel() else 1.0, 1.0)
    e_ours, e_torch = max_err(ours, truth) / s, max_err(torch_same_dtype, truth) / s
    bound = K * e_torch + ATOL[dtype]
    assert torch.isfinite(torch.as_tensor(ours)).all(), f"{what}: non-finite values"
    assert e_ours <= bound, f"{what}: error {e_ours:.3e} > {K} * {e_torch:.3e} + {ATOL[dtype]:.0e} ({dtype})"


def naive_logprobs_entropy(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """What plain PyTorch computes in the logits' own dtype (the middle term of the rule)."""
    z = logits / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp.float(), entropy.float()


def loss_truth_and_same_dtype(inputs: dict, config):
    """The first two terms of the rule for a loss on logits: (loss, d logits) in float64 (ground truth) and from
    plain PyTorch in the logits' own dtype (naive log-softmax, then the reference loss stage).

    inputs: ``tests.cases.make_inputs`` output (logits, ids, advantages, mask and the optional per-token tensors).
    """
    from grpo_kernels.reference import loss_from_logps, reference_grpo_loss

    rest = {k: v for k, v in inputs.items() if k not in ("logits", "ids", "advantages", "mask")}
    x64 = inputs["logits"].double().requires_grad_(True)
    loss64, _ = reference_grpo_loss(x64, inputs["ids"], inputs["advantages"], inputs["mask"], config=config, **rest)
    (grad64,) = torch.autograd.grad(loss64, x64)
    xd = inputs["logits"].clone().requires_grad_(True)
    logp_d, ent_d = naive_logprobs_entropy(xd, inputs["ids"], config.temperature)
    loss_d, _ = loss_from_logps(logp_d, inputs["advantages"], inputs["mask"], entropy=ent_d, config=config, **rest)
    (grad_d,) = torch.autograd.grad(loss_d, xd)
    return loss64.detach(), grad64, loss_d.detach(), grad_d
