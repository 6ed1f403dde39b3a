"""What a value check's failure (an id outside [0, V)) gives in each mode (docs/api.md, "What bad input raises"),
as an outcome a test compares: in the test's own process on CPU tensors (tests/api/test_errors_by_mode.py), and in a
child process on a GPU (tests/kernels/test_gpu_errors.py), since a device-side assert ends the process's CUDA
context. ``python -m tests.support.error_modes DEVICE MODE`` prints the outcome as one JSON line; the library reads
``GRPO_KERNELS_CHECK_VALUES`` from the environment the child is given.
"""
from __future__ import annotations

import json
import sys

import torch

import grpo_kernels as gk

MODES = ("eager", "compiled", "compiled-graph-breaks")  # compiled: fullgraph=True; -graph-breaks: fullgraph=False


def bad_ids_outcome(device: str, mode: str) -> dict:
    """``token_logprobs`` on ``device`` with one id above V, called eagerly or compiled (``aot_eager``, with
    ``fullgraph=True``, or False for "compiled-graph-breaks"), then the device synchronized: {"raised": the exception's
    type name or None, "value_error", "runtime_error": whether it is one, "message": its first line, "device_usable":
    whether a small computation on the device still works afterwards}."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 37, generator=g).to(device)
    ids = torch.randint(0, 37, (2, 4), generator=g)
    ids[1, 2] = 40
    ids = ids.to(device)

    def call(logits, ids):
        return gk.token_logprobs(logits, ids)

    if mode != "eager":
        call = torch.compile(call, fullgraph=mode == "compiled", backend="aot_eager")
    outcome = {"raised": None, "value_error": False, "runtime_error": False, "message": ""}
    try:
        call(logits, ids)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (the outcome records whatever was raised)
        outcome.update(raised=type(e).__name__, value_error=isinstance(e, ValueError),
                       runtime_error=isinstance(e, RuntimeError), message=(str(e).strip().splitlines() or [""])[0])
    try:
        outcome["device_usable"] = torch.ones(3, device=device).sum().item() == 3
    except Exception:  # noqa: BLE001  (a lost CUDA context raises on any later use)
        outcome["device_usable"] = False
    return outcome


if __name__ == "__main__":
    print(json.dumps(bad_ids_outcome(sys.argv[1], sys.argv[2])), flush=True)
