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


def reduce_mean_dict(values: dict[str, float], env: DistEnv) -> dict[str, float]:
    """Mean of each scalar over ranks, one collective for the whole dict (same keys on every rank)."""
    if not env.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=env.device)
    all_reduce_sum(t, env)
    return {k: v / env.world_size for k, v in zip(keys, t.tolist())}


def barrier(env: DistEnv) -> None:
    if env.enabled:
        dist.barrier()
