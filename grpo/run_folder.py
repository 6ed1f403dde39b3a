"""The run folder (``--output-dir``): one run at a time, files written whole or not at all, write failures in one line.

- ``RunLock``: an exclusive advisory lock (``fcntl.flock``) on ``<output-dir>/run.lock``, taken by the main rank
  before anything else is written into the folder and held until the run ends. The lock file holds the holder's
  pid, host and start time, so that a refused run can name it. The kernel drops a flock when its process ends,
  however it ends (kill -9 included), so a lock file left by a dead run never blocks; the file itself stays.
- ``write_atomic``: a temporary file in the same folder, fsync, rename over the target, fsync of the folder: a reader
  (or a resume after a crash) sees the old file or the new one, never half of one.
- ``writing``: turns an ``OSError`` while writing a file of the run into ``OutputError`` naming the file and the
  cause (``cannot write runs/x/args.json: No space left on device (ENOSPC)``): grpo.train prints it as one line.
- ``default_output_dir``: the folder of a run given no ``--output-dir``: a new ``runs/version_N`` (N one more than
  the largest there, made with one atomic ``mkdir``, so two runs starting together never share one), or with
  ``--resume`` the run folder to continue; rank 0 decides, every rank of a torchrun job gets its answer.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import re
import socket
import sys
import time

from .distributed import DistEnv, all_reduce_sum
from .errors import OutputError, UsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: runs are not locked (said once, when a run starts)
    fcntl = None

LOCK_FILE = "run.lock"
RUNS_ROOT = "runs"  # where runs without --output-dir go: runs/version_0, runs/version_1, ...
_VERSION = re.compile(r"version_(\d+)")


def describe_os_error(exc: BaseException) -> str:
    """'No space left on device (ENOSPC)' for an OSError; the first line of the message for anything else."""
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        return f"{exc.strerror or os.strerror(exc.errno)} ({errno.errorcode[exc.errno]})"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextlib.contextmanager
def writing(path: str, errors: tuple = (OSError,)):
    """Inside: an error of type ``errors`` becomes ``OutputError('cannot write <file>: <cause>')``; the file is the
    one the OSError names when it names one (a file inside ``path``), else ``path``."""
    try:
        yield
    except OutputError:
        raise
    except errors as exc:
        name = getattr(exc, "filename", None) or path
        raise OutputError(f"cannot write {name}: {describe_os_error(exc)}") from exc


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on a directory; the rename itself is still atomic
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temporary file, fsync, rename, fsync of the folder); on failure
    the previous file is untouched, the temporary one removed, and ``OutputError`` names ``path``."""
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    payload = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(folder)
    except OSError as exc:  # named by the file the user knows, not the temporary one
        raise OutputError(f"cannot write {path}: {describe_os_error(exc)}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def write_json(path: str, value) -> None:
    write_atomic(path, json.dumps(value, indent=2, default=str) + "\n")


def warn(message: str) -> None:
    """One warning line on stderr (main rank only: the caller decides)."""
    print(f"grpo.train: warning: {message}", file=sys.stderr, flush=True)


class RunLock:
    """Context manager: the exclusive lock of one run folder. Only the main rank takes it (the other ranks of a
    torchrun job belong to the same run); every rank learns whether it got it, so that all of them stop together
    when the folder is in use. Raises UsageError naming the holder, or OutputError when the folder or the lock file
    cannot be written."""

    def __init__(self, output_dir: str, env: DistEnv):
        self.output_dir, self.env = output_dir, env
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd = None

    def __enter__(self) -> "RunLock":
        failure = None
        if self.env.is_main:
            try:
                self._fd = self._lock()
            except (UsageError, OutputError) as exc:
                failure = exc
        if self.env.enabled:  # rank 0 says whether it holds the lock: 0 yes, 1 in use, 2 cannot write
            import torch

            code = 0 if failure is None else (1 if isinstance(failure, UsageError) else 2)
            flag = torch.tensor([code if self.env.is_main else 0], dtype=torch.int64, device=self.env.device)
            code = int(all_reduce_sum(flag, self.env).item())
            if failure is None and code:
                failure = (UsageError if code == 1 else OutputError)(
                    f"--output-dir {self.output_dir!r}: rank 0 could not lock the run folder")
        if failure is not None:
            raise failure
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            # The file stays: deleting it would let a third process lock a new file while a second one still
            # waits on the old inode. Closing the descriptor drops the flock.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _lock(self) -> int | None:
        with writing(self.output_dir):
            os.makedirs(self.output_dir, exist_ok=True)
        if fcntl is None:  # pragma: no cover
            warn("this system has no fcntl.flock: the run folder is not locked against a second run")
            return None
        with writing(self.path):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise OutputError(f"cannot lock {self.path}: {describe_os_error(exc)}") from exc
            holder = _read_holder(fd)
            os.close(fd)
            raise UsageError(f"--output-dir {self.output_dir!r} is in use by another run ({holder}; lock file "
                             f"{self.path}): wait for it to end, or choose another --output-dir") from None
        started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started,
                           "command": " ".join(sys.argv)}) + "\n"
        try:
            with writing(self.path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, info.encode(), 0)
                os.fsync(fd)
        except OutputError:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise
        return fd


def _read_holder(fd: int) -> str:
    """'pid 123 on host h, started 2026-12-01 17:00:00 UTC' from a locked file. The holder writes it right after
    taking the lock: give it a moment while the file is still empty."""
    text = ""
    for _ in range(10):
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        try:
            info = json.loads(text)
            return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
        except (ValueError, KeyError, TypeError):
            time.sleep(0.1)
    return "holder not recorded yet"


# ------------------------------------------------------------------------------------------------ runs/version_N
def run_versions(root: str = RUNS_ROOT) -> list[int]:
    """The N of every ``<root>/version_N`` folder, ascending (none when ``root`` does not exist)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    matches = [_VERSION.fullmatch(name) for name in names]
    return sorted(int(m.group(1)) for m in matches if m and os.path.isdir(os.path.join(root, m.group(0))))


def version_dir(n: int, root: str = RUNS_ROOT) -> str:
    return os.path.join(root, f"version_{n}")


def new_version(root: str = RUNS_ROOT) -> int:
    """Makes a new, empty ``<root>/version_N`` and returns N, one more than the largest there (0 for the first).
    ``os.mkdir`` is atomic: of two runs that pick the same N at once, one makes the folder and the other, refused
    (``FileExistsError``), takes the next N. Raises OutputError when ``root`` cannot be written."""
    with writing(root):
        os.makedirs(root, exist_ok=True)
    found = run_versions(root)
    n = found[-1] + 1 if found else 0
    while True:
        path = version_dir(n, root)
        try:
            os.mkdir(path)
        except FileExistsError:  # another run took it first (or a file has that name): the next one
            n += 1
            continue
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {describe_os_error(exc)}") from exc
        return n


def default_output_dir(resume: str | None, env: DistEnv, root: str = RUNS_ROOT) -> str:
    """The run folder of a run given no ``--output-dir``, printed by the main rank:

    - no ``--resume``: a new ``<root>/version_N`` (``new_version``);
    - ``--resume`` (the newest checkpoint): the newest ``<root>/version_N`` that holds a complete checkpoint;
    - ``--resume PATH``: the folder holding that checkpoint (the run it belongs to).

    Only rank 0 looks at ``root`` and makes the folder; the other ranks of a torchrun job get its N in one
    all-reduce before any of them goes on, so all of them use the same folder, or all stop (UsageError: no run to
    resume; OutputError: ``root`` cannot be written; rank 0 raises the one that names the cause)."""
    if resume is not None and resume != "latest":
        path = os.path.dirname(os.path.normpath(resume)) or "."
        _say(env, f"output folder {path} (the folder of --resume {resume})")
        return path
    code, failure = 0, None  # code: N + 1; 0: no run to resume; -1: cannot write
    if env.is_main:
        try:
            code = 1 + (_newest_with_checkpoint(root) if resume == "latest" else new_version(root))
        except (UsageError, OutputError) as exc:
            failure, code = exc, (0 if isinstance(exc, UsageError) else -1)
    if env.enabled:
        import torch

        flag = torch.tensor([code if env.is_main else 0], dtype=torch.int64, device=env.device)
        code = int(all_reduce_sum(flag, env).item())
    if failure is not None or code <= 0:
        raise failure or (UsageError if code == 0 else OutputError)(
            f"rank 0 could not choose a run folder in {root!r} (no --output-dir)")
    path = version_dir(code - 1, root)
    _say(env, f"output folder {path}" + (" (--resume: the newest run folder with a checkpoint)" if resume else ""))
    return path


def _newest_with_checkpoint(root: str) -> int:
    from .checkpoint import list_checkpoints  # checkpoint.py builds on this module

    for n in reversed(run_versions(root)):
        if list_checkpoints(version_dir(n, root)):
            return n
    raise UsageError(f"--resume without --output-dir continues the newest {root}/version_N holding a checkpoint, "
                     f"and no {root}/version_N folder holds one: pass --output-dir DIR to resume the run in DIR")


def _say(env: DistEnv, message: str) -> None:
    if env.is_main:
        print(f"[grpo.train] {message}", flush=True)
