"""What makes a run *the same run*: every checkpoint records it, and ``--resume`` refuses to continue with another.

Recorded (``run_settings.json`` in each checkpoint):

- ``config``: every TrainConfig value (the loss options flattened, as in args.json);
- ``identity``: content fingerprints of what the options point at: the initial model weights (a strided sample of
  every tensor, so a moved folder is the same model and another fine-tune is not), the tokenizer (vocabulary,
  special tokens, chat template), the training rows and the held-out rows (after the split), and the ``--teacher``'s
  weights (None without one);
- ``world_size``.

On resume every config value and every fingerprint must match, except the settings that are safe to change
(``SAFE_TO_CHANGE``: how long to train, how often to log, evaluate and save, where the files are, and how the same
computation is executed). Unknown keys count as run-defining. The initial weights matter even though the
checkpoint's weights replace them: with ``beta != 0`` they are the frozen KL reference, rebuilt at every start.
A fingerprint the checkpoint did not record (an older version's) is not compared, except a teacher's: a run saved
without a teacher does not resume with one.
"""
from __future__ import annotations

import hashlib
import json

import torch

from .errors import UsageError

# Changing one of these on --resume continues the same run (recorded in args.json and in the next checkpoints).
SAFE_TO_CHANGE = frozenset({
    # length of the run and of its learning-rate schedule, cadence of logging / evaluation / saving
    "max_steps", "save_steps", "save_total_limit", "eval_every", "progress",
    # where the files are (their content is fingerprinted in ``identity``), how to start
    "output_dir", "resume", "overwrite", "model", "dataset", "eval_dataset", "teacher", "trust_remote_code",
    # execution of the same computation (the checkpoint's own checks refuse an --fsdp mismatch)
    "device", "impl", "attn_implementation", "liger_layers", "gradient_checkpointing", "micro_batch_size", "fsdp",
    "fsdp_grad_sync", "packing", "max_tokens_per_micro_batch", "single_pass",
    # a loss option earlier versions of grpo.train exposed (--capturable, now refused): the same loss, computed
    # over the padded rows too; a run saved with it resumes without it, and the resume line says so
    "capturable",
})
SAMPLE = 4096  # elements hashed per tensor: spread over the whole tensor, cheap for any model size


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over every tensor's name, shape, dtype and ``SAMPLE`` evenly spaced values."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // SAMPLE)][:SAMPLE]
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(sample.to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    extra = [list(getattr(tokenizer, "all_special_tokens", [])), getattr(tokenizer, "chat_template", None),
             getattr(tokenizer, "padding_side", None)]
    return _sha256_json([vocab, extra])


def rows_fingerprint(rows: list[dict]) -> str:
    return _sha256_json(rows)


def _sha256_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def describe(config: dict, *, weights: str, tokenizer, train_rows: list[dict], eval_rows: list[dict],
             world_size: int, teacher: str | None = None) -> dict:
    """The record of this run; ``weights``: the ``weights_fingerprint`` of the model as built (before a
    checkpoint's weights are loaded into it); ``teacher``: the teacher's, as loaded (None: no teacher)."""
    return {"config": _plain(config), "world_size": world_size,
            "identity": {"model_weights": weights, "tokenizer": tokenizer_fingerprint(tokenizer),
                         "train_rows": rows_fingerprint(train_rows), "eval_rows": rows_fingerprint(eval_rows),
                         "teacher_weights": teacher}}


def _plain(config: dict) -> dict:
    """JSON round-trip, so that values compare alike whether they come from a file or from TrainConfig."""
    return json.loads(json.dumps(config, default=str))


def _short(fingerprint: str | None) -> str:
    return "none" if fingerprint is None else fingerprint[:12]


def compare(saved: dict | None, current: dict, checkpoint: str) -> dict[str, tuple]:
    """Raise UsageError (one line, old -> new per setting) when ``current`` is another run than ``saved``; return
    the safe settings that changed ({name: (old, new)}). Keys the checkpoint did not record (older versions) are
    not compared."""
    if saved is None:
        return {}
    old_cfg, new_cfg = saved.get("config") or {}, current["config"]
    refused, allowed = [], {}
    for key in sorted(set(old_cfg) & set(new_cfg) - {"resume", "overwrite"}):  # how to start, not the run
        old, new = _plain(old_cfg[key]), new_cfg[key]
        if old == new:
            continue
        if key in SAFE_TO_CHANGE:
            allowed[key] = (old, new)
        else:
            refused.append(f"{key} {old!r} -> {new!r}")
    old_ids, new_ids = saved.get("identity") or {}, current["identity"]
    if "teacher_weights" not in old_ids:  # saved before --teacher existed: a run without a teacher
        old_ids = {**old_ids, "teacher_weights": None}
    for key in sorted(set(old_ids) & set(new_ids)):
        if old_ids[key] != new_ids[key]:
            refused.append(f"{key} sha256 {_short(old_ids[key])} -> {_short(new_ids[key])}")
    if saved.get("world_size") not in (None, current["world_size"]):
        allowed["world_size"] = (saved["world_size"], current["world_size"])
    if refused:
        raise UsageError(f"--resume {checkpoint!r} was saved by another run setup: {'; '.join(refused)}; resume "
                         "with the saved values (only --max-steps, --eval-every, --save-steps, --save-total-limit "
                         "and how it runs, e.g. --device or --micro-batch-size, may change), or start a new run "
                         "in another --output-dir")
    return allowed
