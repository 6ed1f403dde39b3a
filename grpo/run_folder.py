"""The run folder (``--output-dir``): one run at a time, files written whole or not at all, write failures in one line.

- ``RunLock``: an exclusive advisory lock (``fcntl.flock``) on ``<output-dir>/run.lock``, taken by the main rank
  before anything else is written into the folder and held until the run ends. The lock file holds the holder's
  pid, host and start time, so that a refused run can name it. The kernel drops a flock when its process ends,
  however it ends (kill -9 included), so a lock file left by a dead run never blocks; the file itself stays.
- ``write_atomic``: a temporary file in the same folder, fsync, rename over the target, fsync of the folder: a reader
  (or a resume after a crash) sees the old file or the new one, never half of one.
- ``writing``: turns an ``OSError`` while writing a file of the run into ``OutputError`` naming the file and the
  cause (``cannot write runs/x/args.json: No space left on device (ENOSPC)``): grpo.train prints it as one line.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
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
