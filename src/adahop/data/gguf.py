"""GGUF files (llama.cpp's format) as data: opening one, reading its metadata values, and the
byte-level BPE tokenizer it carries, as an adahop :class:`~adahop.data.tokenizer.BPETokenizer`.

A tokenizer is data (a corpus can be built with the one inside SmolLM2's GGUF file, see
``data.smollm2``), so the reading lives here; the weights of a GGUF file are read into adahop's
Llama by ``llama.pretrained``, which imports this module (never the other way round). Needs the
optional extra ``pip install "adahop[pretrained]"`` (``gguf``; ``tokenizers`` for the tokenizer).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import numpy as np

from adahop.data.tokenizer import BPETokenizer, _require_tokenizers

PRETRAINED_EXTRA = 'pip install "adahop[pretrained]"'


def require_extra(module: str, what: str):
    """``module`` imported, or an ImportError naming the optional extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs the `{module}` package: {PRETRAINED_EXTRA} "
                          f"(or pip install {module})") from None


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` of ``path``; a file the reader cannot parse is a ValueError naming it."""
    gguf = require_extra("gguf", "loading a GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # a truncated or foreign file fails anywhere in the reader's parsing
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field_value(field):
    """A GGUF metadata value (str, int, float, bool or a list of them), read from the reader's
    raw parts the same way for every gguf version >= 0.10 (``ReaderField.contents`` is newer)."""
    from gguf import GGUFValueType

    def numbers(part):
        # a float32 as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)
        return [float(str(v)) for v in part] if part.dtype == np.float32 else part.tolist()

    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [field.parts[i].tobytes().decode("utf-8") for i in field.data]
        return [v for i in field.data for v in numbers(field.parts[i])]
    if field.types[0] == GGUFValueType.STRING:
        return field.parts[-1].tobytes().decode("utf-8")
    return numbers(field.parts[-1])[0]


def gguf_tokenizer(path: str | os.PathLike, *, name: str | None = None) -> BPETokenizer:
    """The byte-level BPE tokenizer stored in a GGUF file (``tokenizer.ggml.model == "gpt2"``)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"no GGUF file at {path}")
    return read_gguf_tokenizer(open_gguf(path), path, name=name)


# llama.cpp's pre-tokenizers (llama-vocab.cpp) that `tokenizers` can rebuild: "smollm" splits
# every digit off first (regex \p{N}), then applies GPT-2's regex; "gpt2" only the latter.
_PRE_TOKENIZERS = ("smollm", "gpt2")
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4  # llama.cpp's token types of special tokens


def read_gguf_tokenizer(reader, path: Path, name: str | None) -> BPETokenizer:
    """The tokenizer of an open GGUF file (``reader``, from :func:`open_gguf`; ``path`` names it in errors)."""
    tk = _require_tokenizers()
    fields = reader.fields
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{path}: the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    model = field_value(fields["tokenizer.ggml.model"]) if "tokenizer.ggml.model" in fields else None
    pre = field_value(fields["tokenizer.ggml.pre"]) if "tokenizer.ggml.pre" in fields else "gpt2"
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
        raise ValueError(f"{path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not supported; supported: "
                         f"byte-level BPE ('gpt2') with pre-tokenizer {' or '.join(map(repr, _PRE_TOKENIZERS))}")
    tokens = field_value(fields["tokenizer.ggml.tokens"])
    merges = field_value(fields["tokenizer.ggml.merges"]) if "tokenizer.ggml.merges" in fields else []
    types = field_value(fields["tokenizer.ggml.token_type"]) if "tokenizer.ggml.token_type" in fields else []
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: the GGUF tokenizer has duplicate tokens")
    tok = tk.Tokenizer(tk.models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = tk.decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in special])
    return BPETokenizer(tok, name=name or f"gguf-bpe-{len(tokens)}")
