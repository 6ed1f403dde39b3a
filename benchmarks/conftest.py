"""Options of the benchmark suite and the generation of its (path, variant, mode, shape, provider) cases.

    pytest benchmarks/ --benchmark-only [--benchmark-json OUT.json] [options]

options (each also an environment variable, for CI / scripts):
  --bench-grid quick|full   GRPO_BENCH_GRID      shape set; quick (default): CPU N=512 (T=64), H 64, V 8000;
                                                 GPU N=8192 (T=1024), H 4096, V 151936 (bf16). full: CPU N in
                                                 {128, 256, 512} x H {64, 128} x V {4000, 8000}; GPU N in {4096,
                                                 8192, 16384} x H {2048, 4096} x V {32000, 128256, 151936}.
                                                 The long row is B=1, T=131072, V=32768 on GPU (T=4096, V=4000
                                                 on CPU) in both. Distillation (student H_s / teacher H_t):
                                                 quick CPU N=256 (T=64), 64 / 64, V 8000; GPU N=8192 (T=1024),
                                                 4096 / 4096 and 1536 / 3584, V 151936 (bf16). full: CPU N in
                                                 {256, 512} x {64 / 64, 64 / 128}; GPU N in {4096, 8192, 16384} x
                                                 {4096 / 4096, 1536 / 3584, 2048 / 4096}; the reverse KL case
                                                 on the full grid only.
  --bench-rounds N          GRPO_BENCH_ROUNDS    timed rounds per benchmark (default 3 on CPU, 5 on CUDA)
  --bench-warmup N          GRPO_BENCH_WARMUP    untimed rounds after the first (compiling) call (default 0 on
                                                 CPU, 1 on CUDA)
  --bench-budget-s S        GRPO_BENCH_BUDGET_S  no benchmark starts once S seconds have passed (the rest are
                                                 listed as not run)
  --bench-warmup-limit-s S  GRPO_BENCH_WARMUP_LIMIT_S  bound on a provider's first call (torch.compile,
                                                 autotuning): past it the provider is reported as timed out on
                                                 that path and not tried again (default 120)
  --bench-interpret         GRPO_BENCH_INTERPRET=1  CPU only: run the Triton providers (ours impl=triton, Liger's
                                                 and TRL's logits kernels) on the Triton interpreter, at one
                                                 extra tiny shape (slow; off by default)
Benchmarks run in ``harness.CASES`` order (headline first), whatever the file. Rounds are fixed
(``benchmark.pedantic``), so ``--benchmark-min-rounds`` / ``--benchmark-max-time`` do not apply. Each benchmark's
``extra_info`` carries rows, work, peak memory, ceiling and achieved rate (see ``harness.py``, ``work.py``); the
JSON also gets ``grpo_not_run`` (benchmarks that did not run, with the reason) and ``grpo_settings``.
The folder of ``--benchmark-json`` is created; a path that cannot be written is refused before any benchmark runs,
and a write that fails at the end (disk full) is one error line and exit status 1, not a traceback.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

from . import harness, probes
from .providers import providers_for


def pytest_addoption(parser):
    group = parser.getgroup("grpo-kernels benchmarks")
    group.addoption("--bench-grid", choices=("quick", "full"), default=None, help="shape set (default quick)")
    group.addoption("--bench-rounds", type=int, default=None, help="timed rounds per benchmark")
    group.addoption("--bench-warmup", type=int, default=None, help="untimed warmup rounds per benchmark")
    group.addoption("--bench-budget-s", type=float, default=None, help="start no benchmark after this many seconds")
    group.addoption("--bench-warmup-limit-s", type=float, default=None,
                    help="time limit of a provider's first (compiling) call")
    group.addoption("--bench-interpret", action="store_true", default=None,
                    help="CPU: run the Triton providers on the Triton interpreter (slow)")


def _opt(config, name, env, cast, default):
    value = config.getoption(name)
    if value is None and os.environ.get(env, "") != "":
        value = cast(os.environ[env])
    return default if value is None else value


def _prepare_json_path(config) -> None:
    """Create the folder of ``--benchmark-json`` and check that the file can be written, before the (minutes of)
    benchmarks run: pytest-benchmark opens it only at the very end."""
    path = config.getoption("benchmark_json", None)
    if path is None:
        return
    path = pathlib.Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise pytest.UsageError(f"--benchmark-json {path}: cannot write the results there "
                                f"({exc.strerror or type(exc).__name__})") from None


def pytest_configure(config):
    config.addinivalue_line("markers", "bench_path(path): benchmark path, one of linear / logits / logprob / distill")
    _prepare_json_path(config)
    cuda = torch.cuda.is_available()
    interpret = bool(_opt(config, "--bench-interpret", "GRPO_BENCH_INTERPRET", lambda v: v not in ("0", ""),
                          False)) and not cuda
    if interpret:
        # Before any Triton kernel of ours, Liger's or TRL's is created (all are imported lazily).
        os.environ["TRITON_INTERPRET"] = "1"
    if not cuda:
        if "OMP_NUM_THREADS" not in os.environ:
            # One thread: on a small shared CI box, OpenMP workers spinning against other processes made calls
            # 3-10x slower and noisier than one thread. OMP_NUM_THREADS overrides.
            torch.set_num_threads(1)
        probes.MALLOC.configure()
    harness.SETTINGS = harness.Settings(
        device=torch.device("cuda" if cuda else "cpu"),
        dtype=torch.bfloat16 if cuda else torch.float32,
        grid=_opt(config, "--bench-grid", "GRPO_BENCH_GRID", str, "quick"),
        rounds=_opt(config, "--bench-rounds", "GRPO_BENCH_ROUNDS", int, 5 if cuda else 3),
        warmup=_opt(config, "--bench-warmup", "GRPO_BENCH_WARMUP", int, 1 if cuda else 0),
        interpret=interpret,
        budget_s=_opt(config, "--bench-budget-s", "GRPO_BENCH_BUDGET_S", float, None),
        warmup_limit_s=_opt(config, "--bench-warmup-limit-s", "GRPO_BENCH_WARMUP_LIMIT_S", float, 120.0),
    )


def pytest_report_header(config):
    s = harness.SETTINGS
    if s is None:
        return None
    dev = torch.cuda.get_device_name(s.device) if s.cuda else f"cpu ({torch.get_num_threads()} threads)"
    return (f"grpo-kernels benchmarks: device={dev} dtype={s.dtype} grid={s.grid} rounds={s.rounds} "
            f"warmup={s.warmup} interpret={s.interpret} budget_s={s.budget_s} warmup_limit_s={s.warmup_limit_s} "
            f"memory={probes.memory_method(s.device)}")


def pytest_generate_tests(metafunc):
    marker = metafunc.definition.get_closest_marker("bench_path")
    if marker is None or "spec" not in metafunc.fixturenames:
        return
    path = marker.args[0]
    s = harness.settings()
    params = [pytest.param((variant, shape, provider, mode), id=f"{variant}-{mode}-{shape.id}-{provider.name}")
              for p, variant, mode in harness.CASES if p == path
              for shape in s.shapes(path, variant)
              for provider in providers_for(path, variant, mode, s)]
    for p, variant, mode in harness.CASES:  # a case this grid has no shape for: the report says why
        if p == path and not s.shapes(path, variant):
            harness.NOT_RUN.append(dict(path=path, variant=variant, mode=mode, provider="ours", provider_kind="ours",
                                        N=0, H=0, V=0, T=0, status="not in this grid",
                                        reason="runs with --bench-grid full (GRPO_BENCH_GRID=full)"))
    metafunc.parametrize("spec", params)


def pytest_collection_modifyitems(config, items):
    """Run the benchmarks in ``harness.CASES`` order across files (the memory probe first); stable otherwise."""
    order = {case: i for i, case in enumerate(harness.CASES)}

    def key(item):
        marker = item.get_closest_marker("bench_path")
        spec = getattr(getattr(item, "callspec", None), "params", {}).get("spec")
        if marker is None or spec is None:
            return -1
        variant, _, _, mode = spec
        return order.get((marker.args[0], variant, mode), len(order))

    items[:] = [it for _, it in sorted(enumerate(items), key=lambda p: (key(p[1]), p[0]))]


def pytest_benchmark_update_json(config, benchmarks, output_json):
    s = harness.SETTINGS
    output_json["grpo_not_run"] = list(harness.NOT_RUN)
    if s is not None:
        output_json["grpo_settings"] = dict(grid=s.grid, rounds=s.rounds, warmup=s.warmup, budget_s=s.budget_s,
                                            warmup_limit_s=s.warmup_limit_s, interpret=s.interpret,
                                            padded_fraction=harness.PADDED_FRACTION)


def pytest_sessionstart(session):
    """A results file that cannot be written at the end (the folder removed meanwhile, a full disk) is reported in
    one line and fails the run, instead of pytest-benchmark's traceback through pytest's hooks."""
    bench_session = getattr(session.config, "_benchmarksession", None)
    if bench_session is None or not getattr(bench_session, "json", None):
        return
    save_json = bench_session.save_json

    def guarded(output_json):
        try:
            save_json(output_json)
        except OSError as exc:
            session.config._grpo_json_error = (f"--benchmark-json {bench_session.json}: results not written "
                                               f"({exc.strerror or type(exc).__name__})")
    bench_session.save_json = guarded


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Drop a benchmark interrupted before it finished (Ctrl-C, ``timeout -s INT``), so that pytest-benchmark
    still writes the JSON of the finished ones instead of failing on an empty sample."""
    bench_session = getattr(session.config, "_benchmarksession", None)
    if bench_session is not None:
        bench_session.benchmarks[:] = [b for b in bench_session.benchmarks
                                       if getattr(getattr(b, "stats", None), "data", None)
                                       and "path" in (getattr(b, "extra_info", None) or {})]
    yield
    error = getattr(session.config, "_grpo_json_error", None)
    if error:
        print(f"ERROR: {error}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
