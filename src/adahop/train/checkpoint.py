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

A run under ``--parallel`` writes a sharded checkpoint instead: a folder ``step_000123/``
(``save_sharded`` / ``load_sharded``, docs/distributed.md) holding

    .metadata, __<rank>_0.distcp   the model's and the optimizer's tensors, written by
                                   torch.distributed.checkpoint (each rank its shards), keyed by
                                   parameter name, so they load into another world size
    state.json                     step, world size, config, the AdaHOP layers' extra state
                                   (calibration, patterns, modes: the same on every rank)
    rank_00000.pt, ...             per rank: data position, RNG states, SR call counters
                                   (torch.save, loaded with weights_only=True)

It is written into ``.step_000123.tmp/`` and renamed into place by rank 0 once every rank has
written its part, then ``latest`` moves. Only tensors go through torch.distributed.checkpoint:
its non-tensor values would be unpickled on load. Its ``.metadata`` file is a pickle of its own
classes, read here with an unpickler that admits those classes and nothing else; the files it
names (and the name in ``latest``) must be plain names in their folder (``adahop.safe_paths``).
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from adahop.atomic_io import atomic_write, atomic_write_bytes
from adahop.safe_paths import file_in

CHECKPOINT_RE = re.compile(r"^step_(\d{9})(\.pt)?$")  # a file (one process) or a folder (sharded)
LATEST = "latest"
SHARDED_STATE = "state.json"
SHARDED_FORMAT = "adahop-sharded-checkpoint"
SHARDED_VERSION = 1


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
    save_torch(path, state)
    atomic_write_bytes(folder / LATEST, path.name.encode())
    prune_checkpoints(folder, keep)
    return path


def save_torch(path: Path, obj) -> None:
    """``torch.save(obj)`` into ``path``, atomically. torch's own writer reports a write that
    failed (a full disk: short writes) as a RuntimeError; it becomes an OSError naming the file."""
    def write(f):
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            raise OSError(errno.EIO, f"torch.save failed ({_first_line(e)}); is the disk full?", str(path)) from e

    atomic_write(path, write)


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def load_model_state(model: torch.nn.Module, state_dict: dict, source) -> None:
    """``model.load_state_dict(state_dict)``; a checkpoint that does not fit the model (other
    parameter names or shapes: e.g. the run's ``--init`` folder changed since it was written) is a
    ValueError naming ``source`` and the first mismatch, not torch's RuntimeError."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0] if lines else type(e).__name__
        detail = detail if len(detail) <= 300 else detail[:300] + " ..."
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        raise ValueError(f"{source} does not fit the model: {detail}{more}") from None


def prune_checkpoints(folder: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints (files or sharded folders)."""
    for old in list_checkpoints(folder)[:-keep] if keep > 0 else []:
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()


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
        path = file_in(folder, pointer.read_text().strip(), str(pointer))
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


# ---- sharded checkpoints (runs under --parallel) ----------------------------------------------------
def is_sharded(path: str | os.PathLike) -> bool:
    return Path(path).is_dir()


def _tensors(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def save_sharded(folder: str | os.PathLike, step: int, *, model, optimizer, state: dict, rank_state: dict, par,
                 keep: int = 2) -> Path:
    """Write a sharded checkpoint of ``step`` (the module doc) from every rank of ``par``
    (``train.distributed.Parallel``): ``state`` (plain JSON data, the same on every rank) and
    this rank's ``rank_state``. Every rank calls it; returns the checkpoint's folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    folder = Path(folder)
    final = folder / f"step_{step:09d}"
    tmp = folder / f".{final.name}.tmp"
    if par.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.glob(".step_*.tmp"):  # writes killed before their rename
            shutil.rmtree(leftover)
    par.barrier()
    osd = get_optimizer_state_dict(model, optimizer)
    try:
        dcp.save({"model": _tensors(get_model_state_dict(model)), "optim": osd["state"]},
                 storage_writer=dcp.FileSystemWriter(str(tmp)))
    except dcp.api.CheckpointException as e:  # a BaseException: it would escape every handler
        exc = first_failure(e)
        raise OSError(getattr(exc, "errno", None) or errno.EIO, f"{type(exc).__name__}: {_first_line(exc)}",
                      getattr(exc, "filename", None) or str(tmp)) from None
    save_torch(rank_file(tmp, par.rank), rank_state)
    if par.is_main:
        meta = {"format": SHARDED_FORMAT, "format_version": SHARDED_VERSION, "world_size": par.world, **state}
        atomic_write_bytes(tmp / SHARDED_STATE, (json.dumps(meta, indent=1) + "\n").encode())
    par.barrier()  # every rank's part is written
    if par.is_main:
        if final.exists():  # the same step written again (a resumed run): replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        atomic_write_bytes(folder / LATEST, final.name.encode())
        prune_checkpoints(folder, keep)
    par.barrier()
    return final


def read_sharded_state(path: str | os.PathLike) -> dict:
    """``state.json`` of a sharded checkpoint (what ``save_sharded`` got as ``state``, plus
    ``world_size``), checked; a ValueError naming the folder otherwise."""
    path = Path(path)
    file = path / SHARDED_STATE
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a sharded checkpoint of adahop: {file}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != SHARDED_FORMAT or \
            meta.get("format_version") != SHARDED_VERSION:
        raise ValueError(f"{file} is not a sharded adahop checkpoint of version {SHARDED_VERSION}")
    missing = [k for k in ("step", "config", "world_size") if k not in meta]
    if missing:
        raise ValueError(f"{file} lacks {missing}")
    return meta


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes torch.distributed.checkpoint's metadata is made of (its own
    dataclasses, ``torch.Size``, dtypes, a path) and nothing that runs code of the file's choosing."""

    METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # dataclasses and enums only
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
               ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == self.METADATA_MODULE and isinstance(found := super().find_class(module, name), type):
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


def _safe_reader(path: Path):
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

            try:
                with open(Path(self.path) / ".metadata", "rb") as f:
                    metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
            except Exception as e:  # a damaged file fails in any of pickle's ways
                raise ValueError(f"cannot read {path}/.metadata: {type(e).__name__}: {e}") from None
            if not isinstance(metadata, Metadata):
                raise ValueError(f"{path}/.metadata holds a {type(metadata).__name__}, not a checkpoint's metadata")
            ends: dict[Path, int] = {}  # each file tensors are read from -> the end of its last byte range
            for info in (metadata.storage_data or {}).values():
                file = file_in(path, getattr(info, "relative_path", None), f"{path}/.metadata (a tensor's file)")
                ends[file] = max(ends.get(file, 0), int(info.offset) + int(info.length))
            for file, end in sorted(ends.items()):  # checked here: dcp's own read errors carry no file name
                if not file.is_file():
                    raise ValueError(f"{file} is missing (the sharded checkpoint's .metadata reads tensors from it)")
                if file.stat().st_size < end:
                    raise ValueError(f"{file} is truncated: {file.stat().st_size} bytes, where the checkpoint's "
                                     f".metadata reads up to byte {end}")

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def first_failure(e) -> BaseException:
    """The exception of the lowest rank in a ``CheckpointException`` (``failures``: rank ->
    (exception, traceback)), or ``e`` itself."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        found = failures[rank]
        return found[0] if isinstance(found, tuple) else found
    return e


def damaged_sharded_checkpoint(path: Path, e: BaseException) -> ValueError:
    """One line for a sharded checkpoint that cannot be read (a ``.distcp`` part missing or
    truncated, ``.metadata`` garbage), naming the file: torch.distributed.checkpoint reports it
    as a ``CheckpointException`` holding every rank's traceback."""
    exc = first_failure(e)
    if isinstance(exc, ValueError) and str(path) in str(exc):  # ours (the .metadata reader): it names the file
        return ValueError(_first_line(exc))
    if isinstance(exc, OSError) and exc.filename:
        return ValueError(f"cannot read the sharded checkpoint {path}: {exc.filename}: {exc.strerror or exc}")
    # (torch's first sentence only: the rest of its load errors advises weights_only=False)
    return ValueError(f"cannot read the sharded checkpoint {path}: a .distcp part is damaged "
                      f"({type(exc).__name__}: {_first_line(exc).split('. ')[0][:200]})")


def load_sharded(path: str | os.PathLike, *, model, optimizer, par) -> dict:
    """Load a sharded checkpoint into ``model`` and ``optimizer`` (resharded to this world
    size) on every rank of ``par``. Returns ``state.json`` with ``rank_state``: this rank's
    part, the same rank's when the world size is the saved one, else rank 0's (see
    docs/distributed.md for what that means for the data position)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    meta = read_sharded_state(path)
    msd = _tensors(get_model_state_dict(model))
    osd = get_optimizer_state_dict(model, optimizer)  # initialises the state: its tensors are loaded into
    reader = _safe_reader(path)
    reader.read_metadata()  # a damaged .metadata or part file: one ValueError naming it, before dcp.load
    try:
        dcp.load({"model": msd, "optim": osd["state"]}, storage_reader=reader)
    except (RuntimeError, KeyError) as e:  # missing keys, other shapes
        raise ValueError(f"{path} does not fit this model: {type(e).__name__}: {_first_line(e)}") from None
    except dcp.api.CheckpointException as e:  # a rank's read failed; a BaseException, which no handler takes
        raise damaged_sharded_checkpoint(path, e) from None
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, optimizer, osd)
    source = par.rank if meta["world_size"] == par.world else 0
    meta["rank_state"] = load_checkpoint(rank_file(path, source))
    meta["rank_state_from"] = source
    return meta
