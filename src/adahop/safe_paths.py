"""File names read from files: joined to their folder only when they are plain names in it.

A corpus manifest, a Hugging Face index, a checkpoint's ``latest`` pointer or its ``.metadata``
name other files of their folder. These files may come from elsewhere (a downloaded corpus or
model, a copied run folder), and a name such as ``../x`` or ``/etc/passwd`` would make us read,
or when a corpus is rebuilt delete, a file outside the folder. So every such name must be a plain
file name: a non-empty string with no path separator (``/`` or ``\\``, so no absolute path either),
no drive, not ``.`` or ``..``; anything else is refused with a ValueError naming the file that gave
it.

Symbolic links inside the folder are followed as they are: they were put there by whoever made
the folder (the Hugging Face hub cache links every file of a snapshot into its ``blobs/``
folder), while a name inside a file is data.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath


def is_plain_name(name) -> bool:
    """``name`` is a string naming an entry of a folder, and nothing outside it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and PurePosixPath(name).name == name and PureWindowsPath(name).name == name)


def file_in(folder: str | os.PathLike, name, source: str) -> Path:
    """``folder / name`` when ``name`` is a plain file name (module doc); otherwise a ValueError
    naming ``source``, the file (and field) that gave the name."""
    if not is_plain_name(name):
        raise ValueError(f"{source} names {name!r}: only a plain file name inside {folder} is allowed "
                         "(no folder part, no '..', not an absolute path)")
    return Path(folder) / name
