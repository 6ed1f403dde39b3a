"""Write failures and resumes of another run setup (docs/training-runs.md): disk full / read-only / no permission on
every writer of ``python -m grpo.train`` (injected: a writer raising the OSError; and one real "file too large"),
a torn metrics line, changed run settings refused, safe ones allowed and recorded, a "nothing to do" resume.
"""
from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

import grpo.checkpoint
import grpo.metrics
import grpo.run_folder
from grpo.checkpoint import verify_checkpoint

from ..support.train_runs import (REPO, SAME, TINY, one_error_line, read_metrics, read_summary, fault_env,
                                 snapshot, train_tiny)

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
NOT_SAVED = "checkpoint-2 was not saved (the earlier checkpoints are intact)"


def _checkpoints(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint") or ".partial" in p.name)


def _fail_on(monkeypatch, module, name, match, error=ENOSPC):
    """``module.name(path, ...)`` raises ``error`` (after writing a few bytes, as a full disk does) when
    ``match(path)``."""
    real = getattr(module, name, None) or getattr(builtins, name)

    def failing(*args, **kwargs):
        path = str(args[0] if name == "open" else args[1])  # open(path, ...), the others (obj, path, ...)
        if match(path):
            if name == "_torch_save":
                with open(path, "wb") as f:
                    f.write(b"PK\x03\x04")
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing, raising=name != "open")


def _resume_finishes_like_the_uninterrupted_run(out, fault_runs, capsys):
    capsys.readouterr()
    assert train_tiny(out, 3, "--resume") == 0, capsys.readouterr().err
    for a, b in zip(read_metrics(fault_runs / "three"), read_metrics(out)):
        assert [a[k] for k in SAME] == [b[k] for k in SAME], (a, b)
    assert read_summary(out)["param_checksums"] == read_summary(fault_runs / "three")["param_checksums"]


# ------------------------------------------------------------------------------------------------- write failures
def test_disk_full_while_writing_the_trainer_state(fault_runs, tmp_path, monkeypatch, capsys):
    """One line naming the file and the cause, exit 1; checkpoint-1 intact, no partial folder; the resume then
    loses nothing (it ends where the uninterrupted run ends)."""
    out = tmp_path / "run"
    _fail_on(monkeypatch, grpo.checkpoint, "_torch_save", lambda p: ".checkpoint-2." in p and "trainer_state" in p)
    assert train_tiny(out, 3) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line == (f"grpo.train: error: cannot write {out}/.checkpoint-2.partial/trainer_state.pt: No space left "
                    f"on device (ENOSPC); {NOT_SAVED}"), line
    assert _checkpoints(out) == ["checkpoint-1"] and verify_checkpoint(str(out / "checkpoint-1")) is None
    monkeypatch.undo()
    _resume_finishes_like_the_uninterrupted_run(out, fault_runs, capsys)


def test_disk_full_while_writing_the_weights(fault_runs, tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk with its own exception type: still one line."""
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    out = tmp_path / "run"
    error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    _fail_on(monkeypatch, mu, "safe_save_file", lambda p: ".checkpoint-2." in p, error)
    assert train_tiny(out, 3) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write {out}/.checkpoint-2.partial/model: " in line and "No space left on device" in line \
        and line.endswith(NOT_SAVED), line
    assert _checkpoints(out) == ["checkpoint-1"] and verify_checkpoint(str(out / "checkpoint-1")) is None


def test_disk_full_while_appending_a_metrics_line(fault_runs, tmp_path, monkeypatch, capsys):
    """The third line is cut off by a full disk: one line, exit 1, and the file keeps whole lines only."""
    out = tmp_path / "run"
    real_write, calls = os.write, []

    def write(fd, data):
        if fd > 2 and data.startswith(b'{"step": ') and len(calls) < 3:
            calls.append(fd)
            if len(calls) == 3:
                real_write(fd, data[:20])  # part of the line made it to the disk, then it was full
                raise ENOSPC
        return real_write(fd, data)

    monkeypatch.setattr(grpo.metrics.os, "write", write)
    assert train_tiny(out, 3) == 1
    assert one_error_line(capsys.readouterr().err) == \
        f"grpo.train: error: cannot write {out}/metrics.jsonl: No space left on device (ENOSPC)"
    assert (out / "metrics.jsonl").read_text().endswith("}\n") and [r["step"] for r in read_metrics(out)] == [1, 2]
    assert _checkpoints(out) == ["checkpoint-1", "checkpoint-2"]  # step 3's line failed before its checkpoint
    monkeypatch.undo()
    _resume_finishes_like_the_uninterrupted_run(out, fault_runs, capsys)


@pytest.mark.parametrize("name, error, cause", [
    ("args.json", OSError(errno.EROFS, os.strerror(errno.EROFS)), "Read-only file system (EROFS)"),
    ("run_summary.json", OSError(errno.EACCES, os.strerror(errno.EACCES)), "Permission denied (EACCES)"),
])
def test_write_failure_of_args_or_summary(name, error, cause, fault_runs, tmp_path, monkeypatch, capsys):
    """args.json (written first: nothing else happens) and run_summary.json (written last: the checkpoints are all
    there, and a later --resume writes the missing summary)."""
    out = tmp_path / "run"
    _fail_on(monkeypatch, grpo.run_folder, "open", lambda p: p.endswith(f".{name}.tmp"), error)
    assert train_tiny(out, 2) == 1
    assert one_error_line(capsys.readouterr().err) == f"grpo.train: error: cannot write {out}/{name}: {cause}"
    assert not (out / name).exists() and not (out / f".{name}.tmp").exists()
    monkeypatch.undo()
    if name == "args.json":
        assert _checkpoints(out) == []
        return
    assert _checkpoints(out) == ["checkpoint-1", "checkpoint-2"]
    assert train_tiny(out, 2, "--resume") == 0
    assert "wrote the missing" in capsys.readouterr().out
    assert read_summary(out)["written_on_resume"] is True
    assert read_summary(out)["param_checksums"] == read_summary(fault_runs / "two")["param_checksums"]


def test_plot_failure_is_a_warning(tmp_path, monkeypatch, capsys):
    import grpo.trainer

    def broken_plot(metrics_path, png_path, **options):
        raise ENOSPC

    monkeypatch.setattr(grpo.trainer, "plot_curves", broken_plot)
    out = tmp_path / "run"
    assert train_tiny(out, 2) == 0
    err = capsys.readouterr().err
    assert f"grpo.train: warning: could not draw {out}/curves.png: No space left on device (ENOSPC); training " \
           "goes on" in err and "error" not in err, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and (out / "run_summary.json").exists()


def test_a_real_write_failure_from_the_operating_system(tmp_path):
    """No injection: the process may not write files over 40 KB (RLIMIT_FSIZE), so the kernel fails the write of
    trainer_state.pt (EFBIG) inside torch.save. One line, exit 1."""
    out = tmp_path / "run"
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))\n"
            "from grpo.train import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    proc = subprocess.run([sys.executable, "-c", code] + TINY + ["--output-dir", str(out), "--max-steps", "2"],
                          cwd=REPO, env=fault_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith(f"grpo.train: error: cannot write {out}/.checkpoint-1.partial/trainer_state.pt: File too "
                           "large (EFBIG); checkpoint-1 was not saved"), line
    assert _checkpoints(out) == []


# ------------------------------------------------------------------------------------------------- metrics on resume
def test_torn_last_metrics_line_is_dropped_on_resume(fault_runs, tmp_path, capsys):
    out = tmp_path / "two"
    shutil.copytree(fault_runs / "two", out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout": 2, "rew')
    assert train_tiny(out, 3, "--resume") == 0
    err = capsys.readouterr().err
    assert f"grpo.train: warning: {out}/metrics.jsonl: dropped a torn last line (30 bytes)" in err, err
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


# ------------------------------------------------------------------------------------------------- same run on resume
@pytest.mark.parametrize("flags, listed", [
    (["--seed", "4"], "seed 3 -> 4"),
    (["-G", "4"], "num_generations 2 -> 4"),
    (["--hidden-size", "32"], "hidden_size 16 -> 32"),
    (["--beta", "0.5"], "beta 0.02 -> 0.5"),
    (["--loss-type", "grpo"], "loss_type 'dapo' -> 'grpo'"),
    (["--reward", "copy", "--reward", "format"], "rewards ['copy'] -> ['copy', 'format']"),
    (["--eval-size", "4"], "eval_size 0 -> 4"),
], ids=["seed", "G", "hidden-size", "beta", "loss-type", "rewards", "eval-size"])
def test_resume_with_another_run_setup_is_refused(flags, listed, fault_runs, tmp_path, capsys):
    out = tmp_path / "two"
    shutil.copytree(fault_runs / "two", out)
    before = snapshot(out)
    assert train_tiny(out, 3, "--resume", *flags) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"--resume '{out}/checkpoint-2' was saved by another run setup: " in line and listed in line, line
    assert snapshot(out) == before


def test_dataset_content_is_part_of_the_run(tmp_path, capsys):
    """Same file name, other rows: refused (the rows' fingerprint differs). Same rows under another path: the same
    run (moved data is fine)."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    opts = ["--dataset", str(data), "--completion-chars", "0123456789", "--max-new-tokens", "2"]
    assert train_tiny(out, 1, *opts) == 0
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
    assert train_tiny(out, 2, "--resume", *opts) == 2
    assert "train_rows sha256 " in one_error_line(capsys.readouterr().err)
    moved = tmp_path / "moved.jsonl"
    moved.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train_tiny(out, 2, "--resume", *opts[:1], str(moved), *opts[2:]) == 0
    assert json.loads((out / "args.json").read_text())["resumed"]["changed"]["dataset"] == [str(data), str(moved)]


def test_safe_changes_are_allowed_and_recorded(fault_runs, tmp_path, capsys):
    out = tmp_path / "two"
    shutil.copytree(fault_runs / "two", out)
    assert train_tiny(out, 3, "--resume", "--save-total-limit", "2", "--eval-every", "7",
                      "--micro-batch-size", "2") == 0
    printed = capsys.readouterr().out
    assert "[grpo.train] resume: max_steps changed from 2 to 3" in printed
    changed = json.loads((out / "args.json").read_text())["resumed"]["changed"]
    assert changed == {"max_steps": [2, 3], "save_total_limit": [0, 2], "eval_every": [50, 7],
                       "micro_batch_size": [4, 2], "output_dir": [str(fault_runs / "two"), str(out)]}  # a copied run
    saved = json.loads((out / "checkpoint-3" / "run_settings.json").read_text())["config"]
    assert (saved["max_steps"], saved["save_total_limit"], saved["eval_every"]) == (3, 2, 7)
    assert [p.name for p in sorted(out.iterdir()) if p.name.startswith("checkpoint")] == ["checkpoint-2",
                                                                                          "checkpoint-3"]


def test_nothing_to_do_changes_no_file(fault_runs, tmp_path, capsys):
    """A finished run resumed: every file byte for byte the same (args.json is not rewritten with the new command);
    without its run_summary.json (killed after the last checkpoint) the resume writes that one file."""
    out = tmp_path / "two"
    shutil.copytree(fault_runs / "two", out)
    before = snapshot(out)
    assert train_tiny(out, 2, "--resume", "--eval-every", "9") == 0
    assert "nothing to do" in capsys.readouterr().out and snapshot(out) == before
    os.remove(out / "run_summary.json")
    assert train_tiny(out, 2, "--resume") == 0
    after = snapshot(out)
    assert json.loads(after.pop("run_summary.json"))["steps"] == 2 and after == {
        k: v for k, v in before.items() if k != "run_summary.json"}
