"""The benchmark tests' helpers: the matmul FLOPs a provider's call really makes (counted at the dispatcher, so that
the work model's declared FLOPs can be checked against them) and a stand-in for pytest-benchmark's fixture."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class MatmulFlops(TorchDispatchMode):
    """Counts 2*m*k*n for every matmul the dispatcher sees (forward and autograd's backward alike)."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (aten.mm, aten.addmm, aten.addmm_):
            a, b = args[:2] if packet is aten.mm else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        elif packet in (aten.bmm, aten.baddbmm, aten.baddbmm_):
            a, b = args[:2] if packet is aten.bmm else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return func(*args, **(kwargs or {}))



def matmul_flops(fn, mode: str) -> int:
    """The matmul FLOPs of a benchmark call ``fn`` (returning its loss) in ``mode``: "nograd" (the call under
    no_grad), "bwd" (the backward alone), "fwd" (the call alone) or "fwdbwd" (the call and its backward)."""
    counter = MatmulFlops()
    if mode == "nograd":
        with torch.no_grad(), counter:
            fn()
    elif mode == "bwd":
        loss = fn()
        with counter:
            loss.backward()
    else:
        with counter:
            loss = fn()
            if mode == "fwdbwd":
                loss.backward()
    return counter.flops


class FakeBenchmark:
    """The part of pytest-benchmark's fixture ``harness.run`` uses: one timed call, no statistics."""

    def __init__(self):
        self.extra_info, self.group, self.stats = {}, None, None

    def pedantic(self, target, setup, rounds, warmup_rounds, iterations):
        args, kwargs = setup()
        target(*args, **kwargs)
