"""A run assembled from its config: the model and its batches, and the held-out evaluation.

What ``adahop train`` and ``adahop eval`` are made of, public so that benchmarks and user scripts
build the same run without going through the command line::

    corpus = load_corpus(cfg.corpus_dir)
    model, batches = open_run(cfg, corpus)
    summary = train(cfg, model=model, train_batches=batches, eval_fn=eval_fn_of(cfg, corpus))
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import torch

from adahop.data.corpus import Corpus, TokenBatches
from adahop.llama.model import Llama, LlamaConfig
from adahop.llama.pretrained import INIT_SCRATCH, init_tokenizer, load_init
from adahop.train.trainer import TrainConfig


def other_corpus(saved_config, corpus: Corpus) -> str | None:
    """The corpus id (the corpus's build key, ``extra["corpus_id"]``) that a run's saved
    ``config.json`` (a dict, or a TrainConfig) records when it is not ``corpus``'s: the folder was
    rebuilt since from other sources, text or settings, so its held-out split is not the run's.
    None when it is the same, or the config records none."""
    extra = saved_config.get("extra") if isinstance(saved_config, dict) else getattr(saved_config, "extra", None)
    saved = extra.get("corpus_id") if isinstance(extra, dict) else None
    return saved if saved not in (None, corpus.corpus_id) else None


def check_run_corpus(run, saved_config, corpus: Corpus) -> None:
    """A ValueError when the run folder ``run`` was trained on another corpus than ``corpus``
    (``other_corpus``): evaluating or studying it there would score it on other text."""
    saved = other_corpus(saved_config, corpus)
    if saved is not None:
        raise ValueError(f"{run} was trained on corpus {saved[:12]}, but {corpus.root} now holds corpus "
                         f"{corpus.corpus_id[:12]} (rebuilt since, from other sources or settings): its held-out "
                         "text is not the run's; rebuild the corpus as the run had it, or train a new run on this one")


# Text a tokenizer splits into ids: two tokenizers that give the same ids for it are taken to be the
# same one (prose, code, digits, case, accents and whitespace runs, where BPE vocabularies differ).
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog, while seven wizards quietly judge my vow.\n"
                   "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text]  # 2024-12-07\n"
                   "Prices rose 3.75% to $1,234.56; naïve café owners said: «Ça va?» THE END    ...\n")


def check_init_tokenizer(cfg: TrainConfig, corpus: Corpus) -> None:
    """A pretrained ``cfg.init`` trains on ids that mean its own tokenizer's text: a corpus of
    another tokenizer, even of the same vocabulary size, is refused (ValueError). SmolLM2's is the
    corpus tokenizer ``smollm2``, known by name; a GGUF file's or a Hugging Face folder's own
    tokenizer is compared by the ids both give ``TOKENIZER_PROBE``. Where the model brings no
    tokenizer to compare (a folder without ``tokenizer.json``), a UserWarning says the identity
    is not checked: refusing would lock out a model whose tokenizer is kept elsewhere."""
    if cfg.init == INIT_SCRATCH:
        return
    spec = corpus.manifest["tokenizer"].get("spec")
    if cfg.init == "smollm2":
        if spec != "smollm2":
            raise ValueError(f"the corpus {corpus.root} is tokenized by {spec!r}, not by SmolLM2's tokenizer: "
                             "--init smollm2 needs a corpus built with --tokenizer smollm2")
        return
    tok, why = init_tokenizer(cfg.init)
    if tok is None:
        warnings.warn(f"cannot check that the corpus {corpus.root} ({spec}) is in the tokenizer of --init {cfg.init} "
                      f"({why}): a corpus of another tokenizer would train the model on ids that mean other text",
                      stacklevel=2)
        return
    if tok.encode(TOKENIZER_PROBE) != corpus.tokenizer.encode(TOKENIZER_PROBE):
        raise ValueError(f"the corpus {corpus.root} is tokenized by {spec!r}, not by the tokenizer of --init "
                         f"{cfg.init} (they split the same text into other ids): build the corpus with the "
                         "model's tokenizer")


def build_model(cfg: TrainConfig, vocab_size: int, *, max_seq_len: int | None = None) -> Llama:
    """The (unconverted, float32) Llama a run starts from. With ``cfg.init == "scratch"``: the
    model of ``cfg.model_size``, initialised from ``cfg.seed``; otherwise the pretrained model
    ``cfg.init`` names (``pretrained.load_init``; ``model_size`` is ignored), whose vocabulary must
    be the corpus's ``vocab_size``. ``max_seq_len`` (default: the training length) only sizes the
    RoPE tables, which are not in the checkpoint, so a longer one can score longer evaluation
    items. A resumed run still builds this model first: ``train`` then loads the checkpoint's
    weights over it."""
    max_seq_len = max_seq_len or cfg.seq_len
    if cfg.init != INIT_SCRATCH:
        model = load_init(cfg.init, max_seq_len=max_seq_len)
        if model.config.vocab_size != vocab_size:
            hint = " (build the corpus with --tokenizer smollm2)" if cfg.init == "smollm2" else ""
            raise ValueError(f"the corpus's vocabulary ({vocab_size}) is not the model's ({model.config.vocab_size}, "
                             f"init {cfg.init!r}): a pretrained model needs a corpus in its own tokenizer{hint}")
        return model
    model_cfg = LlamaConfig.from_size(cfg.model_size, vocab_size=vocab_size, max_seq_len=max_seq_len)
    torch.manual_seed(cfg.seed)
    return Llama(model_cfg)


def architecture(model: Llama) -> dict:
    """What a run records of the model it trains (``config.json``'s ``extra["model"]``): its
    architecture and its parameter count (``open_run`` adds where its weights started)."""
    return {**dataclasses.asdict(model.config), "params": model.config.num_params()}


def train_batches(cfg: TrainConfig, corpus: Corpus) -> TokenBatches:
    """The training batches of ``cfg`` (order fixed by ``cfg.seed``; resumable)."""
    return TokenBatches(corpus, "train", batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)


def open_run(cfg: TrainConfig, corpus: Corpus, *, max_seq_len: int | None = None) -> tuple[Llama, TokenBatches]:
    """``build_model`` and ``train_batches`` together: what ``train`` is given. The model's
    architecture goes into ``cfg.extra["model"]`` (so into the run's ``config.json``): with a
    pretrained init it is the loaded model's, not ``model_size``'s. A pretrained init's tokenizer
    is checked against the corpus's first (``check_init_tokenizer``)."""
    check_init_tokenizer(cfg, corpus)
    model = build_model(cfg, corpus.vocab_size, max_seq_len=max_seq_len)
    cfg.extra["model"] = {"init": cfg.init, **architecture(model)}
    return model, train_batches(cfg, corpus)


def heldout_eval(model, corpus: Corpus, *, seq_len: int, batch_size: int, max_batches: int) -> dict:
    """Held-out loss (nats/token) and bits per byte per source, over the first ``max_batches``
    batches of each source's validation shard (``evaluate.heldout_loss``). BF16 autocast on a GPU,
    as in training."""
    from adahop.train.evaluate import heldout_loss

    batches = {s: itertools.islice(TokenBatches(corpus, "val", batch_size=batch_size, seq_len=seq_len, sources=[s]),
                                   max_batches)
               for s in corpus.sources}
    sizes = {s: (corpus.shard_info(s, "val")["tokens"], corpus.shard_info(s, "val")["text_bytes"])
             for s in corpus.sources}
    device = next(model.parameters()).device
    return heldout_loss(model, batches, sizes=sizes, autocast_dtype=torch.bfloat16 if device.type == "cuda" else None)


def drift_of(model, corpus: Corpus, cfg: TrainConfig) -> dict:
    """``adahop.drift.measure_drift`` on the first ``drift_batches`` held-out batches of each
    source, as training runs (bf16 autocast on a GPU; a compiled model eagerly: its observations
    are read back to the host), the changes applied with ``cfg.drift == "apply"``."""
    from adahop.drift import measure_drift

    device = next(model.parameters()).device
    batches = [b for s in corpus.sources for b in itertools.islice(
        TokenBatches(corpus, "val", batch_size=cfg.batch_size, seq_len=cfg.seq_len, sources=[s]), cfg.drift_batches)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    with torch.compiler.set_stance("force_eager"), torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return measure_drift(model, batches, apply=cfg.drift == "apply")


def check_heldout(corpus: Corpus, seq_len: int) -> None:
    """Every source's held-out shard holds one window of ``seq_len + 1`` tokens, or a ValueError
    saying what to change: a run evaluates on it, at the end if not before, and would otherwise
    train every step and then fail there (on every re-run too)."""
    for source in corpus.sources:
        tokens = corpus.shard_info(source, "val")["tokens"]
        if tokens < seq_len + 1:
            raise ValueError(f"corpus {corpus.root}: the held-out shard of {source!r} has {tokens} tokens, fewer than "
                             f"one window of seq_len + 1 = {seq_len + 1}: rebuild it with a larger --val-fraction "
                             "(adahop data), or train with a shorter --seq-len")


def eval_fn_of(cfg: TrainConfig, corpus: Corpus):
    """The evaluation ``train`` runs for ``cfg``: ``heldout_eval`` over ``cfg.eval_batches``, and
    with ``cfg.drift`` on, the drift of a calibrated model under ``"drift"``. The held-out shards
    are checked to hold a window here, before training (``check_heldout``)."""
    from adahop.convert import is_calibrated

    check_heldout(corpus, cfg.seq_len)

    def eval_fn(model) -> dict:
        result = heldout_eval(model, corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                              max_batches=cfg.eval_batches)
        if cfg.drift != "off" and is_calibrated(model):
            result["drift"] = drift_of(model, corpus, cfg)
        return result

    return eval_fn
