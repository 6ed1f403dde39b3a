"""Checkpoints: ``<output-dir>/checkpoint-<step>/`` holding

- ``model/``: ``save_pretrained`` weights + tokenizer (a regular ``--model`` directory for a later run),
- ``trainer_state.pt``: step, rollout index, optimizer, scheduler, the run's ``TrainConfig`` values,
- ``rng_state_<rank>.pt``: each rank's torch / CUDA / python / numpy RNG and prompt-sampler position,
- ``COMPLETE``: written last, so a checkpoint interrupted mid-write is never resumed from.
"""
from __future__ import annotations

import glob
import os
import random
import re

import torch

from .distributed import DistEnv, barrier
from .errors import UsageError

_CKPT = re.compile(r"checkpoint-(\d+)$")


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def latest_checkpoint(output_dir: str) -> str | None:
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        m = _CKPT.search(path)
        if m and os.path.isfile(os.path.join(path, "COMPLETE")):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def prune_checkpoints(output_dir: str, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (keep <= 0: keep everything)."""
    import shutil

    if keep <= 0:
        return
    found = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(output_dir, "checkpoint-*"))
                   if (m := _CKPT.search(p)) and os.path.isfile(os.path.join(p, "COMPLETE")))
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _rng_state(sampler) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "sampler": sampler.state_dict()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def save_checkpoint(path: str, *, counters: dict, model, tokenizer, optimizer, scheduler, sampler, config: dict,
                    env: DistEnv, fsdp_root=None) -> None:
    """Collective: every rank must call it (each writes its RNG state; rank 0 writes the rest).

    ``fsdp_root`` (the FSDP2-sharded GRPOPolicy around ``model``): model and optimizer state are saved sharded
    under ``sharded/`` (every rank writes its shards), and ``model/`` gets the full weights gathered to rank 0,
    so that the checkpoint is still a regular ``--model`` directory; trainer_state.pt then has no optimizer."""
    os.makedirs(path, exist_ok=True)
    torch.save(_rng_state(sampler), os.path.join(path, f"rng_state_{env.rank}.pt"))
    state_dict = None
    if fsdp_root is not None:
        from .sharding import full_lm_state_dict, save_sharded

        save_sharded(path, fsdp_root, optimizer)
        state_dict = full_lm_state_dict(fsdp_root)
    if env.is_main:
        model.save_pretrained(os.path.join(path, "model"), safe_serialization=True, state_dict=state_dict)
        tokenizer.save_pretrained(os.path.join(path, "model"))
        optimizer_state = {"optimizer": optimizer.state_dict()} if fsdp_root is None else {}  # else: sharded/
        torch.save({**counters, **optimizer_state, "scheduler": scheduler.state_dict(), "config": config,
                    "sharded": fsdp_root is not None}, os.path.join(path, "trainer_state.pt"))
    barrier(env)
    if env.is_main:
        with open(os.path.join(path, "COMPLETE"), "w") as f:
            f.write(f"{counters['step']}\n")
    barrier(env)


def resolve_resume_path(resume: str, output_dir: str) -> str:
    path = latest_checkpoint(output_dir) if resume == "latest" else resume
    if path is None:
        raise UsageError(f"--resume: no complete checkpoint-* directory in {output_dir!r}")
    if not os.path.isfile(os.path.join(path, "trainer_state.pt")) or not os.path.isdir(os.path.join(path, "model")):
        raise UsageError(f"--resume {path!r}: not a grpo.train checkpoint (no trainer_state.pt / model/)")
    return path


def load_model_weights(model, model_dir: str) -> None:
    """Load ``save_pretrained`` safetensors (sharded or not) into an already-built model, in place."""
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise UsageError(f"{model_dir!r}: no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UsageError(f"checkpoint {model_dir!r} does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def load_checkpoint(path: str, *, model, optimizer, scheduler, sampler, env: DistEnv, fsdp_root=None) -> dict:
    """Restore everything ``save_checkpoint`` wrote; returns its counters (``step``, ``rollout``). With
    ``fsdp_root`` model and optimizer come from ``sharded/`` (resharded when the world size changed)."""
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=False)
    if fsdp_root is not None:
        from .sharding import load_sharded

        load_sharded(path, fsdp_root, optimizer)
    elif state.get("sharded"):
        raise UsageError(f"--resume {path!r}: this checkpoint was saved with --fsdp (sharded optimizer state); "
                         "resume it with --fsdp, or start a new run from it with --model "
                         f"{os.path.join(path, 'model')}")
    else:
        load_model_weights(model, os.path.join(path, "model"))
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng_path = os.path.join(path, f"rng_state_{env.rank}.pt")
    if os.path.isfile(rng_path):
        rng = torch.load(rng_path, map_location="cpu", weights_only=False)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            import numpy as np
            np.random.set_state(rng["numpy"])
        sampler.load_state_dict(rng["sampler"])
    else:  # a different number of processes than the saved run: new streams for this rank
        print(f"[grpo.train] rank {env.rank}: no {os.path.basename(rng_path)} in {path}; RNG not restored")
    return {"step": int(state["step"]), "rollout": int(state.get("rollout", 0))}


RUN_FILES = ("metrics.jsonl", "curves.png", "args.json", "run_summary.json")


def prepare_output_dir(output_dir: str, *, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Refuse to mix two runs in one folder: a non-empty ``output_dir`` needs ``resume`` (continue the run in it) or
    ``overwrite`` (delete that run's files and checkpoints first; other files are left alone). Every rank checks;
    only the main rank deletes (call a barrier after)."""
    import shutil

    entries = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    if not entries or resume:
        return
    if not overwrite:
        raise UsageError(f"--output-dir {output_dir!r} is not empty ({len(entries)} entries, e.g. "
                         f"{sorted(entries)[0]!r}): pass --resume to continue its run, --overwrite to replace it, "
                         "or choose another --output-dir")
    if is_main:
        for name in entries:
            path = os.path.join(output_dir, name)
            if name in RUN_FILES:
                os.remove(path)
            elif _CKPT.search(name) and os.path.isdir(path):
                shutil.rmtree(path)
