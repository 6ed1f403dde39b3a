"""The benchmarks' work model and report (benchmarks/work.py, benchmarks/report.py), on CPU.

- Each provider's declared matmul FLOPs equal what its code really runs: a dispatch mode counts every mm / addmm /
  bmm of one call (forward, backward, both; every token valid, a third padded, frozen head; no-grad log-probs),
  so a wrong declaration (e.g. torch.compile counted at 8NHV, or ours credited with padded rows) fails here.
- The logits-path byte model: one read per computed row forward, one read + one write per row backward; exact
  for the one-sweep Triton kernels, a lower bound for the others.
- The report renders from a JSON shaped like pytest-benchmark's: rates follow the work model, a rate above the
  ceiling is flagged, benchmarks that did not run are listed with their reason, and the summary picks the peer.
- A provider's warm-up is bounded in time, and a peer's failure is recorded rather than raised.
"""
import dataclasses
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import harness, report
from benchmarks.providers import (COMPILE, EAGER, LIGER_CHUNKED, LIGER_TRITON, OURS, OURS_LIGHT, TRL_CHUNKED,
                                  TRL_TRITON)
from benchmarks.work import WorkDecl, work

aten = torch.ops.aten
SHAPE = harness.Shape(N=24, H=16, V=96, T=8)  # B=3 rows of 8: padded lengths 3, 5, 8 (16 valid of 24)


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


def _case(path, variant):
    return harness._build_case(path, SHAPE, torch.device("cpu"), torch.float32).view(variant)


def _measured_flops(provider, variant, mode):
    path = "logprob" if mode == "nograd" else "linear"
    case = _case(path, variant)
    fn = provider.builders[path](case)
    counter = MatmulFlops()
    if mode == "nograd":
        with torch.no_grad(), counter:
            fn()
        return counter.flops, case
    if mode == "bwd":
        loss = fn()
        with counter:
            loss.backward()
    else:
        with counter:
            loss = fn()
            if mode == "fwdbwd":
                loss.backward()
    return counter.flops, case


@pytest.mark.parametrize("variant, mode", [(v, m) for v in ("valid", "padded", "frozen")
                                           for m in ("fwdbwd", "fwd", "bwd")] + [("valid", "nograd"),
                                                                                 ("padded", "nograd")])
@pytest.mark.parametrize("provider", [OURS, EAGER, TRL_CHUNKED, LIGER_CHUNKED], ids=lambda p: p.name)
def test_declared_matmul_flops_are_what_the_code_runs(provider, variant, mode):
    for module in provider.requires:
        pytest.importorskip(module)
    measured, case = _measured_flops(provider, variant, mode)
    path = "logprob" if mode == "nograd" else "linear"
    declared = work(provider.work, path, mode, N=SHAPE.N, H=SHAPE.H, V=SHAPE.V, valid_rows=case.valid_rows,
                    frozen=variant == "frozen", triton=False)
    assert measured == declared.amount, (provider.name, variant, mode, measured, declared)


def test_multiples_of_rhv_per_provider():
    """The issue's examples in numbers: torch.compile 6NHV (it keeps the logits), ours 8 x valid rows only."""
    N, H, V, valid = 8192, 4096, 151936, 5461

    def w(p, mode="fwdbwd", variant="valid", path="linear", triton=True):
        return work(p.work, path, mode, N=N, H=H, V=V, valid_rows=valid if variant == "padded" else N,
                    frozen=variant == "frozen", triton=triton)

    assert COMPILE.work == EAGER.work
    assert w(COMPILE).amount == 6 * N * H * V and w(COMPILE).formula == "6RHV"
    # ours on Triton: gradients in the forward (6 x valid rows); the CPU path and grad_in_forward=False recompute (8)
    assert w(OURS, variant="padded").amount == 6 * valid * H * V and w(OURS, variant="padded").rows == valid
    assert (w(OURS, "fwd").amount, w(OURS, "bwd").amount) == (6 * N * H * V, 0)
    assert w(OURS, variant="padded", triton=False).amount == 8 * valid * H * V
    assert w(OURS_LIGHT, variant="padded").amount == 8 * valid * H * V
    assert w(TRL_CHUNKED, variant="padded").amount == 8 * N * H * V
    assert w(LIGER_CHUNKED, "fwd").amount == 8 * N * H * V and w(LIGER_CHUNKED, "bwd").amount == 0
    assert [w(p, variant="frozen").amount // (N * H * V) for p in (EAGER, OURS, OURS_LIGHT, TRL_CHUNKED,
                                                                  LIGER_CHUNKED)] == [4, 4, 6, 6, 6]
    assert {w(p, "nograd", path="logprob").amount for p in (EAGER, TRL_CHUNKED, LIGER_CHUNKED)} == {2 * N * H * V}
    assert w(OURS, "nograd", "padded", path="logprob").amount == 2 * valid * H * V


def test_logits_traffic_model():
    N, V, valid, elt = 8192, 151936, 5461, 2

    def w(p, mode="fwdbwd", triton=True):
        return work(p.work, "logits", mode, N=N, H=0, V=V, valid_rows=valid, triton=triton, element_size=elt)

    for p in (OURS_LIGHT, LIGER_TRITON, TRL_TRITON):  # one-sweep Triton kernels: exact, padded rows skipped
        assert (w(p, "fwd").amount, w(p, "bwd").amount) == (elt * V * valid, elt * V * (valid + N))
        assert w(p).exact and w(p).rows == valid
    # ours by default: d logits written by the forward kernel (one read + one write, a lower bound: the second
    # sweep re-reads the row from L2 when it is still there); the backward moves no logits
    assert (w(OURS, "fwd").amount, w(OURS, "bwd").amount, w(OURS).amount) == \
        (elt * V * (valid + N), 0, elt * V * (valid + N))
    assert not w(OURS).exact and w(OURS).rows == valid
    for p in (EAGER, COMPILE):  # several passes over every row: a lower bound
        assert w(p).amount == elt * V * 3 * N and not w(p).exact and "lower bound" in w(p).formula
    assert w(OURS, triton=False).rows == N and not w(OURS, triton=False).exact  # the chunked torch path


def test_bad_declarations_are_refused():
    with pytest.raises(ValueError, match="linear"):
        WorkDecl("fused")
    with pytest.raises(ValueError, match="always"):
        WorkDecl("recompute", {"linear": "sometimes"})


def _bench(path, variant, mode, provider, median_s, ceiling, valid_rows=24, kind=None, value=1.0, **extra):
    sh = SHAPE if path != "logits" else harness.Shape(SHAPE.N, 0, SHAPE.V, SHAPE.T)
    w = work(provider.work, path, mode, N=sh.N, H=sh.H, V=sh.V, valid_rows=valid_rows,
             frozen=variant == "frozen", triton=True, element_size=2)
    info = dict(path=path, variant=variant, mode=mode, provider=provider.name, provider_kind=kind or provider.kind,
                N=sh.N, H=sh.H, V=sh.V, T=sh.T, B=sh.B, dtype="bfloat16", device="Test GPU", torch="2.x",
                triton="3.x", rows=w.rows, valid_rows=valid_rows, work=w.amount, work_unit=w.unit,
                work_formula=w.formula, work_exact=w.exact, work_source=provider.work.source, value=value,
                ceiling=ceiling, ceiling_unit="TFLOP/s" if w.unit == "FLOP" else "GB/s", ceiling_what="bare",
                peak_mem_bytes=3 << 20, mem_method="test", note="", grads_in_forward=False, **extra)
    return {"stats": {"median": median_s, "min": median_s, "rounds": 3}, "extra_info": info}


def test_report_renders_rates_from_the_work_model(tmp_path, capsys):
    rhv = SHAPE.N * SHAPE.H * SHAPE.V
    benches = [
        _bench("linear", "valid", "fwdbwd", OURS, 8e-3, ceiling=1.0 * rhv * 6 / 8e-3 / 1e12 / 0.5),  # 50%
        _bench("linear", "valid", "fwdbwd", COMPILE, 5e-3, ceiling=6 * rhv / 5e-3 / 1e12 / 1.25),  # 125%: flagged
        _bench("linear", "valid", "fwdbwd", EAGER, 9e-3, ceiling=1.0),
        _bench("linear", "padded", "fwdbwd", OURS, 6e-3, ceiling=1.0, valid_rows=16),
        _bench("linear", "padded", "fwdbwd", TRL_CHUNKED, 7e-3, ceiling=1.0, valid_rows=16),
    ]
    not_run = [dict(path="logits", variant="longrow", mode="fwdbwd", provider="liger-triton", provider_kind="peer",
                    N=131072, H=0, V=32768, T=131072, status="failed",
                    reason="RuntimeError: Triton Error [CUDA]: invalid argument"),
               dict(path="linear", variant="valid", mode="fwdbwd", provider="liger-chunked [compiled=True]",
                    provider_kind="peer", N=24, H=16, V=96, T=8, status="timed out", reason="warm-up exceeded")]
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"benchmarks": benches, "grpo_not_run": not_run, "datetime": "today",
                               "grpo_settings": {"grid": "quick", "padded_fraction": 1 / 3}}))
    assert report.main([str(src), "--out", str(tmp_path), "--no-plots", "--print", "summary"]) == 0
    printed = capsys.readouterr().out
    md = (tmp_path / "run.md").read_text()

    headline = md[md.index("### linear, every token valid"):].splitlines()
    compile_row = next(line for line in headline if "| compile |" in line)
    assert "| 6RHV |" in compile_row and "125.0 (!)" in compile_row and "above the ceiling" in md
    ours_row = next(line for line in headline if "| **ours** |" in line)
    assert "| 6RHV |" in ours_row and "| 50.0 |" in ours_row and "| 1.60x |" in ours_row  # 8 ms / 5 ms
    padded = md[md.index("### linear, a third of the tokens padded"):]
    assert "| 16 of 24 |" in padded.split("| trl-chunked |")[0] and "| all 24 |" in padded
    assert "invalid argument" in md and "liger-chunked [compiled=True]" in md and "timed out" in md
    assert "| linear forward + backward, every token valid | N=24 H=16 V=96 | 8.00 | compile | 5.00 | 1.60x | " \
           "50.0 | 125.0 (!) | 24 / 24 |" in printed
    assert "| logits forward + backward, one long row, every token valid | | not run (never reached" in printed


def test_warmup_is_bounded_and_peer_failures_are_recorded():
    s = harness.Settings(device=torch.device("cpu"), dtype=torch.float32, grid="quick", rounds=1, warmup=0,
                         interpret=False, budget_s=None, warmup_limit_s=0.3)
    case = _case("linear", "valid")

    def spins_and_wraps(c):  # like a compiler that catches the first interruption and raises its own error
        try:
            while True:
                pass
        except harness.WarmupTimeout as exc:
            raise RuntimeError("backend compiler failed") from exc

    def fails(c):
        raise RuntimeError("torch._guards: something broke")

    peer = EAGER
    with pytest.raises(harness._NotRunnable) as info:
        harness._attempt(spins_and_wraps, case, "fwdbwd", s, peer)
    assert info.value.status == "timed out" and "0.3 s limit" in info.value.reason
    assert (peer.name, "linear") in harness._TIMED_OUT
    harness._TIMED_OUT.clear()
    with pytest.raises(harness._NotRunnable) as info:
        harness._attempt(fails, case, "fwdbwd", s, peer)
    assert info.value.status == "failed" and "torch._guards" in info.value.reason
    with pytest.raises(RuntimeError, match="torch._guards"):  # ours failing is a failure, not a result
        harness._attempt(fails, case, "fwdbwd", s, OURS)
    harness.NOT_RUN.clear()


class _FakeBenchmark:
    """The part of pytest-benchmark's fixture ``harness.run`` uses: one timed call, no statistics."""

    def __init__(self):
        self.extra_info, self.group, self.stats = {}, None, None

    def pedantic(self, target, setup, rounds, warmup_rounds, iterations):
        args, kwargs = setup()
        target(*args, **kwargs)


def test_a_failing_first_choice_falls_back_and_says_so(monkeypatch):
    def broken(c):
        raise RuntimeError("torch._guards.GuardOnDataDependentSymNode: compiled loss failed")

    flaky = dataclasses.replace(EAGER, name="flaky", builders={"linear": broken},
                                fallbacks={"linear": ("compiled=True", EAGER.builders["linear"], "measured eager")})
    monkeypatch.setattr(harness, "SETTINGS", harness.Settings(
        device=torch.device("cpu"), dtype=torch.float32, grid="quick", rounds=1, warmup=0, interpret=False,
        budget_s=None, warmup_limit_s=30))
    monkeypatch.setattr(harness, "NOT_RUN", [])
    monkeypatch.setattr(harness, "_FELL_BACK", {})
    for _ in range(2):  # the second run goes straight to the fallback, recording nothing new
        bench = _FakeBenchmark()
        harness.run(bench, "linear", "valid", SHAPE, flaky, "fwdbwd")
        assert bench.extra_info["note"] == "measured eager (compiled=True failed: RuntimeError: torch._guards." \
                                           "GuardOnDataDependentSymNode: compiled loss failed)"
        assert bench.extra_info["work_formula"] == "6RHV" and bench.extra_info["rows"] == SHAPE.N
    assert [(n["provider"], n["status"]) for n in harness.NOT_RUN] == [("flaky [compiled=True]", "failed")]
