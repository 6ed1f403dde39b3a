"""Benchmark harness: settings, shape sets, shared inputs, peak-memory probe, ceilings and the timed run.

Every benchmark is one (path, shape, provider, mode):
- path "linear": GRPO loss from hidden (B, T, H) and the lm_head weight (V, H), both trainable;
- path "logits": GRPO loss from given logits (B, T, V), trainable;
- path "logprob": per-token log-probs from hidden and weight under ``torch.no_grad()`` (old / reference policy);
- mode "fwd", "bwd" (backward only; the forward runs untimed in the round's setup), "fwdbwd", "nograd".

Each run records in ``benchmark.extra_info``: the shape, the peak memory above the inputs, the work of the mode
(FLOPs for linear / logprob, bytes for logits), a ceiling measured in the same session (a bare matmul of the same
shape; a device-to-device copy of the logits), the achieved rate against it, and the loss / mean log-prob value,
so the report can show that every provider computed the same number.
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import time

import pytest
import torch

from grpo_kernels.config import GRPOLossConfig
from grpo_kernels.reference import logprobs_and_entropy

# The one loss config of every provider: TRL's GRPO defaults with a KL term (beta 0.04, reference log-probs given,
# TRL's default bias-corrected KL), off-policy old log-probs so clipping is exercised.
CONFIG = GRPOLossConfig(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.2, temperature=1.0,
                        use_bias_correction_kl=True)

LOSS_MODES = ("fwd", "bwd", "fwdbwd")


# ----------------------------------------------------------------------------------------------------------------
# settings and shape sets


@dataclasses.dataclass(frozen=True)
class Shape:
    """N = B * T tokens; H = 0 on the logits path (no hidden states there)."""

    N: int
    H: int
    V: int
    T: int
    interp: bool = False  # small enough for the Triton CPU interpreter

    @property
    def B(self) -> int:
        return self.N // self.T

    @property
    def id(self) -> str:
        return f"N{self.N}-H{self.H}-V{self.V}" if self.H else f"N{self.N}-V{self.V}"


@dataclasses.dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    grid: str  # "quick" | "full"
    rounds: int
    warmup: int
    interpret: bool  # run Triton providers on CPU through TRITON_INTERPRET=1
    budget_s: float | None
    start: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def shapes(self, path: str) -> list[Shape]:
        if self.cuda:
            Ns, T = (4096, 8192, 16384), 1024
            Hs, Vs = ((2048, 4096), (32000, 128256, 151936)) if self.grid == "full" else ((4096,), (151936,))
        else:
            Ns, T = ((128, 256, 512) if self.grid == "full" else (256, 512)), 64
            Hs, Vs = ((64, 128), (4000, 8000)) if self.grid == "full" else ((64,), (8000,))
        if path == "logits":
            Hs = (0,)
        shapes = [Shape(N, H, V, T) for H in Hs for V in Vs for N in Ns]
        if self.interpret and not self.cuda:
            shapes.insert(0, Shape(64, 0 if path == "logits" else 32, 1000, 16, interp=True))
        return shapes


SETTINGS: Settings | None = None  # set by conftest.pytest_configure


def settings() -> Settings:
    assert SETTINGS is not None, "benchmarks/conftest.py did not configure the harness"
    return SETTINGS


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------------
# inputs, shared by all providers of a shape (built once, the previous shape's tensors are released)


@dataclasses.dataclass
class Case:
    path: str
    shape: Shape
    device: torch.device
    dtype: torch.dtype
    ids: torch.Tensor  # (B, T) int64
    advantages: torch.Tensor  # (B,) fp32
    mask: torch.Tensor  # (B, T) bool, right-padded
    old_logps: torch.Tensor  # (B, T) fp32, off-policy
    ref_logps: torch.Tensor  # (B, T) fp32
    hidden: torch.Tensor | None = None  # (B, T, H) leaf, requires grad
    weight: torch.Tensor | None = None  # (V, H) leaf, requires grad
    logits: torch.Tensor | None = None  # (B, T, V) leaf, requires grad
    extra: dict = dataclasses.field(default_factory=dict)  # provider-private inputs (Liger's (B, T+1, V) logits)

    def clear_grads(self) -> None:
        for t in (self.hidden, self.weight, self.logits, *self.extra.values()):
            if isinstance(t, torch.Tensor):
                t.grad = None


_CASE: dict = {}


def get_case(path: str, shape: Shape) -> Case:
    s = settings()
    key = (path == "logits", shape)  # linear and logprob share hidden / weight
    if key not in _CASE:
        _CASE.clear()
        gc.collect()
        if s.cuda:
            torch.cuda.empty_cache()
        _CASE[key] = _build_case(path, shape, s.device, s.dtype)
    case = _CASE[key]
    case.clear_grads()
    return case


def _build_case(path, shape: Shape, device, dtype) -> Case:
    # Generated on the device: a (16384, 151936) logits tensor drawn on the host would take tens of seconds.
    g = torch.Generator(device=device).manual_seed(0)
    B, T, H, V = shape.B, shape.T, shape.H, shape.V
    ids = torch.randint(0, V, (B, T), generator=g, device=device)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g, device=device)
    mask = torch.arange(T, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    advantages = torch.randn(B, generator=g, device=device)
    case_kw = {}
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
    return Case(path, shape, device, dtype, ids, advantages, mask, old_logps=logp + 0.1 * noise[0],
                ref_logps=logp + 0.1 * noise[1], **case_kw)


def _logp_of(rows_to_logits, ids_flat: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """True log-probs of the sampled tokens through the package's eager reference, a row chunk at a time."""
    out = []
    with torch.no_grad():
        for r0 in range(0, ids_flat.numel(), chunk):
            r = slice(r0, r0 + chunk)
            out.append(logprobs_and_entropy(rows_to_logits(r), ids_flat[r])[0])
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------------
# peak memory above the inputs


class _Malloc:
    """glibc knobs (CPU only): every block >= 128 KiB becomes its own fresh mapping, returned to the OS when freed,
    so each tensor a measured call allocates shows up in the RSS in full, once.

    glibc's default mmap threshold is dynamic: it grows (up to 32 MiB) as mapped blocks are freed, after which
    tensors come from freed heap memory that may or may not still be resident, so the RSS high-water mark would
    miss some allocations and double-count others. A threshold set with ``mallopt`` stays fixed. It is set for the
    whole session (switching it only around the probe leaves large free heap blocks that glibc reuses before it
    consults the threshold); the cost is a page fault per fresh page in the timed CPU rounds too, as in a process
    that has not yet freed anything.
    """

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3

    def __init__(self):
        try:
            self.libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self.libc = None

    def configure(self) -> None:
        if self.libc is not None:
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 128 << 10)
            self.libc.mallopt(self.M_TRIM_THRESHOLD, 128 << 10)

    def trim(self) -> None:
        if self.libc is not None:
            self.libc.malloc_trim(0)


MALLOC = _Malloc()


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _cpu_probe_available() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status_kib("VmHWM")
        return True
    except OSError:
        return False


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda.max_memory_allocated"
    return "VmHWM (clear_refs=5)" if _cpu_probe_available() else "unavailable"


def measure_peak(device: torch.device, fn) -> int | None:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it (the inputs).

    CUDA: the caching allocator's ``max_memory_allocated``. CPU: the process's resident-set high-water mark
    (``VmHWM``), reset to the current RSS by writing 5 to ``/proc/self/clear_refs``, minus the RSS before the call;
    with the glibc mmap threshold fixed by ``MALLOC.configure`` a materialized N x V tensor is counted in full
    (``test_memory_probe.py`` checks it every run).
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if not _cpu_probe_available():
        return None
    MALLOC.trim()
    base = _proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return max(0, _proc_status_kib("VmHWM") - base) * 1024


# ----------------------------------------------------------------------------------------------------------------
# ceilings: measured once per shape in this session


_CEILING: dict = {}


def _best_time(device, fn, reps: int) -> float:
    """Fastest of ``reps`` timed calls after one warm call: a ceiling is the best the machine does."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def ceiling(case: Case) -> dict:
    """The rate a bare kernel of the same shape reaches here: TFLOP/s of ``(N, H) @ (H, V)`` in the input dtype for
    the linear paths; GB/s (read + write) of copying the (B, T, V) logits for the logits path."""
    s = settings()
    key = (case.path == "logits", case.shape)
    if key not in _CEILING:
        reps = 10 if s.cuda else 5
        sh = case.shape
        with torch.no_grad():
            if case.path == "logits":
                src = case.logits.detach()
                dst = torch.empty_like(src)
                t = _best_time(s.device, lambda: dst.copy_(src), reps)
                nbytes = 2 * src.numel() * src.element_size()
                _CEILING[key] = {"ceiling": nbytes / t / 1e9, "ceiling_unit": "GB/s", "ceiling_time_s": t,
                                 "ceiling_what": f"copy of the {tuple(src.shape)} {src.dtype} logits"}
                del dst
            else:
                h = case.hidden.detach().view(-1, sh.H)
                w = case.weight.detach()
                out = torch.empty(sh.N, sh.V, dtype=h.dtype, device=h.device)
                t = _best_time(s.device, lambda: torch.mm(h, w.T, out=out), reps)
                _CEILING[key] = {"ceiling": 2 * sh.N * sh.H * sh.V / t / 1e12, "ceiling_unit": "TFLOP/s",
                                 "ceiling_time_s": t,
                                 "ceiling_what": f"{h.dtype} matmul ({sh.N}, {sh.H}) @ ({sh.H}, {sh.V})"}
                del out
    return dict(_CEILING[key])


def work(case: Case, mode: str) -> tuple[float, str]:
    """Work of one call: FLOPs (linear, logprob) or bytes moved (logits).

    linear: forward 2NHV (the logits GEMM), backward 6NHV (recomputed logits, d hidden, d weight), fwd+bwd 8NHV,
    the convention of DESIGN.md section 5; logprob 2NHV. logits: forward reads the logits once (NV elements),
    backward reads them and writes d logits (2NV), fwd+bwd 3NV.
    """
    sh = case.shape
    if case.path == "logits":
        per = {"fwd": 1, "bwd": 2, "fwdbwd": 3}[mode]
        return per * sh.N * sh.V * case.logits.element_size(), "B"
    per = {"fwd": 2, "bwd": 6, "fwdbwd": 8, "nograd": 2}[mode]
    return float(per) * sh.N * sh.H * sh.V, "FLOP"


# ----------------------------------------------------------------------------------------------------------------
# the timed run


_SKIP_ERRORS = (ImportError, NotImplementedError, torch.cuda.OutOfMemoryError)


def run(benchmark, path: str, shape: Shape, provider, mode: str) -> None:
    """Time ``provider`` on ``path``/``shape``/``mode`` with pytest-benchmark and fill ``extra_info``."""
    s = settings()
    if s.budget_s is not None and time.monotonic() - s.start > s.budget_s:
        pytest.skip(f"time budget exhausted ({s.budget_s:.0f} s, --bench-budget-s)")
    reason = provider.skip_reason(path, shape, s)
    if reason:
        pytest.skip(reason)
    case = get_case(path, shape)
    benchmark.group = f"{path} {mode} {shape.id}"
    try:
        fn = provider.build(path, case)
        value = _first_call(case, fn, mode)  # compiles / autotunes; also the loss value check
    except _SKIP_ERRORS as exc:
        _release(case)
        pytest.skip(f"{provider.name} cannot run here: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")

    setup, target = _mode_functions(case, fn, mode)
    try:
        benchmark.pedantic(target, setup=setup, rounds=s.rounds, warmup_rounds=s.warmup, iterations=1)
        peak = _peak_of_mode(case, fn, mode)
    except torch.cuda.OutOfMemoryError as exc:
        _release(case)
        pytest.skip(f"{provider.name}: out of memory at {shape.id}: {str(exc).splitlines()[0][:200]}")
    finally:
        case.clear_grads()

    info = benchmark.extra_info
    info.update(path=path, mode=mode, provider=provider.name, provider_kind=provider.kind, N=shape.N, B=shape.B,
                T=shape.T, H=shape.H, V=shape.V, dtype=str(case.dtype).replace("torch.", ""),
                device=torch.cuda.get_device_name(s.device) if s.cuda else "cpu", torch=torch.__version__,
                threads=None if s.cuda else torch.get_num_threads(), peak_mem_bytes=peak,
                mem_method=memory_method(s.device), value=value, note=provider.notes.get(path, ""),
                grads_in_forward=path in provider.grads_in_forward)
    w, unit = work(case, mode)
    info.update(work=w, work_unit=unit)
    info.update(ceiling(case))
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    if stats is not None and stats.median > 0:
        scale = 1e12 if unit == "FLOP" else 1e9
        info["achieved"] = w / stats.median / scale
        info["frac_of_ceiling"] = info["achieved"] / info["ceiling"]


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


def _peak_of_mode(case: Case, fn, mode: str):
    """One more call under the memory probe: fwd / fwdbwd / nograd from the inputs alone; bwd from the state
    after the forward (whose saved tensors are counted in the fwd figure)."""
    case.clear_grads()
    _prepare(fn)
    if mode == "bwd":
        loss = fn()
        return measure_peak(case.device, loss.backward)
    _, target = _mode_functions(case, fn, mode)
    return measure_peak(case.device, target)
