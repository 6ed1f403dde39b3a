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

from benchmarks import harness, report
from benchmarks.providers import (COMPILE, EAGER, LIGER_CHUNKED, LIGER_TRITON, OURS, OURS_LIGHT, TRL_CHUNKED,
                                  TRL_TRITON)
from benchmarks.work import WorkDecl, work
from grpo_kernels.reference import logprobs_and_entropy

from ..support.bench_work import FakeBenchmark, matmul_flops
from ..support.tolerances import assert_three_way

SHAPE = harness.Shape(N=24, H=16, V=96, T=8)  # B=3 rows of 8: padded lengths 3, 5, 8 (16 valid of 24)


def _case(path, variant):
    return harness._build_case(path, SHAPE, torch.device("cpu"), torch.float32).view(variant)


def _measured_flops(provider, variant, mode):
    path = "logprob" if mode == "nograd" else "linear"
    case = _case(path, variant)
    fn = provider.builders[path](case)
    return matmul_flops(fn, mode), case


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
        bench = FakeBenchmark()
        harness.run(bench, "linear", "valid", SHAPE, flaky, "fwdbwd")
        assert bench.extra_info["note"] == "measured eager (compiled=True failed: RuntimeError: torch._guards." \
                                           "GuardOnDataDependentSymNode: compiled loss failed)"
        assert bench.extra_info["work_formula"] == "6RHV" and bench.extra_info["rows"] == SHAPE.N
    assert [(n["provider"], n["status"]) for n in harness.NOT_RUN] == [("flaky [compiled=True]", "failed")]


def test_not_run_is_one_line_per_reason():
    cuda = "needs CUDA: runs Triton kernels and there is no CUDA device"
    not_run = [dict(path=p, variant=v, mode=m, provider=prov, provider_kind="peer", N=24, H=16 if p != "logits" else 0,
                    V=96, T=8, status="cannot run here", reason=cuda)
               for prov in ("liger-triton", "trl-triton", "ours-light") for p, v, m in report.CASES]
    not_run.append(dict(not_run[0], provider="compile", status="timed out", reason="warm-up exceeded its 60 s limit"))
    table = report.not_run_table(not_run).splitlines()
    assert len(table) == 4, table  # header, rule, one line per (status, reason)
    assert table[2] == (f"| cannot run here | {cuda} | liger-triton, ours-light, trl-triton | "
                        f"{3 * len(report.CASES)} (distill 9, linear 15, logits 15, logprob 6) |")
    assert table[3] == "| timed out | warm-up exceeded its 60 s limit | compile | 1 (linear 1) |"


def _trainer_bench():
    return {"stats": {"median": 30.0, "min": 30.0, "rounds": 1},
            "extra_info": dict(path="trainer", provider="grpo.train vs trl.GRPOTrainer", mode="train_step",
                               ours_step_s=0.125, trl_step_s=0.5, ratio=0.25, threads=1, steps_timed=24)}


def _sft_bench():
    return {"stats": {"median": 20.0, "min": 20.0, "rounds": 1},
            "extra_info": dict(path="trl_sft", provider="TRL SFTTrainer, patch_trl() vs stock", mode="train_step",
                               stock_step_s=0.25, patched_step_s=0.1, ratio=0.4, device="cpu", threads=1,
                               steps_timed=16)}


E2E = {"setup": {"model": "tiny-shaped Qwen2, random init", "vocab": 512, "G": 8, "prompts": 2,
                 "completion_length": 16, "steps": 3},
       "results": {"trl": {"step_s": 2.0, "steps": [3.0, 2.0, 2.0], "peak_gib": 10.0},
                   "trl_patched": {"step_s": 1.5, "steps": [2.5, 1.5, 1.5], "peak_gib": 8.0},
                   "grpo_train": {"skipped": "timed out after 80 s"}}}


def test_report_has_the_trainer_and_end_to_end_tables(tmp_path, capsys):
    """The trainer-vs-TRL step (benchmarks/test_trainer_speed.py) and e2e_step.json next to the results."""
    benches = [_bench("linear", "valid", "fwdbwd", OURS, 8e-3, ceiling=1.0), _trainer_bench()]
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"benchmarks": benches, "grpo_not_run": []}))
    assert report.main([str(src), "--no-plots"]) == 0  # output next to the JSON by default
    md = (tmp_path / "run.md").read_text()
    assert "| grpo.train | 125.0 | 0.25x | 24 | 1 |" in md and "| TRL GRPOTrainer | 500.0 | 1.00x | 24 | 1 |" in md
    assert "SFTTrainer step" not in md  # no SFT benchmark in this JSON
    assert "End-to-end" not in md  # no e2e_step.json yet
    (tmp_path / "e2e_step.json").write_text(json.dumps(E2E))
    capsys.readouterr()
    assert report.main([str(src), "--no-plots", "--print", "summary"]) == 0
    printed = capsys.readouterr().out
    for text in (printed, (tmp_path / "run.md").read_text()):
        assert "| TRL GRPOTrainer | 2.000 | 1.00x | 10.00 |" in text
        assert "| TRL + grpo_kernels.patch_trl() | 1.500 | 0.75x | 8.00 |" in text
        assert "| grpo.train | not run: timed out after 80 s | | |" in text
        assert "| grpo.train | 125.0 | 0.25x |" in text
    with pytest.raises(SystemExit, match="--e2e .*missing.json: no such file"):
        report.main([str(src), "--no-plots", "--e2e", str(tmp_path / "missing.json")])


def test_report_errors_are_one_line(tmp_path, capsys):
    assert report.main([str(tmp_path / "absent.json")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"{tmp_path / 'absent.json'}: cannot read (No such file "
                                                            "or directory)"]
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert report.main([str(bad)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_quick_grid_draws_bar_charts_and_says_line_plots_need_the_full_grid(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import NEED_FULL_GRID, plots

    benches = [_bench("linear", "valid", "fwdbwd", p, t, ceiling=1.0) for p, t in ((OURS, 8e-3), (EAGER, 9e-3))]
    benches += [_bench("logits", "valid", "nograd", p, t, ceiling=1.0) for p, t in ((OURS, 1e-3), (EAGER, 2e-3))]
    rows = report.load(_write(tmp_path / "q.json", benches))[1]
    written, notes = plots(rows, tmp_path, "q")
    assert sorted(p.name for p in written) == ["q_bars_linear.png", "q_bars_logits.png"]
    assert all(p.stat().st_size > 5000 for p in written) and notes == [NEED_FULL_GRID]
    # two N for one shape: the line plot appears and the note goes away
    more = [dict(b, extra_info=dict(b["extra_info"], N=48, B=6)) for b in benches[:2]]
    written, notes = plots(report.load(_write(tmp_path / "f.json", benches + more))[1], tmp_path, "f")
    assert "f_linear_H16_V96.png" in [p.name for p in written] and notes == []


def _write(path, benches):
    path.write_text(json.dumps({"benchmarks": benches, "grpo_not_run": []}))
    return path


def test_logits_forward_case_is_the_no_grad_pass_for_every_provider(monkeypatch):
    """("logits", "valid", "nograd") replaces the old forward case: log-probs + entropy under no_grad, the same
    mean log-prob for every provider, one read of the logits as its work, no gradient anywhere."""
    assert ("logits", "valid", "nograd") in harness.CASES and ("logits", "valid", "fwd") not in harness.CASES
    assert report.CASES == harness.CASES
    s = harness.Settings(device=torch.device("cpu"), dtype=torch.float32, grid="quick", rounds=1, warmup=0,
                         interpret=False, budget_s=None, warmup_limit_s=60)
    from benchmarks.providers import providers_for
    names = [p.name for p in providers_for("logits", "valid", "nograd", s)]
    # ours-light is ours under no_grad; ours-batch-invariant is ours with batch_invariant=True, side by side
    assert names == ["ours", "ours-batch-invariant", "eager", "compile", "liger-triton", "trl-triton"]
    monkeypatch.setattr(harness, "SETTINGS", s)
    monkeypatch.setattr(harness, "NOT_RUN", [])
    shape = harness.Shape(SHAPE.N, 0, SHAPE.V, SHAPE.T)
    values = {}
    for provider in (OURS, EAGER):
        bench = FakeBenchmark()
        harness.run(bench, "logits", "valid", shape, provider, "nograd")
        info = bench.extra_info
        assert info["mode"] == "nograd" and not info["grads_in_forward"]
        assert info["work_formula"].startswith("RV read") and info["work"] == 4 * SHAPE.V * SHAPE.N
        assert harness.get_case("logits", shape).logits.grad is None
        values[provider.name] = info["value"]
    # three-way: the mean log-prob against float64 on the same logits, the eager reference in fp32 the middle term
    case = harness.get_case("logits", shape)
    logp64 = logprobs_and_entropy(case.logits.detach().double(), case.ids, harness.CONFIG.temperature)[0]
    truth = logp64.masked_fill(~case.mask, 0).sum() / case.mask.sum()
    assert_three_way(values["ours"], values["eager"], truth, torch.float32, "mean log-prob")
    assert values["ours"] < 0


def test_forward_and_backward_peaks_are_recorded(monkeypatch):
    monkeypatch.setattr(harness, "SETTINGS", harness.Settings(
        device=torch.device("cpu"), dtype=torch.float32, grid="quick", rounds=1, warmup=0, interpret=False,
        budget_s=None, warmup_limit_s=60))
    monkeypatch.setattr(harness, "NOT_RUN", [])
    for mode, keys in (("fwdbwd", {"peak_mem_bytes", "peak_fwd_bytes", "peak_bwd_bytes"}),
                       ("fwd", {"peak_mem_bytes", "peak_fwd_bytes"}), ("bwd", {"peak_mem_bytes", "peak_bwd_bytes"})):
        bench = FakeBenchmark()
        harness.run(bench, "linear", "valid", SHAPE, EAGER, mode)
        got = {k for k in bench.extra_info if k.startswith("peak_")}
        assert got == keys, (mode, got)
        if harness.probes.memory_method(torch.device("cpu")) != "unavailable":
            assert all(isinstance(bench.extra_info[k], int) for k in keys)


def test_a_results_file_that_cannot_be_written_at_the_end_is_one_line(capsys):
    """pytest-benchmark writes the JSON at the very end; a failure there is one ERROR line and exit status 1."""
    from benchmarks import conftest as bench_conftest

    class BenchSession:
        json, benchmarks = "gone/run.json", []

        def save_json(self, output_json):
            raise FileNotFoundError(2, "No such file or directory", self.json)

    class Config:
        _benchmarksession = BenchSession()

    class Session:
        config, exitstatus = Config(), 0

    session = Session()
    bench_conftest.pytest_sessionstart(session)
    session.config._benchmarksession.save_json({})  # what pytest-benchmark's finish() calls
    wrapper = bench_conftest.pytest_sessionfinish(session, 0)
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(None)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    assert capsys.readouterr().err == ("ERROR: --benchmark-json gone/run.json: results not written (No such file or "
                                       "directory)\n")


@pytest.mark.interpreter
def test_no_grad_logits_builders_agree_on_the_triton_kernels():
    """The no-grad logits builders of the Triton providers (ours with impl=triton, Liger's, TRL's: the CUDA providers
    of that case) give the eager reference's log-probs, here on the Triton CPU interpreter."""
    from benchmarks.providers import OURS_INTERP

    shape = harness.Shape(N=16, H=0, V=100, T=8)
    case = harness._build_case("logits", shape, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        want = EAGER.builders["logits_nograd"](case)()
        assert want.shape == (2, 8) and torch.isfinite(want).all()
        for provider in (OURS_INTERP, LIGER_TRITON, TRL_TRITON):
            for module in provider.requires:
                pytest.importorskip(module)
            fn = provider.builders["logits_nograd"](case)
            harness._prepare(fn)
            # three-way: against float64 log-probs of the same logits, the eager reference in fp32 the middle term
            truth = logprobs_and_entropy(case.logits.detach().double(), case.ids, harness.CONFIG.temperature)[0]
            assert_three_way(fn(), want, truth, torch.float32, provider.name)


def test_fp32_gemm_line_of_the_gpu_check():
    """benchmarks/fp32_gemm_check.py: one line whatever the probe answers, or when its module is missing."""
    from benchmarks.fp32_gemm_check import describe

    seen = []

    def probe(device):
        seen.append(device)
        return {"mm": False, "addmm": False, "fallback": True, "reason": "TypeError: out_dtype"}

    assert describe(probe, cuda=True) == ("fp32-output GEMM path: NOT taken (fallback); mm=False, addmm=False, "
                                          "fallback=True, reason=TypeError: out_dtype")
    assert seen == [torch.device("cuda")]
    taken = {"mm": True, "addmm": True, "fallback": False, "reason": "probed"}
    assert describe(lambda d: taken, cuda=True).startswith("fp32-output GEMM path: taken; mm=True")
    assert describe(lambda d: {"mm": None, "fallback": False}, cuda=True).startswith(
        "fp32-output GEMM path: not decided")
    assert describe(probe, cuda=False) == "fp32-output GEMM path: not applicable (no CUDA device)"
    line = describe()  # the real module: present (this machine's verdict) or not yet in the tree
    assert line.startswith("fp32-output GEMM path: ") and "\n" not in line


def test_report_has_the_sft_step_table(tmp_path):
    """TRL's SFTTrainer step, stock against patch_trl() (benchmarks/test_sft_step.py), alone in a JSON too."""
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"benchmarks": [_sft_bench()], "grpo_not_run": []}))
    assert report.main([str(src), "--no-plots"]) == 0
    md = (tmp_path / "run.md").read_text()
    assert "### TRL SFTTrainer step: stock against patch_trl()" in md
    assert "| with patch_trl() | 100.0 | 0.40x | 16 | cpu | 1 |" in md and "| stock TRL | 250.0 | 1.00x | 16 | cpu | 1 |" in md
