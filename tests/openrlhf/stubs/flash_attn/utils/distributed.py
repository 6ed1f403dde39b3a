"""TEST-ONLY stand-in for ``flash_attn.utils.distributed`` (see the package docstring): ``all_gather(x, group)``,
the concatenation along the first axis of every rank's ``x`` (same shape on every rank), differentiable: its
backward hands each rank its slice of the incoming gradient summed over the group (a reduce-scatter, here an
all-reduce and a slice, which gloo supports), as flash-attn's ``AllGatherFunc``. OpenRLHF calls it only with ring
attention, which grpo_kernels.openrlhf leaves to OpenRLHF's own forward; tests/openrlhf/test_openrlhf_variants.py
checks it on a one-rank gloo group."""
import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        rows = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * rows:(rank + 1) * rows], None


def all_gather(x: torch.Tensor, process_group) -> torch.Tensor:
    return _AllGather.apply(x, process_group)
