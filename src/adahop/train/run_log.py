"""A run's log: ``log.jsonl``, one JSON record per line (a step, an evaluation, the final eval).

A process killed in the middle of a write can leave the last line torn. Such a line holds
nothing a resumed run needs (the checkpoint is written after its step's record), so reading
drops it with a note; a broken line anywhere else is damage and an error naming the file and
line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LOG_NAME = "log.jsonl"


def parse_log(path: Path) -> list[dict]:
    """The records of ``path`` (a torn last line dropped with a note on stderr)."""
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text log: {e}") from None
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i == len(lines) - 1:
                print(f"note: {path}: dropped its torn last line ({len(line)} characters)", file=sys.stderr)
                break
            raise ValueError(f"{path}, line {i + 1}, is not a log record ({e}); the log is damaged") from None
        records.append(record)
    return records


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """The records of the run folder's log."""
    path = Path(run_dir) / LOG_NAME
    if not path.is_file():
        raise ValueError(f"no training log at {path}")
    return parse_log(path)


class JsonlLog:
    """Append-only JSONL log. A resumed run keeps the records up to its checkpoint's step (the
    later ones belong to steps it will run again) and drops a torn last line."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self._rewrite([])
        elif path.exists():
            kept = [r for r in parse_log(path) if r.get("step", 0) <= resume_step]
            self._rewrite(kept)

    def records(self) -> list[dict]:
        return parse_log(self.path) if self.path.exists() else []

    def _rewrite(self, records: list[dict]) -> None:
        try:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in records))
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def write(self, record: dict) -> None:
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(self.path)) from e
