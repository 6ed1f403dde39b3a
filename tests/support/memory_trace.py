"""Transient memory of a call, traced on CPU from the torch profiler's memory events (allocation address and size).

``transient_peak(fn)``: the largest number of bytes, at any moment while ``fn()`` runs, held by allocations other than
the tensors the call hands back (outputs, returned gradients); allocations made before the call (inputs) are not
seen. This is ``Plan.transient``'s definition.
"""
from __future__ import annotations

import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile


def memory_events(fn) -> list:
    """(address, bytes) of every CPU allocation (+) and free (-) while ``fn()`` runs, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    events = [e for e in trace if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0]
    events.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    return [(e["args"]["Addr"], e["args"]["Bytes"]) for e in events]


def transient_peak(fn, kept=()) -> int:
    """Peak bytes held, while ``fn()`` runs, by allocations other than those of the tensors ``fn`` returns or leaves
    behind on purpose: ``fn()`` returns an iterable of such tensors (outputs, gradients), and ``kept`` adds more.
    An allocation still alive at the end that is none of them counts as held until the end."""
    result = []
    events = memory_events(lambda: result.extend(fn() or ()))
    keep = {t.untyped_storage().data_ptr() for t in list(result) + list(kept)
            if isinstance(t, torch.Tensor) and t.numel()}
    open_at, survivors = {}, set()
    for i, (addr, n) in enumerate(events):
        if n > 0:
            open_at[addr] = i
        elif addr in open_at:
            open_at.pop(addr)
    survivors = {i for addr, i in open_at.items() if addr in keep}
    live = peak = 0
    sizes = {}
    for i, (addr, n) in enumerate(events):
        if n > 0 and i not in survivors:
            sizes[addr] = n
            live += n
            peak = max(peak, live)
        elif n < 0 and addr in sizes:
            live -= sizes.pop(addr)
    return peak
