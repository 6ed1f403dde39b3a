"""Measurements of the machine, not of a provider: the peak-memory probe and the ceilings.

- ``measure_peak(device, fn)``: peak bytes allocated while ``fn()`` runs, above what was allocated before it.
- ``ceiling(case)``: the rate a bare kernel of the case's shape reaches in this session (a matmul for the linear
  paths, a device copy of the logits for the logits path), measured once per shape.
"""
from __future__ import annotations

import ctypes
import gc
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def ceiling(case) -> dict:
    """The rate a bare kernel of the same shape reaches here: TFLOP/s of ``(N, H) @ (H, V)`` in the input dtype for
    the linear paths (on the distill path both heads' GEMMs, one after the other); GB/s (read + write) of copying
    the (B, T, V) logits for the logits path."""
    key = ("logits" if case.path == "logits" else "distill" if case.path == "distill" else "head", case.shape)
    if key[0] == "distill" and key not in _CEILING:
        _CEILING[key] = _two_head_ceiling(case)
    if key not in _CEILING:
        cuda = case.device.type == "cuda"
        reps = 10 if cuda else 5
        sh = case.shape
        with torch.no_grad():
            if case.path == "logits":
                src = case.logits.detach()
                dst = torch.empty_like(src)
                t = _best_time(case.device, lambda: dst.copy_(src), reps)
                nbytes = 2 * src.numel() * src.element_size()
                _CEILING[key] = {"ceiling": nbytes / t / 1e9, "ceiling_unit": "GB/s", "ceiling_time_s": t,
                                 "ceiling_what": f"copy of the {tuple(src.shape)} {src.dtype} logits"}
                del dst
            else:
                h = case.hidden.detach().view(-1, sh.H)
                w = case.weight.detach()
                out = torch.empty(sh.N, sh.V, dtype=h.dtype, device=h.device)
                t = _best_time(case.device, lambda: torch.mm(h, w.T, out=out), reps)
                _CEILING[key] = {"ceiling": 2 * sh.N * sh.H * sh.V / t / 1e12, "ceiling_unit": "TFLOP/s",
                                 "ceiling_time_s": t,
                                 "ceiling_what": f"{h.dtype} matmul ({sh.N}, {sh.H}) @ ({sh.H}, {sh.V})"}
                del out
    return dict(_CEILING[key])


def _two_head_ceiling(case) -> dict:
    """TFLOP/s of the student's ``(N, H_s) @ (H_s, V)`` and the teacher's ``(N, H_t) @ (H_t, V)`` GEMMs together."""
    sh = case.shape
    with torch.no_grad():
        heads = [(case.hidden.detach().reshape(-1, sh.H), case.weight.detach()),
                 (case.teacher_hidden.reshape(-1, sh.H_teacher), case.teacher_weight)]
        outs = [torch.empty(sh.N, sh.V, dtype=h.dtype, device=h.device) for h, _ in heads]

        def both():
            for (h, w), out in zip(heads, outs):
                torch.mm(h, w.T, out=out)
        t = _best_time(case.device, both, 10 if case.device.type == "cuda" else 5)
        del outs
    dtype = case.hidden.dtype
    return {"ceiling": 2 * sh.N * (sh.H + sh.H_teacher) * sh.V / t / 1e12, "ceiling_unit": "TFLOP/s",
            "ceiling_time_s": t, "ceiling_what": f"{dtype} matmuls ({sh.N}, {sh.H}) @ ({sh.H}, {sh.V}) and "
                                                 f"({sh.N}, {sh.H_teacher}) @ ({sh.H_teacher}, {sh.V})"}
