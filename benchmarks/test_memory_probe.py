"""The peak-memory probe must see a materialized N x V tensor, and must not see one that never exists.

Runs with every benchmark session (it uses the benchmark fixture, so ``--benchmark-only`` keeps it): it times the
bare allocation of an N x V fp32 tensor and checks three measurements of ``probes.measure_peak``:
- a filled N x V fp32 tensor: counted in full (within [0.95, 1.25] of its size);
- the eager log-prob path (``hidden @ W.T`` then the reference log-softmax): at least one N x V fp32 tensor;
- our no-grad ``linear_token_logprobs`` (vocab-tiled) with ``memory_budget`` = 1/8 of an N x V fp32 tensor: under
  one N x V fp32 tensor (at these tiny CPU shapes the default budget would let its tiles cover every row).
"""
import torch

import grpo_kernels as gk

from . import harness, probes
from .providers import _eager_logprob


def test_memory_probe(benchmark):
    s = harness.settings()
    shapes = [sh for sh in s.shapes("linear", "valid") if not sh.interp]
    shape = shapes[0] if s.cuda else shapes[-1]
    case = harness.get_case("logprob", shape)
    nv_fp32 = shape.N * shape.V * 4

    def materialize():
        x = torch.empty(shape.N, shape.V, dtype=torch.float32, device=s.device).fill_(1.0)
        harness.sync(s.device)
        del x

    def eager():
        with torch.no_grad():
            _eager_logprob(case.hidden, case.weight, case.ids)
        harness.sync(s.device)

    def ours():
        with torch.no_grad():
            gk.linear_token_logprobs(case.hidden, case.weight, case.ids, memory_budget=nv_fp32 // 8)
        harness.sync(s.device)

    eager()
    ours()  # warm: first-call allocations (thread pools, kernel caches) are not what is measured
    measured = {name: probes.measure_peak(s.device, f)
                for name, f in (("materialize", materialize), ("eager", eager), ("ours", ours))}
    benchmark.group = "memory probe"
    benchmark.pedantic(materialize, rounds=3, warmup_rounds=1)
    benchmark.extra_info.update(path="probe", N=shape.N, V=shape.V, nv_fp32_bytes=nv_fp32,
                                mem_method=probes.memory_method(s.device),
                                **{f"peak_{k}_bytes": v for k, v in measured.items()})
    if measured["materialize"] is None:
        return  # no probe on this machine: the benchmarks record peak_mem_bytes=None
    assert 0.95 * nv_fp32 <= measured["materialize"] <= 1.25 * nv_fp32, measured
    assert measured["eager"] >= nv_fp32, measured
    assert measured["ours"] < nv_fp32, measured
