"""A run folder: checked writable before any work, owned by one process at a time.

``adahop train --out DIR`` writes ``config.json``, ``log.jsonl``, ``checkpoints/``, ``modes.json``
and ``summary.json`` into DIR. Two processes training into the same folder would interleave
their logs and resume from each other's checkpoints, so the trainer holds an exclusive lock on
``DIR/.lock`` (``fcntl.flock``: the kernel releases it when the process ends, however it ends, so
a killed run never leaves a stale lock). The holder's pid is written into the file, so that a
second process can say who holds it.

A new run in a folder that holds another (``adahop train --no-resume``, ``train(resume=False)``)
starts from a clean folder, and nothing of the old run is deleted: the folder's entries (all but
the lock and earlier ``previous-N`` folders) are moved into ``previous-N/`` (N one more than the
highest there), which is itself a run folder that ``adahop eval`` and ``compare`` read. Otherwise
the new run's checkpoints would be pruned as older than the old run's (pruning keeps the highest
step numbers), ``latest`` would point at a deleted file, and the old ``summary.json`` would sit
beside the new log. The move is atomic for any run that follows: the entries go into
``.previous-N.partial/`` one rename at a time, which is renamed to ``previous-N`` at the end, and
a run that finds a ``.partial`` folder (a move killed midway) finishes that move before it looks
at the folder.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from adahop.atomic_io import PROBE_PREFIX

LOCK_NAME = ".lock"
PREVIOUS_RE = re.compile(r"^previous-(\d+)$")
PARTIAL_RE = re.compile(r"^\.previous-(\d+)\.partial$")


def set_aside_previous_run(folder: str | os.PathLike, *, new_run: bool) -> Path | None:
    """Finish a move killed midway, and with ``new_run`` move the folder's entries (an older
    run's files) into a new ``previous-N/`` (module doc). Returns the folder they were moved to,
    None when nothing was moved. Call it holding the folder's lock."""
    folder = Path(folder)
    partial = sorted((p for p in folder.iterdir() if PARTIAL_RE.match(p.name)),
                     key=lambda p: int(PARTIAL_RE.match(p.name)[1]))
    if partial:
        target = partial[0]
    elif new_run:
        taken = [int(m[1]) for p in folder.iterdir() if (m := PREVIOUS_RE.match(p.name))]
        target = folder / f".previous-{max(taken, default=0) + 1}.partial"
    else:
        return None
    entries = [p for p in folder.iterdir() if p.name != LOCK_NAME and not p.name.startswith(PROBE_PREFIX)
               and not PREVIOUS_RE.match(p.name) and not PARTIAL_RE.match(p.name)]
    if not entries and not partial:
        return None
    target.mkdir(exist_ok=True)
    for entry in entries:
        os.rename(entry, target / entry.name)
    final = folder / f"previous-{PARTIAL_RE.match(target.name)[1]}"
    os.rename(target, final)
    return final


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
