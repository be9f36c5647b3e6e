"""Checkpoints: written atomically, loaded without running code.

A checkpoint is one ``torch.save`` file ``step_000123.pt`` in the run's ``checkpoints/`` folder
holding plain tensors and Python primitives only (model and optimizer state dicts, the data
iterator's position, RNG states, the AdaHOP layers' calibration and modes, which live in the
model's state dict as extra state). It is loaded with ``torch.load(weights_only=True)``, so a
file from elsewhere cannot execute code.

Atomicity: the file is written to a temporary name in the same folder, flushed to disk, then
renamed over its final name (``os.replace`` is atomic on POSIX), and only then does the
``latest`` pointer (itself replaced atomically) move to it. A run killed at any moment leaves
the previous checkpoint and pointer intact.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

from adahop.atomic_io import atomic_write, atomic_write_bytes

CHECKPOINT_RE = re.compile(r"^step_(\d{9})\.pt$")
LATEST = "latest"


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        # the MT19937 key as a tensor: numpy arrays are not allowed by weights_only loading
        "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
        "numpy_pos": int(np.random.get_state()[2]),
        "python": [int(v) for v in random.getstate()[1]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore ``rng_state()``'s states. The trainer loads checkpoints onto its device, so the
    state tensors may arrive on the GPU: the generators take CPU byte tensors."""
    torch.set_rng_state(state["torch"].cpu())
    np.random.set_state(("MT19937", state["numpy"].cpu().numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(folder: str | os.PathLike, step: int, state: dict, *, keep: int = 2) -> Path:
    """Write ``state`` as checkpoint ``step`` atomically, point ``latest`` at it, and delete all
    but the ``keep`` newest checkpoints."""
    folder = Path(folder)
    path = folder / f"step_{step:09d}.pt"
    atomic_write(path, lambda f: torch.save(state, f))
    atomic_write_bytes(folder / LATEST, path.name.encode())
    for old in list_checkpoints(folder)[:-keep] if keep > 0 else []:
        old.unlink()
    return path


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if CHECKPOINT_RE.match(p.name))


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` points to (or the newest one, if the pointer is missing)."""
    folder = Path(folder)
    pointer = folder / LATEST
    if pointer.exists():
        path = folder / pointer.read_text().strip()
        if not CHECKPOINT_RE.match(path.name) or not path.exists():
            raise ValueError(f"{pointer} points to {path.name!r}, which is not a checkpoint in {folder}")
        return path
    found = list_checkpoints(folder)
    return found[-1] if found else None


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint with ``weights_only=True`` (no code runs). A truncated or foreign file
    gives a ValueError naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # pickle errors, truncated zip, disallowed globals
        raise ValueError(f"cannot load checkpoint {path}: {type(e).__name__}: {e}") from e


TRAINING_KEYS = ("step", "model", "optimizer", "data", "rng", "config")


def load_training_checkpoint(path: str | os.PathLike) -> dict:
    """``load_checkpoint`` of a file the trainer wrote, checked to hold what a resume needs. Any
    other loadable file (e.g. a bare ``torch.save(model.state_dict())``) gives a ValueError
    naming the file and what it lacks."""
    state = load_checkpoint(path)
    missing = [k for k in TRAINING_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"{path} is not a training checkpoint of adahop (it lacks {', '.join(map(repr, missing))}); "
            "a bare state_dict loads with model.load_state_dict, and a run folder's checkpoints/ holds only "
            "the trainer's own files: move it out, or give another --out")
    if isinstance(state["step"], bool) or not isinstance(state["step"], int) or state["step"] < 1:
        raise ValueError(f"{path}: step must be an int >= 1, got {state['step']!r}")
    return state
