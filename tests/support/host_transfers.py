"""Counting what a call moves between the host and the device (docs/api.md, "Host syncs and transfers").

``counting_transfers()`` records, while it is active, every operation that on a GPU run would be:

- a device-to-host read (a sync: the host waits for the queue): a scalar read (``.item()``, ``float(t)``,
  ``bool(t)``: aten ``_local_scalar_dense`` / ``is_nonzero``), ``Tensor.tolist()``, ``Tensor.cpu()`` /
  ``Tensor.numpy()``, and the ops whose output size depends on the data (``nonzero``, ``masked_select``,
  boolean-mask indexing, ``unique``, ...);
- a host-to-device copy: a tensor made from host data (``torch.tensor(list)``, ``torch.as_tensor(number)``: aten
  ``lift_fresh``), or a copy between two devices (``.to(device)`` / ``copy_`` whose source and target devices
  differ).

On a CPU-only machine every tensor is on the host, so the counter is conservative: a tensor built from Python data
counts as a transfer wherever it lands (on a GPU run it would be one as soon as it is built on the inputs' device,
and the library has no reason to build host tensors in a call). A Python number passed straight to an op (``x *
2.0``, ``clamp(min=1)``) is a kernel argument, not a transfer, and is not counted. Each record is (kind, name):
kind "sync" or "h2d"."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that make the host wait for the device on a GPU
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique",
            "_unique2", "unique_dim", "unique_consecutive", "masked_scatter", "allclose", "bincount"}
# aten ops that turn host data into a tensor (torch.tensor(list), torch.as_tensor(number))
HOST_DATA_OPS = {"lift_fresh", "lift_fresh_copy"}
COPY_OPS = {"_to_copy", "copy_", "to"}


def _bool_index(args) -> bool:
    """``x[mask]`` / ``x[mask] = v``: aten.index / index_put with a bool index (its size is data-dependent)."""
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices)


def _devices_differ(name, args, kwargs) -> bool:
    """A copy whose source and target devices differ (``_to_copy(x, device=...)``, ``dst.copy_(src)``)."""
    if name == "copy_" and len(args) >= 2 and all(isinstance(t, torch.Tensor) for t in args[:2]):
        return args[0].device != args[1].device
    target = kwargs.get("device")
    return bool(args) and isinstance(args[0], torch.Tensor) and target is not None and \
        torch.device(target) != args[0].device


def _on(device, args) -> bool:
    """Whether the op's first tensor argument lives on ``device`` (the call's device)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.device.type == device


class TransferCounter(TorchDispatchMode):
    """Records every op that would be a device-to-host sync or a host-to-device copy on a GPU, for a call whose
    inputs are on ``device`` (reads of tensors elsewhere, e.g. a CPU scalar beside meta inputs, are host reads)."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.records = []
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        kwargs = kwargs or {}
        if not _on(self.device, args) and name not in COPY_OPS:
            pass
        elif name in SYNC_OPS or (name in ("index", "index_put", "index_put_") and _bool_index(args)) or (
                name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) and
                isinstance(args[0], torch.Tensor) and len(args) < 2):
            self.records.append(("sync", name))
        elif name in HOST_DATA_OPS:
            self.records.append(("h2d", name))
        elif name in COPY_OPS and _devices_differ(name, args, kwargs):
            self.records.append(("h2d" if args[0].device.type == "cpu" else "sync", name))
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting_transfers(device: str = "cpu"):
    """``with counting_transfers() as records:`` the (kind, name) list of what the block would move on a GPU, for
    inputs on ``device`` (the device type standing for the GPU: "cpu" on a CPU-only machine, "meta" in unit tests
    of a host value beside device inputs)."""
    counter = TransferCounter(device)
    patched = {}

    def reading(method: str):
        real = getattr(torch.Tensor, method)
        patched[method] = real

        def wrapper(self, *args, **kwargs):
            if self.device.type == counter.device:
                counter.records.append(("sync", method))
            return real(self, *args, **kwargs)
        return wrapper

    for method in ("tolist", "cpu", "numpy"):
        setattr(torch.Tensor, method, reading(method))
    try:
        with counter:
            yield counter.records
    finally:
        for method, real in patched.items():
            setattr(torch.Tensor, method, real)


def syncs(records) -> list:
    return [name for kind, name in records if kind == "sync"]


def host_to_device(records) -> list:
    return [name for kind, name in records if kind == "h2d"]
