"""Run outputs on rank 0: ``metrics.jsonl`` (one object per optimizer step), ``curves.png``, the progress bar."""
from __future__ import annotations

import json
import math
import os
import sys

from .errors import OutputError
from .run_folder import describe_os_error, warn, write_atomic

PROGRESS_KEYS = (("reward", "reward_mean", "{:.3f}"), ("kl", "kl", "{:.4f}"), ("div", "distill/divergence", "{:.4f}"),
                 ("clip", "clip_ratio", "{:.3f}"),
                 ("tok/s", "tokens_per_s", "{:.0f}"), ("tok/step", "tokens_per_step", "{:.0f}"),
                 ("pad-saved", "padding_saved", "{:.0%}"))


class MetricsLog:
    """Appends one JSON line per step, each with a single ``write`` to an unbuffered file: a line is in the file
    whole, or (the write failed midway, e.g. disk full) cut off at the end, where it is removed again when possible
    and dropped by the next resume otherwise. On resume, drops lines past the resumed step first (the file is
    rewritten atomically)."""

    def __init__(self, output_dir: str, resume_step: int | None = None):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        if resume_step is None:
            write_atomic(self.path, b"")
        elif os.path.isfile(self.path):
            records = read_metrics(self.path, warn_torn=True)
            kept = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= resume_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"cannot write {self.path}: {describe_os_error(exc)}") from exc

    def write(self, record: dict) -> None:
        data = (json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = os.write(self._fd, data)
            while written < len(data):  # a short write (the disk filled up in between): the rest, or the error
                written += os.write(self._fd, data[written:])
        except OSError as exc:
            try:  # take the torn line back out, so the file holds whole lines only
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise OutputError(f"cannot write {self.path}: {describe_os_error(exc)}") from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def read_metrics(path: str, warn_torn: bool = False) -> list[dict]:
    """The records of a metrics.jsonl. A line that is not a JSON object (a torn last line left by a full disk or
    a crash, or a damaged one) is skipped; with ``warn_torn`` each one is named in a warning line."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    records = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            if warn_torn:
                what = "a torn last line" if lineno == len(lines) else f"line {lineno}, not valid JSON"
                warn(f"{path}: dropped {what} ({len(line)} bytes)")
            continue
        records.append(record)
    return records


def plot_curves_best_effort(metrics_path: str, png_path: str, plot=None, **options) -> None:
    """``plot(metrics_path, png_path, **options)`` (default ``plot_curves``), written atomically; any failure is a
    warning line, never the end of the run."""
    tmp = os.path.join(os.path.dirname(png_path) or ".", ".curves.tmp.png")
    try:
        (plot or plot_curves)(metrics_path, tmp, **options)
        if os.path.exists(tmp):
            os.replace(tmp, png_path)
    except Exception as exc:  # noqa: BLE001 - a plot is not worth a training run
        warn(f"could not draw {png_path}: {describe_os_error(exc)}; training goes on")
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def plot_curves(metrics_path: str, png_path: str, window: int = 10, eval_label: str | None = None) -> None:
    """Reward (raw and moving average), KL and, when the run evaluates, greedy accuracy and reward on the evaluation
    set (``eval_label``: "held-out", the default, or e.g. "eval (training prompts)"), against the optimizer step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "reward_mean" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    if not train and not evals:
        return
    panels = 3 if evals else 2
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3 * panels), sharex=True)
    steps = [r["step"] for r in train]
    reward = [r.get("reward_mean") for r in train]
    axes[0].plot(steps, reward, color="tab:blue", alpha=0.35, label="reward (mean per step)")
    axes[0].plot(steps, moving_average(reward, window), color="tab:blue", label=f"moving average ({window})")
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right")
    axes[1].plot(steps, [r.get("kl") for r in train], color="tab:red", label="KL to reference")
    axes[1].set_ylabel("KL to reference")
    if any("distill/divergence" in r for r in train):  # --teacher runs: the divergence to the teacher too
        axes[1].plot(steps, [r.get("distill/divergence") for r in train], color="tab:purple",
                     label="divergence to teacher")
        axes[1].set_ylabel("KL / divergence")
        axes[1].legend(loc="upper right")
    if evals:
        eval_steps = [r["step"] for r in evals]
        label = eval_label or "held-out"
        axes[2].plot(eval_steps, [r["eval/accuracy"] for r in evals], "o-", color="tab:green",
                     label=f"{label} greedy accuracy")
        axes[2].plot(eval_steps, [r["eval/reward"] for r in evals], "s--", color="tab:olive",
                     label=f"{label} greedy reward")
        axes[2].set_ylabel("held-out eval" if label == "held-out" else label)
        axes[2].legend(loc="lower right")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    fig.suptitle("GRPO training")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def moving_average(values, window: int):
    out, acc = [], []
    for v in values:
        acc.append(float("nan") if v is None else v)
        acc = acc[-window:]
        finite = [a for a in acc if math.isfinite(a)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


class Progress:
    """tqdm bar with the key metrics, or one log line per ``log_every`` steps when disabled."""

    def __init__(self, total: int, initial: int, enabled: bool, log_every: int = 10):
        self.enabled, self.log_every = enabled, log_every
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc="grpo", dynamic_ncols=True, file=sys.stderr,
                            mininterval=0.5)

    def update(self, step: int, record: dict) -> None:
        fields = {name: fmt.format(record[key]) for name, key, fmt in PROGRESS_KEYS
                  if key in record and record[key] is not None}
        if self.bar is not None:
            self.bar.set_postfix(fields, refresh=False)
            self.bar.update(1)
        elif step % self.log_every == 0 or step == 1:
            print(f"step {step}: " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
