"""Benchmark harness: settings, the benchmark cases, shared inputs and the timed run.

Every benchmark is one (path, variant, mode, shape, provider):
- path "linear": GRPO loss from hidden (B, T, H) and the lm_head weight (V, H);
- path "logits": GRPO loss from given logits (B, T, V), trainable;
- path "logprob": per-token log-probs from hidden and weight under ``torch.no_grad()`` (old / reference policy);
- path "distill": the two-head distillation loss (TRL's ``_chunked_divergence_loss``: the divergence between the
  student's and the teacher's next-token distributions, mean over the valid tokens) from the student's hidden
  (B, T, H_s) and lm_head (V, H_s), trainable, and the teacher's (B, T, H_t), (V, H_t), frozen; variant "valid" is
  the generalized JSD (beta 0.5), "reverse_kl" the reverse KL (beta 1, TRL's default); mode "nograd" is the
  per-token divergence under ``torch.no_grad()`` (an evaluation pass);
- variant "valid" (every token valid: the headline tables), "padded" (a third of the tokens right-padded, as in
  a GRPO batch), "frozen" (the lm_head weight does not require grad), "longrow" (one row of T = 131072 tokens
  at V = 32768 on the logits path; a scaled-down row on CPU);
- mode "fwd", "bwd" (backward only; the forward runs untimed in the round's setup), "fwdbwd", "nograd" (under
  ``torch.no_grad()``: log-probs on the logprob path; log-probs + entropy from the logits on the logits path, the
  forward an old / reference policy or a metrics pass needs, so no provider runs a gradient-in-forward kernel).

``CASES`` lists the (path, variant, mode) triples in the order they run (most important first, so that a time
budget cuts the breakdown, not the headline). Each run records in ``benchmark.extra_info`` the shape, the rows
valid and computed, the peak memory above the inputs (for forward + backward also the forward's and the
backward's own peaks), the work of the call from the provider's declared work
model (``work.py``), the ceiling measured in the same session (``probes.py``) and the achieved rate against it,
and the loss / mean log-prob value, so the report can show that every provider computed the same number.
Benchmarks that do not run (no CUDA, a peer that fails or runs out of memory, a warm-up over its time limit, the
time budget) are recorded in ``NOT_RUN`` with the reason; the report lists them.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import importlib.metadata
import signal
import time

import pytest
import torch

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.reference import logprobs_and_entropy

from . import probes, report
from .work import work

# The one loss config of every provider: TRL's GRPO defaults with a KL term (beta 0.04, reference log-probs given,
# TRL's default bias-corrected KL), off-policy old log-probs so clipping is exercised.
CONFIG = GRPOLossConfig(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.2, temperature=1.0,
                        use_bias_correction_kl=True)

VARIANT_TITLES = {"valid": "every token valid", "padded": "a third of the tokens padded (right-padded rows)",
                  "frozen": "frozen lm_head (weight.requires_grad=False), every token valid",
                  "longrow": "one long row, every token valid",
                  "reverse_kl": "reverse KL (beta 1, TRL's default), every token valid"}
# distill path: the beta of each variant (TRL's convention: 0 forward KL, 1 reverse KL, else the generalized JSD
# with mixture (1 - beta) p_student + beta p_teacher), temperature 1
DISTILL_BETA = {"valid": 0.5, "reverse_kl": 1.0}

# (path, variant, mode) in run order: headline first, then the padded batch, the frozen head, the long row, and
# the forward / backward breakdown last (on the logits path the forward case is the no-grad pass: log-probs +
# entropy, which is what a forward-only target is measured on; the loss forward there writes the gradient).
CASES = report.CASES  # written once, in report.py (which runs without torch)
PADDED_FRACTION = 1 / 3
FULL_GRID_ONLY = (("distill", "reverse_kl"),)  # (path, variant): no shape on the quick grid


# ----------------------------------------------------------------------------------------------------------------
# settings and shape sets


@dataclasses.dataclass(frozen=True)
class Shape:
    """N = B * T tokens; H = 0 on the logits path (no hidden states there); on the distill path H is the student's
    width and Ht the teacher's."""

    N: int
    H: int
    V: int
    T: int
    interp: bool = False  # small enough for the Triton CPU interpreter
    Ht: int = 0  # the teacher's hidden width (distill path only)

    @property
    def B(self) -> int:
        return self.N // self.T

    @property
    def H_teacher(self) -> int:
        return self.Ht or self.H

    @property
    def id(self) -> str:
        h = f"-H{self.H}" + (f"-Ht{self.Ht}" if self.Ht else "") if self.H else ""
        return f"N{self.N}{h}-V{self.V}" + (f"-T{self.T}" if self.B == 1 else "")


@dataclasses.dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    grid: str  # "quick" | "full"
    rounds: int
    warmup: int
    interpret: bool  # run Triton providers on CPU through TRITON_INTERPRET=1
    budget_s: float | None
    warmup_limit_s: float | None = None  # bound on a provider's first (compiling) call
    start: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def shapes(self, path: str, variant: str) -> list[Shape]:
        if path == "distill":
            return self._distill_shapes(variant)
        if variant == "longrow":
            T, V = (131072, 32768) if self.cuda else (4096, 4000)
            return [Shape(T, 0, V, T)]
        if self.cuda:
            Ns, T = ((4096, 8192, 16384) if self.grid == "full" else (8192,)), 1024
            Hs, Vs = ((2048, 4096), (32000, 128256, 151936)) if self.grid == "full" else ((4096,), (151936,))
        else:
            Ns, T = ((128, 256, 512) if self.grid == "full" else (512,)), 64
            Hs, Vs = ((64, 128), (4000, 8000)) if self.grid == "full" else ((64,), (8000,))
        if path == "logits":
            Hs = (0,)
        shapes = [Shape(N, H, V, T) for H in Hs for V in Vs for N in Ns]
        if self.interpret and not self.cuda:
            shapes.insert(0, Shape(64, 0 if path == "logits" else 32, 1000, 16, interp=True))
        return shapes

    def _distill_shapes(self, variant: str) -> list[Shape]:
        """(student H, teacher H) pairs: equal widths (the 8 vs 12 / 16 N H V comparison) and a teacher wider than
        the student (on GPU Qwen2.5-1.5B's 1536 from 7B's 3584, Qwen's V = 151936). The reverse KL runs on the full
        grid only (``FULL_GRID_ONLY``: its torch.compile and Liger compile warm-ups would double the quick grid's
        distillation time on CPU)."""
        if self.grid != "full" and ("distill", variant) in FULL_GRID_ONLY:
            return []
        if self.cuda:
            Ns, T, V = ((4096, 8192, 16384) if self.grid == "full" else (8192,)), 1024, 151936
            widths = ((4096, 4096), (1536, 3584)) + (((2048, 4096),) if self.grid == "full" else ())
        else:
            Ns, T, V = ((256, 512) if self.grid == "full" else (256,)), 64, 8000
            widths = ((64, 64), (64, 128)) if self.grid == "full" else ((64, 64),)
        shapes = [Shape(N, H, V, T, Ht=Ht) for H, Ht in widths for N in Ns]
        if self.interpret and not self.cuda:
            shapes.insert(0, Shape(64, 32, 1000, 16, interp=True, Ht=48))
        return shapes


SETTINGS: Settings | None = None  # set by conftest.pytest_configure


def settings() -> Settings:
    assert SETTINGS is not None, "benchmarks/conftest.py did not configure the harness"
    return SETTINGS


sync = probes.sync


# ----------------------------------------------------------------------------------------------------------------
# inputs, shared by all providers and variants of a shape


@dataclasses.dataclass
class Case:
    path: str
    shape: Shape
    device: torch.device
    dtype: torch.dtype
    ids: torch.Tensor  # (B, T) int64
    advantages: torch.Tensor  # (B,) fp32
    mask: torch.Tensor  # (B, T) bool: the variant's mask (all True, or right-padded)
    old_logps: torch.Tensor  # (B, T) fp32, off-policy
    ref_logps: torch.Tensor  # (B, T) fp32
    hidden: torch.Tensor | None = None  # (B, T, H) leaf, requires grad
    weight: torch.Tensor | None = None  # (V, H) leaf; requires grad unless the variant is "frozen"
    logits: torch.Tensor | None = None  # (B, T, V) leaf, requires grad
    padded_mask: torch.Tensor | None = None  # (B, T) bool, a third of the tokens padded
    variant: str = "valid"
    teacher_hidden: torch.Tensor | None = None  # distill path: (B, T, H_t), no grad
    teacher_weight: torch.Tensor | None = None  # distill path: (V, H_t), no grad
    extra: dict = dataclasses.field(default_factory=dict)  # provider-private inputs (Liger's (B, T+1, V) logits)

    @property
    def valid_rows(self) -> int:
        return int(self.mask.sum())

    def view(self, variant: str) -> "Case":
        """The same tensors under ``variant``'s mask; "frozen" sees a weight that does not require grad."""
        mask = self.padded_mask if variant == "padded" else torch.ones_like(self.mask)
        weight = self.weight.detach() if variant == "frozen" and self.weight is not None else self.weight
        return dataclasses.replace(self, mask=mask, weight=weight, variant=variant)

    def clear_grads(self) -> None:
        for t in (self.hidden, self.weight, self.logits, *self.extra.values()):
            if isinstance(t, torch.Tensor):
                t.grad = None


_CASES: collections.OrderedDict = collections.OrderedDict()
CASE_CACHE_SIZE = 2  # two of: a linear / logprob case, a logits case, a distill case


def case_kind(path: str) -> str:
    """Paths whose cases share their tensors: linear and logprob ("head"); logits; distill."""
    return path if path in ("logits", "distill") else "head"


def get_case(path: str, shape: Shape, variant: str = "valid") -> Case:
    s = settings()
    key = (case_kind(path), shape)  # linear and logprob share hidden / weight
    if key not in _CASES:
        # a long row (B=1: 8.6 GB of bf16 logits on GPU) gets the device to itself, so eager has its best chance
        while _CASES and (len(_CASES) >= CASE_CACHE_SIZE or shape.B == 1):
            _CASES.popitem(last=False)
        gc.collect()
        if s.cuda:
            torch.cuda.empty_cache()
        _CASES[key] = _build_case(path, shape, s.device, s.dtype)
    _CASES.move_to_end(key)
    case = _CASES[key].view(variant)
    case.clear_grads()
    return case


def padded_mask(B: int, T: int, device, generator) -> torch.Tensor:
    """Right-padded rows whose lengths run evenly from T/3 to T (shuffled): a third of the tokens padded."""
    if B == 1:
        lengths = torch.tensor([round(T * (1 - PADDED_FRACTION))])
    else:
        lengths = torch.linspace(T * (1 - 2 * PADDED_FRACTION), T, B).round().long()
    lengths = lengths[torch.randperm(B, generator=torch.Generator().manual_seed(0))].to(device)
    return torch.arange(T, device=device).unsqueeze(0) < lengths.unsqueeze(1)


def _build_case(path, shape: Shape, device, dtype) -> Case:
    # Generated on the device: a (16384, 151936) logits tensor drawn on the host would take tens of seconds.
    g = torch.Generator(device=device).manual_seed(0)
    B, T, H, V = shape.B, shape.T, shape.H, shape.V
    ids = torch.randint(0, V, (B, T), generator=g, device=device)
    advantages = torch.randn(B, generator=g, device=device)
    case_kw = {}
    if path == "distill":
        return _build_distill_case(shape, device, dtype, g, ids, advantages)
    if path == "logits":
        logits = torch.randn(B, T, V, generator=g, device=device, dtype=dtype).mul_(2.0)
        case_kw["logits"] = logits.requires_grad_(True)
        logp = _logp_of(lambda r: logits.detach().view(-1, V)[r], ids.view(-1))
    else:
        hidden = torch.randn(B, T, H, generator=g, device=device, dtype=dtype)
        weight = torch.randn(V, H, generator=g, device=device, dtype=dtype).mul_(2.0 / H ** 0.5)
        case_kw["hidden"], case_kw["weight"] = hidden.requires_grad_(True), weight.requires_grad_(True)
        logp = _logp_of(lambda r: hidden.detach().view(-1, H)[r] @ weight.detach().T, ids.view(-1))
    logp = logp.view(B, T)
    noise = torch.randn(2, B, T, generator=g, device=device)
    return Case(path, shape, device, dtype, ids, advantages, torch.ones(B, T, dtype=torch.bool, device=device),
                old_logps=logp + 0.1 * noise[0], ref_logps=logp + 0.1 * noise[1],
                padded_mask=padded_mask(B, T, device, g), **case_kw)


def _build_distill_case(shape: Shape, device, dtype, g, ids, advantages) -> Case:
    """Student hidden and lm_head (trainable) and the teacher's (frozen), logits of standard deviation about 2 for
    both; the teacher's head is the student's direction plus its own (so the two distributions overlap: the
    divergence is neither 0 nor that of two unrelated heads). ids serve as Liger's labels (-100 where masked)."""
    B, T, H, Ht, V = shape.B, shape.T, shape.H, shape.H_teacher, shape.V
    hidden = torch.randn(B, T, H, generator=g, device=device, dtype=dtype)
    weight = torch.randn(V, H, generator=g, device=device, dtype=dtype).mul_(2.0 / H ** 0.5)
    teacher_hidden = torch.randn(B, T, Ht, generator=g, device=device, dtype=dtype)
    teacher_weight = torch.randn(V, Ht, generator=g, device=device, dtype=dtype).mul_(2.0 / Ht ** 0.5)
    k = min(H, Ht)  # the teacher sees the student's features in its first k dimensions
    teacher_hidden[..., :k].mul_(0.5).add_(hidden[..., :k], alpha=0.5)
    teacher_weight[:, :k].mul_(0.5).add_(weight[:, :k], alpha=0.5 * (H / Ht) ** 0.5)
    ones = torch.ones(B, T, dtype=torch.bool, device=device)
    return Case("distill", shape, device, dtype, ids, advantages, ones, old_logps=None, ref_logps=None,
                hidden=hidden.requires_grad_(True), weight=weight.requires_grad_(True), padded_mask=padded_mask(
                    B, T, device, g), teacher_hidden=teacher_hidden, teacher_weight=teacher_weight)


def _logp_of(rows_to_logits, ids_flat: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """True log-probs of the sampled tokens through the package's eager reference, a row chunk at a time."""
    out = []
    with torch.no_grad():
        for r0 in range(0, ids_flat.numel(), chunk):
            r = slice(r0, r0 + chunk)
            out.append(logprobs_and_entropy(rows_to_logits(r), ids_flat[r])[0])
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------------
# benchmarks that did not run, with the reason (written into the JSON by conftest, listed by the report)


NOT_RUN: list[dict] = []
_TIMED_OUT: dict = {}  # (provider, path) -> reason: later benchmarks of it are not attempted
_FELL_BACK: dict = {}  # (provider, path) -> why its first choice failed: later benchmarks use its fallback


class WarmupTimeout(Exception):
    pass


class _NotRunnable(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _record(spec: dict, status: str, reason: str) -> None:
    NOT_RUN.append(dict(spec, status=status, reason=reason))


@contextlib.contextmanager
def time_limit(seconds: float | None, state: dict):
    """Raise ``WarmupTimeout`` in the main thread after ``seconds`` (SIGALRM), and again every second until the
    block exits (code that catches and wraps the first one, as torch.compile may, still gets stopped);
    ``state["fired"]`` tells afterwards whether the limit was hit. No limit when ``seconds`` is None."""
    state["fired"] = False
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        state["fired"] = True
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        raise WarmupTimeout(f"warm-up (first call, compilation included) exceeded its {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:240] if lines else ''}"


# ----------------------------------------------------------------------------------------------------------------
# the timed run


def run(benchmark, path: str, variant: str, shape: Shape, provider, mode: str) -> None:
    """Time ``provider`` on one case with pytest-benchmark and fill ``extra_info``."""
    s = settings()
    spec = dict(path=path, variant=variant, mode=mode, provider=provider.name, provider_kind=provider.kind,
                N=shape.N, H=shape.H, V=shape.V, T=shape.T, **({"H_t": shape.H_teacher} if path == "distill" else {}))

    def not_run(status, reason):
        _record(spec, status, reason)
        pytest.skip(f"{provider.name}: {status}: {reason}")

    if s.budget_s is not None and time.monotonic() - s.start > s.budget_s:
        not_run("not started", f"time budget of {s.budget_s:.0f} s exhausted (--bench-budget-s)")
    reason = provider.skip_reason(path, shape, s)
    if reason:
        not_run("cannot run here", reason)
    if (provider.name, path) in _TIMED_OUT:
        not_run("not attempted", _TIMED_OUT[(provider.name, path)])
    try:
        _run(benchmark, spec, path, variant, shape, provider, mode, s, not_run)
    except KeyboardInterrupt:  # the hard time limit (SIGINT): say which benchmark it stopped
        _record(spec, "interrupted", "stopped by SIGINT (the caller's hard time limit) before it finished")
        raise


def _run(benchmark, spec, path, variant, shape, provider, mode, s, not_run) -> None:
    case = get_case(path, shape, variant)
    benchmark.group = f"{path} {variant} {mode} {shape.id}"

    bkey = builder_key(path, mode)
    key = (provider.name, bkey)
    builder, note = provider.builders[bkey], provider.notes.get(bkey, "")
    if key in _FELL_BACK:  # the provider's first choice failed earlier in this run: straight to its fallback
        _, builder, fallback_note = provider.fallbacks[bkey]
        note = f"{fallback_note} ({_FELL_BACK[key]})"
    try:
        fn, value = _attempt(builder, case, mode, s, provider)
    except _NotRunnable as primary:
        fallback = None if key in _FELL_BACK else provider.fallbacks.get(bkey)
        if fallback is None:
            not_run(primary.status, primary.reason)
        label, builder, fallback_note = fallback
        _record(dict(spec, provider=f"{provider.name} [{label}]"), primary.status, primary.reason)
        _FELL_BACK[key] = f"{label} {primary.status}: {primary.reason}"
        _TIMED_OUT.pop(key, None)
        note = f"{fallback_note} ({_FELL_BACK[key]})"
        try:
            fn, value = _attempt(builder, case, mode, s, provider)
        except _NotRunnable as second:
            not_run(second.status, second.reason)
    if key not in _FELL_BACK:  # the builder may have said more (the path our planner chose, a stubbed module)
        note = provider.notes.get(bkey, "")
    if provider.check is not None:  # before timing: ours outside the bound fails here; a peer's is noted
        note = "; ".join(n for n in (note, provider.check(case, provider, mode, value)) if n)

    setup, target = _mode_functions(case, fn, mode)
    try:
        benchmark.pedantic(target, setup=setup, rounds=s.rounds, warmup_rounds=s.warmup, iterations=1)
        peaks = _peak_of_mode(case, fn, mode)
    except torch.cuda.OutOfMemoryError as exc:
        _release(case)
        not_run("out of memory", _describe(exc))
    except Exception as exc:  # a peer failing in its timed rounds is a result; ours failing is a test failure
        _release(case)
        if provider.kind == "ours":
            _record(spec, "failed", _describe(exc))
            raise
        if key not in _FELL_BACK and bkey in provider.fallbacks:  # later benchmarks of it use the fallback
            _FELL_BACK[key] = f"{provider.fallbacks[bkey][0]} failed in its timed rounds: {_describe(exc)}"
        not_run("failed", _describe(exc))
    finally:
        case.clear_grads()

    w = work(provider.work, path, mode, N=shape.N, H=shape.H, V=shape.V, valid_rows=case.valid_rows,
             frozen=variant == "frozen", triton=provider.runs_triton(path, s),
             element_size=(case.logits.element_size() if path == "logits" else case.dtype.itemsize),
             H_teacher=shape.H_teacher, jsd=path == "distill" and 0.0 < DISTILL_BETA[variant] < 1.0)
    info = benchmark.extra_info
    info.update(spec)
    info.update(B=shape.B, dtype=str(case.dtype).replace("torch.", ""), valid_rows=case.valid_rows, rows=w.rows,
                device=torch.cuda.get_device_name(s.device) if s.cuda else "cpu", torch=torch.__version__,
                triton=_version("triton"), threads=None if s.cuda else torch.get_num_threads(),
                mem_method=probes.memory_method(s.device), value=value, note=note,
                grads_in_forward=mode != "nograd" and provider.computes_grads_in_forward(path, s), work=w.amount,
                work_unit=w.unit,
                work_formula=w.formula, work_exact=w.exact, work_source=provider.work.source)
    info.update(peaks)
    info.update(probes.ceiling(case))
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None and stats.median > 0 and w.amount > 0:
        info["achieved"] = w.amount / stats.median / (1e12 if w.unit == "FLOP" else 1e9)
        info["frac_of_ceiling"] = info["achieved"] / info["ceiling"]


def builder_key(path: str, mode: str) -> str:
    """The key of a provider's builder: the path, except the no-grad forward of the logits path (log-probs +
    entropy, no loss), ``"logits_nograd"``, and of the distill path (the per-token divergence), ``"distill_nograd"``."""
    return f"{path}_nograd" if mode == "nograd" and path in ("logits", "distill") else path


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _attempt(builder, case: Case, mode: str, s: Settings, provider):
    """Build and make the first (compiling / autotuning, untimed) call within the warm-up limit."""
    state: dict = {}
    try:
        with time_limit(s.warmup_limit_s, state):
            fn = builder(case)
            value = _first_call(case, fn, mode)
        return fn, value
    except Exception as exc:
        _release(case)
        if state.get("fired"):
            reason = (f"warm-up (first call, compilation included) exceeded its {s.warmup_limit_s:g} s limit "
                      "(--bench-warmup-limit-s)")
            _TIMED_OUT[(provider.name, case.path)] = f"its warm-up timed out earlier in this run ({reason})"
            raise _NotRunnable("timed out", reason) from None
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise _NotRunnable("out of memory", _describe(exc)) from None
        if isinstance(exc, (ImportError, NotImplementedError)):
            raise _NotRunnable("cannot run here", _describe(exc)) from None
        if provider.kind == "ours":
            _record(dict(path=case.path, variant=case.variant, mode=mode, provider=provider.name,
                         provider_kind=provider.kind, N=case.shape.N, H=case.shape.H, V=case.shape.V,
                         T=case.shape.T), "failed", _describe(exc))
            raise
        raise _NotRunnable("failed", _describe(exc)) from None


def _release(case: Case) -> None:
    case.clear_grads()
    gc.collect()
    if case.device.type == "cuda":
        torch.cuda.empty_cache()


def _prepare(fn) -> None:
    """Untimed per-call preparation a provider may need (Liger's in-place backward overwrites its logits)."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()


def _first_call(case: Case, fn, mode: str) -> float:
    _prepare(fn)
    if mode == "nograd":
        with torch.no_grad():
            out = fn()
        return float(out.float().masked_fill(~case.mask, 0).sum() / case.mask.sum())
    loss = fn()
    value = float(loss.detach())
    if mode != "fwd":
        loss.backward()
    sync(case.device)
    case.clear_grads()
    return value


def _mode_functions(case: Case, fn, mode: str):
    dev = case.device

    def clear():
        case.clear_grads()
        _prepare(fn)
        sync(dev)
        return (), {}

    if mode == "nograd":
        def target():
            with torch.no_grad():
                fn()
            sync(dev)
        return clear, target
    if mode == "fwd":
        def target():
            fn()  # the graph (and what it saved for backward) is freed on return
            sync(dev)
        return clear, target
    if mode == "bwd":
        def setup():
            case.clear_grads()
            _prepare(fn)
            loss = fn()
            sync(dev)
            return (loss,), {}

        def target(loss):
            loss.backward()
            sync(dev)
        return setup, target

    def target():
        fn().backward()
        sync(dev)
    return clear, target


def _peak_of_mode(case: Case, fn, mode: str) -> dict:
    """Peak memory of one more call under the probe: ``peak_mem_bytes`` of the benchmarked mode (fwd / fwdbwd /
    nograd from the inputs alone; bwd from the state after the forward, whose saved tensors are counted in the fwd
    figure); forward + backward also gets ``peak_fwd_bytes`` (the forward, holding what it saves for the backward)
    and ``peak_bwd_bytes`` (the backward, above the state after the forward) from a second, split call."""
    case.clear_grads()
    _prepare(fn)
    if mode == "bwd":
        loss = fn()
        peak = probes.measure_peak(case.device, loss.backward)
        return {"peak_mem_bytes": peak, "peak_bwd_bytes": peak}
    _, target = _mode_functions(case, fn, mode)
    peak = probes.measure_peak(case.device, target)
    if mode == "fwd":
        return {"peak_mem_bytes": peak, "peak_fwd_bytes": peak}
    if mode != "fwdbwd":
        return {"peak_mem_bytes": peak}
    case.clear_grads()
    _prepare(fn)
    held: list = []
    peak_fwd = probes.measure_peak(case.device, lambda: held.append(fn()))
    peak_bwd = probes.measure_peak(case.device, held[0].backward)
    held.clear()
    case.clear_grads()
    return {"peak_mem_bytes": peak, "peak_fwd_bytes": peak_fwd, "peak_bwd_bytes": peak_bwd}
