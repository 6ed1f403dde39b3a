"""The benchmarks' distillation case (benchmarks/distill_providers.py, the distill path of work.py, harness.py and
report.py), on CPU.

- Each distillation provider's declared matmul FLOPs equal what its code runs: a dispatch mode counts every mm /
  addmm of one call (forward, backward, both, no-grad; the JSD and the reverse KL; a teacher wider than the
  student), so a wrong declaration (TRL counted without its recompute or its JSD second pass, eager credited with a
  teacher gradient) fails here. Liger's fused JSD is a Triton kernel: counted on the Triton CPU interpreter.
- Every provider computes TRL's divergence (beta 0, 0.25 and 1 against float64: the beta convention of each peer);
  the check before the timing: ours outside the three-way bound fails the benchmark, a peer's is noted, the right
  values pass; one harness run per provider records the shape, the work and our planner's path.
- The report renders the distill section (both widths, the formula, the no-grad check column) and says why a case
  is not in the quick grid.
"""
import json

import pytest
import torch

from benchmarks import distill_providers as dp
from benchmarks import harness, report
from benchmarks.providers import providers_for
from benchmarks.work import work

from ..support.tolerances import same_maths_slack
from ..support.bench_work import FakeBenchmark, matmul_flops

SHAPES = {"wide teacher": harness.Shape(N=24, H=16, V=96, T=8, Ht=24),
          "equal widths": harness.Shape(N=24, H=16, V=96, T=8, Ht=16)}
CPU = harness.Settings(device=torch.device("cpu"), dtype=torch.float32, grid="quick", rounds=1, warmup=0,
                       interpret=False, budget_s=None, warmup_limit_s=60)


def _case(shape, variant="valid"):
    return harness._build_case("distill", shape, torch.device("cpu"), torch.float32).view(variant)


def _builder(provider, key):
    if provider is dp.LIGER_CHUNKED:  # compiled=False: the same GEMMs, and the dispatch mode sees them
        return provider.fallbacks["distill"][1]
    return provider.builders[key]


def _measured_flops(provider, case, mode):
    fn = _builder(provider, harness.builder_key("distill", mode))(case)
    flops = matmul_flops(fn, mode)
    case.clear_grads()
    return flops


# every (provider, variant, mode) a distill case runs (Liger's losses have no no-grad call); Liger's fused JSD is a
# Triton kernel: on the interpreter
FLOP_CASES = [pytest.param(p, v, m, id=f"{p.name}-{v}-{m}",
                           marks=[pytest.mark.interpreter] if p is dp.LIGER_FUSED else [])
              for p in (dp.OURS, dp.EAGER, dp.TRL, dp.LIGER_CHUNKED, dp.LIGER_FUSED)
              for v in ("valid", "reverse_kl") for m in ("fwdbwd", "fwd", "bwd", "nograd")
              if harness.builder_key("distill", m) in p.builders]


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("provider, variant, mode", FLOP_CASES)
def test_declared_distill_flops_are_what_the_code_runs(provider, variant, mode, shape):
    for module in provider.requires:
        pytest.importorskip(module)
    case = _case(shape, variant)
    measured = _measured_flops(provider, case, mode)
    declared = work(provider.work, "distill", mode, N=shape.N, H=shape.H, V=shape.V, valid_rows=case.valid_rows,
                    triton=provider.runs_triton("distill", CPU), H_teacher=shape.H_teacher,
                    jsd=0.0 < harness.DISTILL_BETA[variant] < 1.0)
    assert measured == declared.amount, (provider.name, variant, mode, measured, declared)


def test_distill_multiples_per_provider():
    """The issue's counts: ours, Liger and eager 8 N H V (6 H_s + 2 H_t), TRL 12 for a KL and 16 for the JSD."""
    N, V = 8192, 151936

    def w(p, jsd=True, mode="fwdbwd", H=4096, Ht=4096):
        return work(p.work, "distill", mode, N=N, H=H, V=V, valid_rows=N, H_teacher=Ht, jsd=jsd)

    assert dp.COMPILE.work.distill == dp.EAGER.work.distill
    for p in (dp.OURS, dp.EAGER, dp.LIGER_CHUNKED, dp.LIGER_FUSED):
        assert w(p).amount == 8 * N * 4096 * V and w(p).formula == "8RHV" and w(p, jsd=False).formula == "8RHV"
    assert (w(dp.TRL).formula, w(dp.TRL, jsd=False).formula) == ("16RHV", "12RHV")
    assert w(dp.TRL, H=1536, Ht=3584).formula == "10RVHs+6RVHt"
    assert w(dp.TRL, H=1536, Ht=3584).amount == (10 * 1536 + 6 * 3584) * N * V
    assert w(dp.OURS, H=1536, Ht=3584).formula == "6RVHs+2RVHt"
    assert (w(dp.OURS, mode="fwd").amount, w(dp.OURS, mode="bwd").amount) == (8 * N * 4096 * V, 0)
    assert w(dp.EAGER, mode="bwd", H=1536, Ht=3584).formula == "4RVHs+0RVHt"
    assert w(dp.TRL, mode="nograd").formula == "8RHV" and w(dp.OURS, mode="nograd").formula == "4RHV"


def test_the_value_check_fails_ours_and_notes_a_peer():
    case = _case(SHAPES["wide teacher"])
    truth = dp._mean_divergence(case, torch.float64)
    # bound: not a tolerance: the teacher overlaps the student, a divergence neither 0 nor that of unrelated heads
    assert 0.0 < truth < 5.0
    value = float(gk_loss(case))
    assert dp.check_value(case, dp.OURS, "fwdbwd", value) == ""
    wrong = truth * (1 + 1e-3)  # bound: far above the fp32 floor (1.5e-5 relative), so the check must fire
    with pytest.raises(AssertionError, match="ours's distillation loss against float64"):
        dp.check_value(case, dp.OURS, "fwdbwd", wrong)
    note = dp.check_value(case, dp.TRL, "nograd", wrong)
    assert note.startswith("its value is outside the three-way bound (trl-chunked's distillation divergence")


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])  # both KL directions and a JSD that is not symmetric
@pytest.mark.parametrize("provider", [pytest.param(p, id=p.name, marks=[pytest.mark.interpreter]
                                                   if p is dp.LIGER_FUSED else [])
                                      for p in (dp.OURS, dp.EAGER, dp.TRL, dp.LIGER_CHUNKED, dp.LIGER_FUSED)])
def test_every_provider_computes_the_same_divergence(monkeypatch, provider, beta):
    """The beta convention of each peer is TRL's (at beta 0.5 the JSD is symmetric in the two models, so the
    benchmark's JSD case alone would not tell): each provider's loss passes the value check against float64."""
    for module in provider.requires:
        pytest.importorskip(module)
    monkeypatch.setitem(harness.DISTILL_BETA, "valid", beta)
    monkeypatch.setattr(dp, "_TRUTH", {})
    case = _case(SHAPES["wide teacher"])
    value = float(_builder(provider, "distill")(case)().detach())
    assert dp.check_value(case, provider, "fwdbwd", value) == "", (provider.name, beta, value)


def gk_loss(case):
    import grpo_kernels as gk

    with torch.no_grad():
        return gk.fused_linear_distill_loss(case.hidden, case.weight, case.teacher_hidden, case.teacher_weight,
                                            case.mask, config=dp.distill_config(case))[0]


def test_providers_of_the_distill_cases():
    names = [p.name for p in providers_for("distill", "valid", "fwdbwd", CPU)]
    assert names == ["ours", "eager", "compile", "liger-chunked", "liger-fused", "trl-chunked"]
    assert [p.name for p in providers_for("distill", "valid", "nograd", CPU)] == ["ours", "eager", "compile",
                                                                                 "trl-chunked"]
    assert "ours" in [p.name for p in providers_for("linear", "valid", "fwdbwd", CPU)]  # the GRPO ours, still
    assert CPU.shapes("distill", "reverse_kl") == [] and CPU.shapes("distill", "valid")
    full = harness.Settings(**{**CPU.__dict__, "grid": "full"})
    assert {(s.H, s.H_teacher) for s in full.shapes("distill", "reverse_kl")} == {(64, 64), (64, 128)}


@pytest.mark.parametrize("mode", ["fwdbwd", "nograd"])
def test_a_harness_run_records_the_distill_case(monkeypatch, mode):
    monkeypatch.setattr(harness, "SETTINGS", CPU)
    monkeypatch.setattr(harness, "NOT_RUN", [])
    shape = SHAPES["wide teacher"]
    values = {}
    for provider in (dp.OURS, dp.EAGER, dp.TRL):
        bench = FakeBenchmark()
        harness.run(bench, "distill", "valid", shape, provider, mode)
        info = bench.extra_info
        assert (info["H"], info["H_t"], info["path"]) == (16, 24, "distill")
        values[provider.name] = info["value"]
        if provider is dp.OURS:
            path = "distill.torch" if mode == "nograd" else "distill.torch_fast"
            assert f"path {path} (" in info["note"] and info["work_formula"] == (
                "2RVHs+2RVHt" if mode == "nograd" else "6RVHs+2RVHt")
    assert harness.NOT_RUN == []
    # the same number from every provider (each was also checked against float64 before its timing): the same
    # maths evaluated in different orders
    spread = max(values.values()) - min(values.values())
    assert spread <= same_maths_slack(torch.float32) * max(1.0, *map(abs, values.values())), values


def test_report_renders_the_distill_section(tmp_path):
    def bench(provider, mode, median_s, formula):
        info = dict(path="distill", variant="valid", mode=mode, provider=provider, provider_kind="ours"
                    if provider == "ours" else "peer", N=24, H=16, H_t=24, V=96, T=8, B=3, dtype="float32",
                    device="cpu", torch="2.x", triton="3.x", rows=24, valid_rows=24, work=1e6, work_unit="FLOP",
                    work_formula=formula, work_exact=True, work_source="", value=0.25, ceiling=1.0,
                    ceiling_unit="TFLOP/s", ceiling_what="bare", peak_mem_bytes=3 << 20, mem_method="test", note="",
                    grads_in_forward=False)
        return {"stats": {"median": median_s, "min": median_s, "rounds": 3}, "extra_info": info}

    benches = [bench("ours", "fwdbwd", 1e-3, "6RVHs+2RVHt"), bench("trl-chunked", "fwdbwd", 3e-3, "10RVHs+6RVHt"),
               bench("eager", "fwdbwd", 2e-3, "6RVHs+2RVHt"), bench("ours", "nograd", 1e-3, "2RVHs+2RVHt"),
               bench("eager", "nograd", 4e-3, "2RVHs+2RVHt")]
    not_run = [dict(path="distill", variant="reverse_kl", mode="fwdbwd", provider="ours", provider_kind="ours", N=0,
                    H=0, V=0, T=0, status="not in this grid", reason="runs with --bench-grid full")]
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"benchmarks": benches, "grpo_not_run": not_run}))
    assert report.main([str(src), "--no-plots"]) == 0
    md = (tmp_path / "run.md").read_text()
    fwdbwd = md[md.index("### distill, every token valid: forward + backward"):]
    assert "| N=24 H_s=16 H_t=24 V=96 | **ours** | 1.00 | 0.50x |" in fwdbwd and "| 10RVHs+6RVHt |" in fwdbwd
    assert "mean divergence check |" in md[md.index("### distill, every token valid: no-grad forward"):]
    assert "- distillation, every provider: TRL's divergence" in md
    assert "| distill forward + backward, reverse KL (beta 1, TRL's default), every token valid | | not run (not in " \
           "this grid) |" in md
