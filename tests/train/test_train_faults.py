"""Runs of ``python -m grpo.train`` under faults (docs/training-runs.md): a second run into a locked folder (a real
second process), two runs started together without --output-dir, kill -9 while a checkpoint is written, damaged checkpoint files falling back to the newest intact
one, pruning next to a damaged checkpoint. Tiny model, 2-3 steps per run: seconds each. Write failures, torn metrics
lines and changed settings: tests/train/test_train_faults_io.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from grpo.checkpoint import MANIFEST, verify_checkpoint
from grpo.distributed import DistEnv
from grpo.run_folder import LOCK_FILE, RunLock

from ..support.train_runs import (REPO, SAME, TINY, one_error_line, read_metrics, read_summary, fault_env,
                                 snapshot, train_tiny)

SAFETENSORS = os.path.join("model", "model.safetensors")


def _wait_for(proc, word: str) -> None:
    """Read the process's stdout up to a line ``word`` (it then waits on its stdin)."""
    for line in proc.stdout:
        if line.strip() == word:
            return
    raise AssertionError(f"the process ended (exit {proc.wait()}) before printing {word}: "
                         f"{proc.stderr.read() if proc.stderr else ''}")


def _copy(fault_runs, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(fault_runs / name, dst)
    return dst


# ------------------------------------------------------------------------------------------------- one run per folder
PAUSE_AFTER_FIRST_SAVE = """
import sys
import grpo.trainer as trainer
save = trainer.Trainer.save
def paused(self, progress):
    save(self, progress)
    if self.step == 1:
        print("PAUSED", flush=True)
        sys.stdin.readline()
trainer.Trainer.save = paused
from grpo.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_second_run_refused_while_the_first_holds_the_folder(tmp_path, capsys):
    """A real training run, paused after its first checkpoint: a second process, --overwrite and --resume into its
    folder are refused (exit 2, one line naming the holder) and change nothing; the first run then finishes
    unharmed."""
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", PAUSE_AFTER_FIRST_SAVE] + TINY +
                             ["--output-dir", str(out), "--max-steps", "2"], cwd=REPO, env=fault_env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(first, "PAUSED")
        assert (out / "checkpoint-1").is_dir()
        before = snapshot(out)
        second = subprocess.run([sys.executable, "-m", "grpo.train"] + TINY + ["--output-dir", str(out),
                                                                                "--max-steps", "2"],
                                cwd=REPO, env=fault_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        line = one_error_line(second.stderr)
        assert f"is in use by another run (pid {first.pid} on host " in line and ", started 20" in line, line
        for flag in ("--overwrite", "--resume"):
            assert train_tiny(out, 2, flag) == 2
            assert f"in use by another run (pid {first.pid}" in one_error_line(capsys.readouterr().err)
        assert snapshot(out) == before  # nothing deleted, nothing appended
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(timeout=120) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and verify_checkpoint(str(out / "checkpoint-2")) is None


def test_two_runs_started_together_into_one_folder(tmp_path):
    """Two processes started at the same moment: one trains, the other is refused (in use, or, when it starts
    after the first ended, not empty); the folder holds one run's metrics."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "grpo.train"] + TINY + ["--output-dir", str(out), "--max-steps", "2"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=fault_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for _ in range(2)]
    results = sorted((p.wait(timeout=120), p.stderr.read()) for p in procs)
    assert [code for code, _ in results] == [0, 2], results
    line = one_error_line(results[1][1])
    assert "is in use by another run" in line or "is not empty" in line, line
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.slow  # two whole processes (~40 s on a busy 2-core machine); the race itself is injected in the fast
#                    suite: test_train_runs.py::test_new_version_takes_the_next_number_atomically
def test_two_runs_started_together_without_output_dir(tmp_path):
    """Two processes started at the same moment with no --output-dir: both train, each in its own runs/version_N
    (the one it printed), neither refused."""
    cmd = [sys.executable, "-m", "grpo.train"] + TINY + ["--max-steps", "1"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=fault_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), p.stdout.read(), p.stderr.read()) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    printed = sorted(out.splitlines()[0] for _, out, _ in results)
    assert printed == [f"[grpo.train] output folder {os.path.join('runs', f'version_{n}')}" for n in (0, 1)], printed
    for n in (0, 1):
        assert [r["step"] for r in read_metrics(tmp_path / "runs" / f"version_{n}")] == [1]


@pytest.mark.slow
def test_torchrun_job_refused_while_the_folder_is_locked(tmp_path):
    """Under torchrun rank 0 takes the lock and tells the other ranks: the whole job stops (rank 0 says why,
    once), the folder is untouched."""
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], cwd=REPO, env=fault_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(holder, "LOCKED")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                               "2", "-m", "grpo.train"] + TINY + ["--output-dir", str(out), "--max-steps", "2"],
                              cwd=REPO, env=fault_env(), capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    assert proc.stderr.count("is in use by another run") == 1, proc.stderr[-4000:]
    assert sorted(os.listdir(out)) == [LOCK_FILE]


HOLD_LOCK = """
import sys
from grpo.distributed import DistEnv
from grpo.run_folder import RunLock
lock = RunLock(sys.argv[1], DistEnv()).__enter__()
print("LOCKED", flush=True)
sys.stdin.readline()
"""


def test_lock_of_a_killed_run_never_blocks(fault_runs, tmp_path, capsys):
    """The lock dies with its process (kill -9 included): the stale lock file, naming the dead pid, is no
    obstacle; other ranks of a job never take the lock themselves."""
    out = _copy(fault_runs, "two", tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], cwd=REPO, env=fault_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(holder, "LOCKED")
        assert train_tiny(out, 3, "--resume") == 2
        assert f"pid {holder.pid} on host" in capsys.readouterr().err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid  # stale content, no lock
    assert train_tiny(out, 3, "--resume") == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    with RunLock(str(tmp_path / "other"), DistEnv(rank=1)):  # not the main rank: takes nothing
        assert not (tmp_path / "other").exists()


# ------------------------------------------------------------------------------------------------- kill -9 while saving
KILL_WHILE_SAVING = """
import os, signal, sys
import grpo.checkpoint as ckpt
where = sys.argv.pop(1)
torch_save, write_text = ckpt._torch_save, ckpt._write_text
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def torch_save_then_die(obj, path):
    if where == "trainer_state" and ".checkpoint-2." in path and path.endswith("trainer_state.pt"):
        with open(path, "wb") as f:  # half a file, as a crash leaves it
            f.write(b"PK" + bytes(1000))
        die()
    torch_save(obj, path)
def write_text_then_die(path, text):
    if where == "manifest" and ".checkpoint-2." in path and path.endswith("manifest.json"):
        die()
    write_text(path, text)
ckpt._torch_save, ckpt._write_text = torch_save_then_die, write_text_then_die
from grpo.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("where", ["trainer_state", "manifest"])
def test_kill_9_while_writing_a_checkpoint_then_resume(where, fault_runs, tmp_path, capsys):
    """SIGKILL in the middle of writing checkpoint-2 (a half-written trainer_state.pt; everything written but the
    manifest): no checkpoint-2 appears, --resume continues from checkpoint-1, removes the partial folder and ends
    exactly where the uninterrupted run ends."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", KILL_WHILE_SAVING, where] + TINY +
                          ["--output-dir", str(out), "--max-steps", "3"], cwd=REPO, env=fault_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (out / ".checkpoint-2.partial").is_dir() and not (out / "checkpoint-2").exists()
    assert train_tiny(out, 3, "--resume") == 0
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in capsys.readouterr().out
    assert not (out / ".checkpoint-2.partial").exists()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    for a, b in zip(read_metrics(fault_runs / "three"), read_metrics(out)):
        assert [a[k] for k in SAME] == [b[k] for k in SAME], (a, b)
    assert read_summary(out)["param_checksums"] == read_summary(fault_runs / "three")["param_checksums"]


# ------------------------------------------------------------------------------------------------- damaged checkpoints
def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _zero_4k(path):
    with open(path, "r+b") as f:  # same size, 4 KB of zeros inside the data
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(4096))


DAMAGE = {
    "truncated-weights": (lambda c: _truncate(c / SAFETENSORS), "model/model.safetensors is "),
    "zeroed-weights": (lambda c: _zero_4k(c / SAFETENSORS), "model/model.safetensors has other content"),
    "truncated-trainer-state": (lambda c: _truncate(c / "trainer_state.pt"), "trainer_state.pt is "),
    "deleted-rng": (lambda c: os.remove(c / "rng_state_0.pt"), "rng_state_0.pt is missing"),
    "deleted-weights": (lambda c: os.remove(c / SAFETENSORS), "model/model.safetensors is missing"),
    "zeroed-manifest": (lambda c: (c / MANIFEST).write_bytes(bytes(100)), "manifest.json is unreadable"),
    "deleted-manifest": (lambda c: os.remove(c / MANIFEST), "no manifest.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(damage, fault_runs, tmp_path, capsys):
    """checkpoint-2 damaged: one warning line says what is wrong, the run resumes from checkpoint-1 and ends with
    the parameters of the uninterrupted run (it never trained on the damaged weights); checkpoint-2 is written
    again, intact."""
    out = _copy(fault_runs, "two", tmp_path)
    hurt, expected = DAMAGE[damage]
    hurt(out / "checkpoint-2")
    capsys.readouterr()
    assert train_tiny(out, 3, "--resume") == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("grpo.train: warning")]
    assert len(warnings) == 1 and "Traceback" not in captured.err, captured.err
    assert warnings[0].startswith(f"grpo.train: warning: checkpoint-2 is damaged ({expected}") and \
        warnings[0].endswith("resuming from checkpoint-1, the newest intact checkpoint"), warnings[0]
    assert f"resumed from {out / 'checkpoint-1'} at step 1" in captured.out
    assert read_summary(out)["param_checksums"] == read_summary(fault_runs / "three")["param_checksums"]
    assert all(verify_checkpoint(str(out / f"checkpoint-{s}")) is None for s in (1, 2, 3))


def test_no_intact_checkpoint_stops_with_one_line(fault_runs, tmp_path, capsys):
    out = _copy(fault_runs, "two", tmp_path)
    _zero_4k(out / "checkpoint-2" / SAFETENSORS)
    os.remove(out / "checkpoint-1" / "rng_state_0.pt")
    before = snapshot(out)
    assert train_tiny(out, 3, "--resume") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no intact checkpoint" in line and "checkpoint-2: model/model.safetensors has other content" in line \
        and "checkpoint-1: rng_state_0.pt is missing" in line, line
    # a damaged checkpoint named explicitly is refused too (no silent switch to another one)
    assert train_tiny(out, 3, "--resume", str(out / "checkpoint-2")) == 2
    assert "is damaged: model/model.safetensors has other content" in one_error_line(capsys.readouterr().err)
    assert snapshot(out) == before


def test_checkpoint_of_an_older_version_without_manifest(fault_runs, tmp_path, capsys):
    """No manifest.json (written before checkpoints were verified): not picked by --resume alone (one line says
    how), resumed unverified when named, and a damaged file in it is still one line, not a traceback."""
    out = _copy(fault_runs, "two", tmp_path)
    for step in (1, 2):
        for name in (MANIFEST, "run_settings.json"):
            os.remove(out / f"checkpoint-{step}" / name)
    assert train_tiny(out, 3, "--resume") == 2
    line = one_error_line(capsys.readouterr().err)
    assert "no manifest.json (saved by an older version" in line and "--resume PATH" in line, line
    assert train_tiny(out, 3, "--resume", str(out / "checkpoint-2")) == 0
    err = capsys.readouterr().err
    assert "checkpoint-2: no manifest.json" in err and "resuming from it unverified" in err
    assert read_summary(out)["param_checksums"] == read_summary(fault_runs / "three")["param_checksums"]
    _truncate(out / "checkpoint-1" / "trainer_state.pt")
    assert train_tiny(out, 3, "--resume", str(out / "checkpoint-1")) == 2
    assert "cannot load" in one_error_line(capsys.readouterr().err)


def test_pruning_never_deletes_the_newest_intact_checkpoint(fault_runs, tmp_path, capsys):
    """--save-total-limit 1 after a fallback past damaged checkpoints 3 and 2 to checkpoint-1: the run saves
    checkpoint-2 again (replacing the damaged one) and pruning keeps it; the damaged checkpoint-3, newer than the
    run's step, is not counted (counting it, "keep the newest one" would keep only a damaged checkpoint)."""
    out = _copy(fault_runs, "three", tmp_path)
    _truncate(out / "checkpoint-3" / SAFETENSORS)
    _zero_4k(out / "checkpoint-2" / "trainer_state.pt")
    assert train_tiny(out, 2, "--resume", "--save-total-limit", "1") == 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2",
                                                                                        "checkpoint-3"]
    assert verify_checkpoint(str(out / "checkpoint-2")) is None
    capsys.readouterr()
    assert train_tiny(out, 3, "--resume", "--save-total-limit", "1") == 0
    assert "checkpoint-3 is damaged (model/model.safetensors is" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-3"]
    assert verify_checkpoint(str(out / "checkpoint-3")) is None
    assert read_summary(out)["param_checksums"] == read_summary(fault_runs / "three")["param_checksums"]
