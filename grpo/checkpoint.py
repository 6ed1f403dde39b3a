"""Checkpoints: ``<output-dir>/checkpoint-<step>/`` holding

- ``model/``: ``save_pretrained`` weights + tokenizer (a regular ``--model`` directory for a later run),
- ``trainer_state.pt``: step, rollout index, optimizer, scheduler, the run's ``TrainConfig`` values,
- ``rng_state_<rank>.pt``: each rank's torch / CUDA / python / numpy RNG and prompt-sampler position,
- ``sharded/`` (``--fsdp`` runs): model and optimizer shards (torch.distributed.checkpoint),
- ``run_settings.json``: the settings that define the run (see grpo/run_settings.py), checked on ``--resume``,
- ``COMPLETE``, then ``manifest.json`` last: every other file with its size and SHA-256.

A checkpoint is written under a temporary name (``.checkpoint-<step>.partial``), every file and folder fsynced, and
renamed into place: a ``checkpoint-<step>`` folder is never half-written, and a crash or a full disk while saving
leaves the previous checkpoints as they were. ``--resume`` verifies the manifest before loading anything and falls
back to the newest intact checkpoint when the newest one is damaged.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re
import shutil

import torch

from .distributed import DistEnv, all_reduce_sum
from .errors import OutputError, UsageError
from .run_folder import LOCK_FILE, describe_os_error, fsync_dir, fsync_file, warn, writing

_CKPT = re.compile(r"checkpoint-(\d+)$")
_PARTIAL = re.compile(r"\.checkpoint-(\d+)\.(partial|replaced)$")
MANIFEST = "manifest.json"
SETTINGS = "run_settings.json"
NO_MANIFEST = "no manifest.json (saved by an older version, so it cannot be verified)"


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, f"checkpoint-{step}")


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every ``checkpoint-<step>`` folder, oldest first. Only a complete checkpoint gets that
    name (it is renamed into place), older versions' folders count when they have their ``COMPLETE`` marker."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(output_dir), "checkpoint-*")):
        m = _CKPT.search(path)
        if m and (os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, "COMPLETE"))):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def prune_checkpoints(output_dir: str, keep: int, current_step: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``current_step`` (the one just written, intact, is among them;
    keep <= 0: keep everything). Checkpoints past ``current_step`` (left by a resume that fell back from a
    damaged one) are not counted and not deleted here: saving their step again replaces them. So pruning never
    deletes the newest intact checkpoint for a damaged newer one."""
    if keep <= 0:
        return
    done = [(step, path) for step, path in list_checkpoints(output_dir) if step <= current_step]
    for _, path in done[:-keep]:
        with writing(path):
            shutil.rmtree(path)


def remove_partial_checkpoints(output_dir: str) -> None:
    """Delete what an interrupted save left (``.checkpoint-<step>.partial`` / ``.replaced``). Only while holding
    the run lock: then no other process is writing them."""
    for name in os.listdir(output_dir):
        if _PARTIAL.match(name):
            with writing(os.path.join(output_dir, name)):
                shutil.rmtree(os.path.join(output_dir, name))


# ------------------------------------------------------------------------------------------------ saving
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


def _torch_save(obj, path: str) -> None:
    # Through our own file object: a failing write then raises the OSError itself (ENOSPC, EROFS, ...); given a
    # path, torch's zip writer reports it as "unexpected pos 64 vs 0".
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_errors() -> tuple:
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.api import CheckpointException

    return OSError, SafetensorError, CheckpointException


def save_checkpoint(output_dir: str, step: int, *, counters: dict, model, tokenizer, optimizer, scheduler,
                    sampler, config: dict, run_settings: dict, env: DistEnv, fsdp_root=None) -> str:
    """Collective: every rank must call it (each writes its RNG state; rank 0 writes the rest). Returns the path.

    ``fsdp_root`` (the FSDP2-sharded GRPOPolicy around ``model``): model and optimizer state are saved sharded
    under ``sharded/`` (every rank writes its shards), and ``model/`` gets the full weights gathered to rank 0,
    so that the checkpoint is still a regular ``--model`` directory; trainer_state.pt then has no optimizer.

    A write failure on any rank (disk full, read-only, permission) raises ``OutputError`` on every rank, naming
    the file and the cause; the partial folder is removed and the previous checkpoints are untouched."""
    final = checkpoint_dir(output_dir, step)
    tmp = os.path.join(output_dir, f".checkpoint-{step}.partial")
    errors = _write_errors()
    failure = None
    if env.is_main:
        try:
            with writing(tmp, errors):
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        except OutputError as exc:
            failure = exc
    _raise_together(failure, env, tmp, step)
    state_dict = None
    try:
        rng_path = os.path.join(tmp, f"rng_state_{env.rank}.pt")
        with writing(rng_path, errors):
            _torch_save(_rng_state(sampler), rng_path)
        if fsdp_root is not None:  # collective: every rank writes its shards, rank 0 gets the full weights
            from .sharding import full_lm_state_dict, save_sharded

            with writing(os.path.join(tmp, "sharded"), errors):
                save_sharded(tmp, fsdp_root, optimizer)
            state_dict = full_lm_state_dict(fsdp_root)
        if env.is_main:
            model_dir = os.path.join(tmp, "model")
            with writing(model_dir, errors):
                model.save_pretrained(model_dir, safe_serialization=True, state_dict=state_dict)
                tokenizer.save_pretrained(model_dir)
            optimizer_state = {"optimizer": optimizer.state_dict()} if fsdp_root is None else {}  # else: sharded/
            state_path = os.path.join(tmp, "trainer_state.pt")
            with writing(state_path, errors):
                _torch_save({**counters, **optimizer_state, "scheduler": scheduler.state_dict(), "config": config,
                             "sharded": fsdp_root is not None}, state_path)
    except OutputError as exc:
        failure = exc
    _raise_together(failure, env, tmp, step)
    if env.is_main:
        try:
            with writing(final, errors):
                _seal(tmp, step, run_settings)
                if os.path.isdir(final):  # the same step saved again (after a resume from an older checkpoint)
                    replaced = os.path.join(output_dir, f".checkpoint-{step}.replaced")
                    shutil.rmtree(replaced, ignore_errors=True)
                    os.rename(final, replaced)
                    os.rename(tmp, final)
                    shutil.rmtree(replaced)
                else:
                    os.rename(tmp, final)
                fsync_dir(output_dir)
        except OutputError as exc:
            failure = exc
    _raise_together(failure, env, tmp, step)
    return final


def _seal(folder: str, step: int, run_settings: dict) -> None:
    """run_settings.json and COMPLETE, fsync of every file and folder, then manifest.json (fsynced) last."""
    _write_text(os.path.join(folder, SETTINGS), json.dumps(run_settings, indent=2, default=str))
    _write_text(os.path.join(folder, "COMPLETE"), f"{step}\n")
    files = {}
    for rel in _files(folder):
        path = os.path.join(folder, rel)
        with writing(path):
            fsync_file(path)
        files[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    for root, _, _ in os.walk(folder):
        with writing(root):
            fsync_dir(root)
    _write_text(os.path.join(folder, MANIFEST), json.dumps({"format": 1, "step": step, "files": files}, indent=1))
    with writing(folder):
        fsync_dir(folder)


def _write_text(path: str, text: str) -> None:
    with writing(path):
        with open(path, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def _raise_together(failure: OutputError | None, env: DistEnv, tmp: str, step: int) -> None:
    """Every rank stops when one of them could not write (else the others would wait in the next collective)."""
    failed = failure is not None
    if env.enabled:
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=env.device)
        failed = int(all_reduce_sum(flag, env).item()) > 0
    if failed:
        if env.is_main:  # free the space the partial checkpoint took; the previous checkpoints stay
            shutil.rmtree(tmp, ignore_errors=True)
        message = str(failure) if failure else f"cannot write {tmp}: another rank failed to write its part"
        raise OutputError(f"{message}; checkpoint-{step} was not saved (the earlier checkpoints are intact)")


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            out.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(p for p in out if p != MANIFEST)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ verifying
def verify_checkpoint(path: str) -> str | None:
    """None when every file the manifest lists is there with its size and SHA-256; else what is wrong (the first
    problem found, e.g. 'model/model.safetensors is 1024 bytes, the manifest says 30568')."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        return NO_MANIFEST
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
        items = [(rel, int(meta["size"]), str(meta["sha256"])) for rel, meta in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({describe_os_error(exc)})"
    required = {"trainer_state.pt", os.path.join("model", "config.json"), "rng_state_0.pt", SETTINGS}
    unlisted = sorted(required - {rel for rel, _, _ in items})
    if unlisted:
        return f"{MANIFEST} does not list {unlisted[0]}"
    for rel, size, digest in items:
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{rel} is {actual} bytes, the manifest says {size}"
        if _sha256(full) != digest:
            return f"{rel} has other content than when it was saved (SHA-256 differs)"
    return None


def select_resume_checkpoint(resume: str, output_dir: str, env: DistEnv) -> str:
    """The checkpoint to resume from: ``resume`` itself (a path: it must be intact), or for "latest" the newest
    intact checkpoint in ``output_dir``, with one warning line per damaged newer one skipped. Rank 0 verifies (it
    reads every file once); all ranks get its answer. No intact checkpoint: UsageError (one line)."""
    choice, failure = -1, None
    found = list_checkpoints(output_dir) if resume == "latest" else []
    if env.is_main:
        try:
            choice = _select(resume, output_dir, found)
        except UsageError as exc:
            failure = exc
    if env.enabled:
        value = torch.tensor([choice + 1 if env.is_main else 0], dtype=torch.int64, device=env.device)
        choice = int(all_reduce_sum(value, env).item()) - 1
    if failure is not None or choice < 0:
        raise failure or UsageError(f"--resume: rank 0 found no checkpoint to resume from in {output_dir!r}")
    return resume if resume != "latest" else found[choice][1]


def _select(resume: str, output_dir: str, found: list[tuple[int, str]]) -> int:
    """Index into ``found`` ("latest"), or 0 for an explicit path (raises when it is not intact)."""
    if resume != "latest":
        _check_is_checkpoint(resume)
        problem = verify_checkpoint(resume)
        if problem == NO_MANIFEST:  # an older version's checkpoint: the user named it, so load it, said once
            warn(f"{resume}: {problem}; resuming from it unverified")
        elif problem is not None:
            raise UsageError(f"--resume {resume!r} is damaged: {problem}; pass --resume without a path to use the "
                             "newest intact checkpoint, or another checkpoint folder")
        return 0
    if not found:
        raise UsageError(f"--resume: no complete checkpoint-* directory in {output_dir!r}")
    problems = []
    for index in range(len(found) - 1, -1, -1):
        path = found[index][1]
        problem = verify_checkpoint(path)
        if problem is None:
            _check_is_checkpoint(path)
            for skipped, why in problems:
                warn(f"{skipped} is damaged ({why}); resuming from {os.path.basename(path)}, the newest intact "
                     "checkpoint")
            return index
        problems.append((os.path.basename(path), problem))
    detail = "; ".join(f"{name}: {why}" for name, why in problems)
    hint = " (an older version's checkpoint can be resumed unverified with --resume PATH)" \
        if any(why == NO_MANIFEST for _, why in problems) else ""
    raise UsageError(f"--resume: no intact checkpoint in {output_dir!r} ({detail}){hint}")


def _check_is_checkpoint(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "trainer_state.pt")) or not os.path.isdir(os.path.join(path, "model")):
        raise UsageError(f"--resume {path!r}: not a grpo.train checkpoint (no trainer_state.pt / model/)")


def read_run_settings(path: str) -> dict | None:
    """What ``save_checkpoint`` recorded about the run (``run_settings.json``); for an older version's checkpoint
    the TrainConfig values in its trainer_state.pt; None when neither is there."""
    settings = os.path.join(path, SETTINGS)
    try:
        if os.path.isfile(settings):
            with open(settings) as f:
                return json.load(f)
        state = _load_torch(os.path.join(path, "trainer_state.pt"))
        return {"config": state["config"]} if isinstance(state.get("config"), dict) else None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume {path!r}: cannot read its run settings: {describe_os_error(exc)}") from None


# ------------------------------------------------------------------------------------------------ loading
def _load_torch(path: str):
    # Verified checkpoints load; this turns what an unverifiable (older) one may hold into one line.
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - pickle / zip / EOF errors of a damaged file
        raise UsageError(f"cannot load {path}: {describe_os_error(exc)}") from None


def load_model_weights(model, model_dir: str) -> None:
    """Load ``save_pretrained`` safetensors (sharded or not) into an already-built model, in place."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if not files:
        raise UsageError(f"{model_dir!r}: no *.safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError) as exc:
            raise UsageError(f"cannot load {f}: {describe_os_error(exc)}") from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that differ
        raise UsageError(f"checkpoint {model_dir!r} does not match the model: {describe_os_error(exc)}") from None
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UsageError(f"checkpoint {model_dir!r} does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def load_checkpoint(path: str, *, model, optimizer, scheduler, sampler, env: DistEnv, fsdp_root=None) -> dict:
    """Restore everything ``save_checkpoint`` wrote; returns its counters (``step``, ``rollout``). With
    ``fsdp_root`` model and optimizer come from ``sharded/`` (resharded when the world size changed)."""
    state = _load_torch(os.path.join(path, "trainer_state.pt"))
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
        rng = _load_torch(rng_path)
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        if "numpy" in rng:
            import numpy as np
            np.random.set_state(rng["numpy"])
        sampler.load_state_dict(rng["sampler"])
    else:  # more processes than the saved run (the manifest lists every file it saved): new streams for this rank
        print(f"[grpo.train] rank {env.rank}: no {os.path.basename(rng_path)} in {path} (saved by fewer "
              "processes); its RNG streams start fresh")
    return {"step": int(state["step"]), "rollout": int(state.get("rollout", 0))}


# ------------------------------------------------------------------------------------------------ run folder
RUN_FILES = ("metrics.jsonl", "curves.png", "args.json", "run_summary.json")


def prepare_output_dir(output_dir: str, *, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Refuse to mix two runs in one folder: a non-empty ``output_dir`` needs ``resume`` (continue the run in it) or
    ``overwrite`` (delete that run's files and checkpoints first; other files are left alone). The run lock file
    does not count. Every rank checks; only the main rank deletes (call a barrier after)."""
    if output_dir is None:
        raise UsageError("a Trainer needs a run folder (output_dir): grpo.train.train chooses a new runs/version_N "
                         "when it is None")
    entries = [e for e in (os.listdir(output_dir) if os.path.isdir(output_dir) else []) if e != LOCK_FILE]
    if not entries or resume:
        return
    if not overwrite:
        raise UsageError(f"--output-dir {output_dir!r} is not empty ({len(entries)} entries, e.g. "
                         f"{sorted(entries)[0]!r}): pass --resume to continue its run, --overwrite to replace it, "
                         "or choose another --output-dir")
    if is_main:
        for name in entries:
            path = os.path.join(output_dir, name)
            with writing(path):
                if name in RUN_FILES:
                    os.remove(path)
                elif (_CKPT.search(name) or _PARTIAL.match(name)) and os.path.isdir(path):
                    shutil.rmtree(path)
