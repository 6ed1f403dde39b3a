"""TEST-ONLY stand-in for ``flash_attn.utils.distributed`` (see the package docstring): ``all_gather(x, group)``,
the concatenation along the first axis of every rank's ``x`` (same shape on every rank), differentiable: its
backward hands each rank the slice of the incoming gradient summed over the group (a reduce-scatter), as
flash-attn's ``AllGatherFunc``. OpenRLHF calls it only with ring attention, which grpo_kernels.openrlhf leaves to
OpenRLHF's own forward."""
import torch
import torch.distributed as dist


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // world, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def all_gather(x: torch.Tensor, process_group) -> torch.Tensor:
    return _AllGather.apply(x, process_group)
