"""Transient memory of a call, traced on CPU from the torch profiler's memory events (allocation address and size).

``transient_peak(fn)``: the largest number of bytes, at any moment while ``fn()`` runs, held by allocations that are
freed again before it returns. What outlives the call (returned gradients, outputs) is not transient, and
allocations made before the call (inputs) are not seen: this is exactly ``Plan.transient`` 's definition.
"""
from __future__ import annotations

import json
import os
import tempfile

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


def transient_peak(fn) -> int:
    """Peak bytes held by allocations made and freed within ``fn()``."""
    events = memory_events(fn)
    open_at, freed = {}, set()
    for i, (addr, n) in enumerate(events):
        if n > 0:
            open_at[addr] = i
        elif addr in open_at:
            freed.add(open_at.pop(addr))
    live = peak = 0
    sizes = {}
    for i, (addr, n) in enumerate(events):
        if n > 0 and i in freed:
            sizes[addr] = n
            live += n
            peak = max(peak, live)
        elif n < 0 and addr in sizes:
            live -= sizes.pop(addr)
    return peak
