"""Data-parallel sharded heads through the distillation functions (``distributed/sharded_head.py``):

- ZeRO-3 (``gather_head`` / ``teacher_gather_head``): ``Partitioned`` empties each head's ``.data`` outside its
  gather context, as DeepSpeed does; the student's and the teacher's gathers are entered around the forward and
  again around the recompute backward (without that re-entry the backward would read empty tensors), and the
  numbers equal the unsharded call's bitwise.
- FSDP2 (DTensor heads, Shard(0) over 2 gloo ranks on CPU; this file is also the ranks' worker script): each rank
  distills on its own tokens; the student's weight gradient is the mean over the ranks of each rank's full gradient
  (what DDP gives), the teacher gets none.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk


class Partitioned:
    """ZeRO-3's partitioning of some parameters on one process: empty ``.data`` outside ``gather()``."""

    def __init__(self, *params):
        self.full = {id(p): p.data for p in params}
        self.params, self.entries = params, 0
        for p in params:
            p.data = torch.empty(0, dtype=p.dtype)

    @contextlib.contextmanager
    def gather(self):
        self.entries += 1
        for p in self.params:
            p.data = self.full[id(p)]
        try:
            yield
        finally:
            for p in self.params:
                p.data = torch.empty(0, dtype=p.dtype)


def _heads(seed=0, V=37, Hs=8, Ht=12, shape=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, Hs, generator=g), torch.randn(V, Hs, generator=g) * 0.5,
            torch.randn(*shape, Ht, generator=g), torch.randn(V, Ht, generator=g) * 0.5)


@pytest.mark.parametrize("fn", ["loss", "token"])
def test_zero3_gathers_around_forward_and_backward(fn):
    """The recompute path (the per-token function; the loss with grad_in_forward=False) re-enters both gathers in
    its backward; the numbers and gradients are the unsharded call's, bitwise."""
    sh, sw, th, tw = _heads(seed=1)

    def call(student_weight, teacher_weight, **kw):
        h = sh.clone().requires_grad_(True)
        if fn == "loss":
            out = gk.fused_linear_distill_loss(h, student_weight, th, teacher_weight, beta=0.4, impl="torch",
                                               grad_in_forward=False, **kw)[0]
        else:
            out = (gk.linear_token_divergence(h, student_weight, th, teacher_weight, beta=0.4, impl="torch",
                                              **kw)[0] * torch.linspace(0.5, 1.5, 10).view(2, 5)).sum()
        # Why autograd.grad: an empty partition cannot accumulate a full gradient (ZeRO-3's own hooks do that)
        grads = torch.autograd.grad(out, [h, student_weight, teacher_weight], allow_unused=True)
        return (out.detach(), *grads)

    plain = call(sw.clone().requires_grad_(True), tw.clone().requires_grad_(True))
    ws, wt = torch.nn.Parameter(sw.clone()), torch.nn.Parameter(tw.clone())
    student, teacher = Partitioned(ws), Partitioned(wt)
    sharded = call(ws, wt, gather_head=student.gather, teacher_gather_head=teacher.gather)
    assert student.entries == 2 and teacher.entries == 2  # the forward's and the backward's
    assert all(torch.equal(a, b) for a, b in zip(sharded[:3], plain[:3]))
    assert sharded[3] is None and plain[3] is None  # no gradient reaches the teacher


def test_zero3_refused_under_compile():
    sh, sw, th, tw = _heads()
    fn = torch.compile(lambda *a: gk.fused_linear_distill_loss(*a, impl="torch", gather_head=contextlib.nullcontext),
                       fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="gather_head"):
        fn(sh, sw, th, tw)


@pytest.mark.slow
def test_fsdp2_dtensor_heads(tmp_path):
    from ..support.ranks import start_ranks

    outputs = start_ranks(2, tmp_path, lambda r: [__file__, str(r), str(tmp_path / "store")])
    assert all("OK" in out for out in outputs), outputs


def _rank(rank: int, store: str) -> None:
    """One rank: student and teacher heads as Shard(0) DTensors over the 2 ranks; the student's gradient against the
    mean over ranks of the unsharded gradients (float64, torch impl; every rank computes every rank's truth)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        _, sw, _, tw = (t.double() for t in _heads(seed=7))
        sw_d = distribute_tensor(sw, mesh, [Shard(0)]).requires_grad_(True)
        tw_d = distribute_tensor(tw, mesh, [Shard(0)]).requires_grad_(True)
        sh, _, th, _ = (t.double() for t in _heads(seed=100 + rank))
        for gif in (True, False):
            sw_d.grad = None
            loss, _ = gk.fused_linear_distill_loss(sh, sw_d, th, tw_d, beta=0.3, impl="torch", grad_in_forward=gif)
            loss.backward()
            truth = torch.zeros_like(sw)
            for r in range(2):
                w = sw.clone().requires_grad_(True)
                h, _, t, _ = (x.double() for x in _heads(seed=100 + r))
                gk.fused_linear_distill_loss(h, w, t, tw, beta=0.3, impl="torch")[0].backward()
                truth += w.grad / 2
            got = sw_d.grad.full_tensor()
            # bound: the same float64 maths summed in another order (two ranks' halves): 2 x 257 u x max |grad|
            assert (got - truth).abs().max() <= 2 * 257 * 2.0 ** -53 * truth.abs().max(), (got - truth).abs().max()
            assert tw_d.grad is None
        print("OK", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    _rank(int(sys.argv[1]), sys.argv[2])
