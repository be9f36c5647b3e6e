"""Writing files safely: a folder or file checked writable before the work that fills it
(:func:`ensure_writable_dir`, :func:`ensure_writable_file`: a ValueError naming it), then atomic
writes: a reader (or a run killed mid-write) sees the old file or the new one, never half of one.

The data is written to a temporary file in the target's folder (same file system), flushed and
fsynced, then renamed over the target with ``os.replace`` (atomic on POSIX). On any error the
temporary file is removed and the target is untouched; an OSError without a file name (a full
disk, raised by the writer) gets the target's. New files get the mode a plain ``open()``
would give them (``mkstemp`` alone makes them 0600).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PROBE_PREFIX = ".write-check-"  # ensure_writable_dir's probe, of this or another process: never a run's


def file_mode() -> int:
    """The mode a plain ``open()`` would give a new file under the current umask."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace ``path`` with what ``write(f)`` writes to a binary file ``f``."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
    try:
        os.chmod(tmp, file_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None:  # e.g. a full disk: say which file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


def ensure_writable_dir(path: str | os.PathLike, what: str = "--out", *, create: bool = True) -> Path:
    """Check that folder ``path`` can be written, before any work: a path that is a file, or
    that cannot be created or written, gives a ValueError naming it. ``create``: make the folder
    (and its parents) now; otherwise only the nearest existing folder on the way is checked, and
    nothing is left behind."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} exists and is not a folder")
    probe_in = path
    if not create:
        while not probe_in.exists():
            probe_in = probe_in.parent
        if not probe_in.is_dir():
            raise ValueError(f"{what} {path} is not a writable folder: {probe_in} is a file")
    try:
        if create:
            path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=probe_in, prefix=PROBE_PREFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{what} {path} is not a writable folder: {e.strerror or e}") from e
    return path


def ensure_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Check that file ``path`` can be written (its folder is created if needed), before the work
    that produces it. An existing folder of that name is refused too."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; give a file name")
    ensure_writable_dir(path.parent, what=f"{what} {path}: the folder", create=False)
    return path
