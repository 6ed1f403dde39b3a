"""Process-group setup and the few collectives the trainer needs.

``torchrun --nproc_per_node N -m grpo.train`` sets RANK / WORLD_SIZE / LOCAL_RANK; without them the run is a single
process and every helper here is a no-op. Backend: NCCL when the run is on CUDA, gloo otherwise.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def pick_device(requested: str) -> torch.device:
    """'auto' -> CUDA (this process's local rank) when available, else CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was requested but no CUDA GPU is available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(requested)


def init_distributed(requested_device: str = "auto", group_for_one: bool = False) -> DistEnv:
    """Join the torchrun process group if there is one; return this process's rank, world size and device.
    ``group_for_one``: a single process still gets a 1-rank process group (FSDP2 needs a device mesh), held in an
    in-memory store: no port, no rendezvous."""
    device = pick_device(requested_device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        if group_for_one and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        return DistEnv(device=device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=device)


def cleanup_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """In-place sum over ranks (identity for a single process); returns ``t``."""
    if env.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def read_scalars(values: dict, env: DistEnv | None = None) -> dict[str, float]:
    """``values`` (0-d tensors and Python numbers) as Python floats, keys in their order, in one device-to-host read
    (one ``tolist``): the tensors are stacked as float64 (exact for fp32 / bf16 / fp16 values and integer counts
    below 2**53), a host tensor beside device ones joining in one host-to-device copy. Under torchrun (``env`` with
    several ranks) each value is its mean over the ranks, in one all-reduce of that stack (the Python numbers join
    it too; the same keys on every rank); otherwise the numbers pass through untouched, and with no tensor nothing
    is read."""
    ranks = env.world_size if env is not None and env.enabled else 1
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    numbers = [k for k in values if k not in tensors] if ranks > 1 else []  # host numbers that join the reduce
    if not tensors and not numbers:
        return {k: float(v) for k, v in values.items()}
    device = env.device if env is not None else next(iter(tensors.values())).device
    here = [k for k, v in tensors.items() if v.device == device]
    away = [k for k in tensors if k not in here]  # host tensors (CPU rewards) beside the device's metrics
    parts = [_float64_stack([tensors[k] for k in here], device)]
    if away or numbers:
        host = [_float64_stack([tensors[k] for k in away], torch.device("cpu"))]
        if numbers:
            host.append(torch.tensor([float(values[k]) for k in numbers], dtype=torch.float64))
        parts.append(torch.cat(host).to(device))
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    if ranks > 1:
        all_reduce_sum(flat, env)
    read = dict(zip(here + away + numbers, flat.tolist()))  # the one device-to-host read
    return {k: read[k] / ranks if k in read else float(v) for k, v in values.items()}


def _float64_stack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors])


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()
