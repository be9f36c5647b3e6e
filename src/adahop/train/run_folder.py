"""A run folder: checked writable before any work, owned by one process at a time.

``adahop train --out DIR`` writes ``config.json``, ``log.jsonl``, ``checkpoints/``, ``modes.json``
and ``summary.json`` into DIR. Two processes training into the same folder would interleave
their logs and resume from each other's checkpoints, so the trainer holds an exclusive lock on
``DIR/.lock`` (``fcntl.flock``: the kernel releases it when the process ends, however it ends, so
a killed run never leaves a stale lock). The holder's pid is written into the file, so that a
second process can say who holds it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

LOCK_NAME = ".lock"


class RunLock:
    """Exclusive ownership of a run folder for the life of a ``with`` block (or until
    ``release``). A second holder gets a ValueError naming the pid of the first."""

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _lock(fd)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"{self.path.parent} is in use by another adahop process (pid {holder}); "
                "wait for it to finish or give another --out") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _lock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as e:
            raise BlockingIOError(errno.EAGAIN, "locked") from e
        return
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
