"""Evaluation: zero-shot tasks scored by log-likelihood, and held-out language-model loss.

Any causal LM works: ``model(tokens [B, T]) -> logits [B, T, V]``, with a tokenizer that has
``encode(str) -> list[int]``, ``vocab_size`` and ``eos_id`` (``adahop.data.tokenizer.Tokenizer``;
a ``bos_id`` attribute is used when present). Both entry points run under ``torch.no_grad()`` with
``model.eval()`` and put the model back in the mode it was in.

Scoring a continuation (:func:`score_continuations`)
----------------------------------------------------
For a (context, continuation) pair the sequence is ``[prefix] + encode(context) +
encode(continuation)`` (the two strings are encoded separately, as OLMES and lm-eval do, so every
choice of an item is conditioned on the same context tokens). ``prefix`` is a document-start
token: the tokenizer's ``bos_id`` if it has one, else its ``eos_id`` (the training corpus separates
documents with end-of-text, so it is what precedes every document the model has seen). The model
reads ``seq[:-1]``, left-truncated to its last ``max_seq_len`` tokens (the continuation is never
cut; one longer than ``max_seq_len`` tokens is a ``ValueError``), and the last ``c`` positions
predict the ``c`` continuation tokens::

    seq     p  c1 c2 c3 | a1 a2          input = seq[:-1] = p c1 c2 c3 a1
    logits  .  .  .  a1   a2             (positions n-c .. n-1 of an input of length n)

Returned per pair: ``logprob`` = sum over continuation tokens of log softmax(logits) at the token
(nats, float32 log-softmax, float64 sum), ``n_tokens``, and ``greedy`` = every continuation token's
logit equals the row's maximum (teacher-forced greedy decoding reproduces the continuation; ties
count as greedy). Pairs are sorted by length and batched with right padding (causal attention
never lets a position see the padding after it); each pair's log-probs are taken from its own
positions and summed with ``math.fsum``, so a model whose per-position logits do not depend on the
batch gives bit-identical scores batched or one by one (a real transformer's GEMMs may round
differently for another batch shape, at the 1e-6 level).

Metrics
-------
Multiple choice (PIQA, HellaSwag, ARC-Easy), with ``lp_i`` the log-prob of choice ``i``:

- ``acc``: fraction of items whose gold choice has the highest ``lp_i`` (lm-eval's ``acc``, OLMES
  ``acc_raw``);
- ``acc_norm``: same with ``lp_i / len(choice_i)``, the length of the continuation string in
  characters, leading space included (OLMES ``acc_per_char``, the primary metric of OLMo's
  ``rc`` tasks; lm-eval's ``acc_norm`` divides by UTF-8 bytes, identical on ASCII text).

Ties go to the lowest index (``argmax``). LAMBADA:

- ``acc``: fraction of items whose target (``" " + last word``, all its tokens) is greedy (lm-eval's
  LAMBADA accuracy);
- ``ppl``: ``exp(-mean_i lp_i)`` (lm-eval's LAMBADA perplexity, per item, not per token);
- ``bits_per_byte``: ``mean_i(-lp_i / ln 2 / utf8_bytes(target_i))`` (OLMo's ``bpb`` for
  ``lambada/bpb_0shot``).

:func:`evaluate_tasks` reports every metric per task, ``score`` = the task's primary metric
(``acc_norm`` for the three multiple-choice tasks, ``acc`` for LAMBADA), ``chance`` (the expected
score of uniform guessing), and ``average`` = the unweighted mean of the tasks' ``score``. All are
fractions in [0, 1] (x100 for the paper's points). The unconditional (``doc_id >= 1e6``) requests
are not used: no calibrated metric.

Held-out loss (:func:`heldout_loss`)
------------------------------------
Mean next-token cross-entropy (nats/token, weighted by tokens) per source over ``(inputs,
targets)`` batches, and bits per byte ``bpb = loss / ln 2 * tokens / bytes`` with the source's
``tokens`` and ``bytes`` (from the corpus manifest of its held-out shards): the bytes of text per
token is taken as the shard average, exact when the batches cover the whole shard.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from adahop.data.tasks import (
    PAPER_TASKS,
    CompletionItem,
    Item,
    MultipleChoiceItem,
    load_task,
    task_spec,
)

LN2 = math.log(2.0)


class ContinuationScore(NamedTuple):
    logprob: float  # sum of log p(token | everything before it) over the continuation, nats
    n_tokens: int
    greedy: bool  # every continuation token is an argmax of its logits row


@contextmanager
def eval_mode(model: nn.Module):
    """``model.eval()`` and ``torch.no_grad()`` inside; the previous train/eval mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _model_config_value(model: nn.Module, name: str):
    """``model.config.<name>`` (or ``model.cfg.<name>``) when the model declares it, else None."""
    for attr in ("config", "cfg"):
        value = getattr(getattr(model, attr, None), name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _resolve_max_seq_len(model: nn.Module, max_seq_len: int | None) -> int:
    model_len = _model_config_value(model, "max_seq_len")
    if max_seq_len is None:
        if model_len is None:
            raise ValueError("max_seq_len is required for a model without config.max_seq_len")
        max_seq_len = model_len
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    if model_len is not None and max_seq_len > model_len:
        raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_seq_len {model_len}")
    return max_seq_len


def _check_vocab(model: nn.Module, tokenizer) -> None:
    model_vocab = _model_config_value(model, "vocab_size")
    tok_vocab = getattr(tokenizer, "vocab_size", None)
    if model_vocab is not None and tok_vocab is not None and tok_vocab > model_vocab:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name', tokenizer)!r} has {tok_vocab} tokens but the "
                         f"model's vocabulary has {model_vocab}: they do not belong together")


def _prefix_ids(tokenizer, prefix) -> list[int]:
    if prefix == "auto":
        for attr in ("bos_id", "eos_id"):
            tid = getattr(tokenizer, attr, None)
            if tid is not None:
                return [int(tid)]
        return []
    if prefix is None:
        return []
    if isinstance(prefix, bool) or not isinstance(prefix, int):
        raise ValueError(f"prefix must be 'auto', None or a token id, got {prefix!r}")
    return [prefix]


def _batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def score_continuations(
    model: nn.Module,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    max_seq_len: int | None = None,
    batch_size: int = 32,
    device: torch.device | str | None = None,
    prefix: int | str | None = "auto",
    autocast_dtype: torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[ContinuationScore]:
    """Log-likelihood of each ``continuation`` given its ``context`` (see the module docstring).

    ``max_seq_len`` defaults to ``model.config.max_seq_len``; ``device`` to the model's; ``prefix``:
    ``"auto"`` (bos, else eos), ``None`` (no prefix: a pair with an empty context is then a
    ``ValueError``) or a token id. ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs the forward
    under autocast, as training does. ``progress(done, total)`` is called after each batch."""
    max_seq_len = _resolve_max_seq_len(model, max_seq_len)
    batch_size = _batch_size(batch_size)
    _check_vocab(model, tokenizer)
    device = torch.device(device) if device is not None else _model_device(model)
    pre = _prefix_ids(tokenizer, prefix)

    # Encode (contexts are shared by the choices of an item: encode each once).
    ctx_cache: dict[str, list[int]] = {}
    inputs: list[list[int]] = []
    conts: list[list[int]] = []
    for i, (context, continuation) in enumerate(pairs):
        if not isinstance(context, str) or not isinstance(continuation, str):
            raise ValueError(f"pair {i}: context and continuation must be strings")
        if context not in ctx_cache:
            ctx_cache[context] = pre + list(tokenizer.encode(context))
        cont = list(tokenizer.encode(continuation))
        if not cont:
            raise ValueError(f"pair {i}: the continuation {continuation!r} encodes to no tokens")
        if len(cont) > max_seq_len:
            raise ValueError(f"pair {i}: the continuation has {len(cont)} tokens, more than max_seq_len {max_seq_len}")
        seq = ctx_cache[context] + cont
        if len(seq) - 1 < len(cont):
            raise ValueError(f"pair {i}: empty context and no prefix token: the first continuation token has "
                             "nothing to be conditioned on")
        inputs.append(seq[:-1][-max_seq_len:])  # left truncation: drops the oldest context tokens
        conts.append(cont)

    n = len(inputs)
    results: list[ContinuationScore | None] = [None] * n
    order = sorted(range(n), key=lambda i: -len(inputs[i]))  # similar lengths share a batch
    with eval_mode(model):
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            width = len(inputs[idx[0]])
            tokens = torch.zeros(len(idx), width, dtype=torch.long)
            rows, cols, targets, counts = [], [], [], []
            for b, i in enumerate(idx):
                length, c = len(inputs[i]), len(conts[i])
                tokens[b, :length] = torch.tensor(inputs[i], dtype=torch.long)
                rows += [b] * c
                cols += range(length - c, length)
                targets += conts[i]
                counts.append(c)
            tokens = tokens.to(device)
            if autocast_dtype is not None:
                with torch.autocast(device.type, dtype=autocast_dtype):
                    logits = model(tokens)
            else:
                logits = model(tokens)
            if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
                raise ValueError(f"the model returned logits of shape {tuple(logits.shape)} for tokens "
                                 f"{tuple(tokens.shape)}; expected [B, T, V]")
            vocab = logits.shape[-1]
            top_id = max(max(targets), max(max(inputs[i]) for i in idx))
            if top_id >= vocab or getattr(tokenizer, "vocab_size", 0) > vocab:
                raise ValueError(f"the model has {vocab} logits but the tokenizer has "
                                 f"{getattr(tokenizer, 'vocab_size', '?')} tokens (ids up to {top_id} here): "
                                 f"tokenizer/model vocabulary mismatch")
            sel = logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)].float()  # [N, V]
            tgt = torch.tensor(targets, device=device)
            tok_lp = torch.log_softmax(sel, dim=-1).gather(1, tgt[:, None])[:, 0]
            is_max = sel.gather(1, tgt[:, None])[:, 0] >= sel.max(dim=-1).values
            tok_lp = tok_lp.double().cpu().tolist()
            is_max = is_max.cpu().tolist()
            off = 0
            for i, c in zip(idx, counts):
                results[i] = ContinuationScore(math.fsum(tok_lp[off:off + c]), c, all(is_max[off:off + c]))
                off += c
            if progress is not None:
                progress(min(start + batch_size, n), n)
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Task metrics


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def multiple_choice_metrics(items: Sequence[MultipleChoiceItem], scores: Sequence[Sequence[ContinuationScore]]) -> dict:
    """``acc``, ``acc_norm`` (per character), ``chance`` and ``n`` from each item's choice scores."""
    if len(items) != len(scores):
        raise ValueError(f"{len(items)} items but {len(scores)} score lists")
    if not items:
        return {"n": 0, "acc": float("nan"), "acc_norm": float("nan"), "chance": float("nan")}
    acc = acc_norm = chance = 0.0
    for item, sc in zip(items, scores):
        lps = [s.logprob for s in sc]
        acc += _argmax(lps) == item.label
        acc_norm += _argmax([lp / len(ch) for lp, ch in zip(lps, item.choices)]) == item.label
        chance += 1.0 / len(item.choices)
    n = len(items)
    return {"n": n, "acc": acc / n, "acc_norm": acc_norm / n, "chance": chance / n}


def completion_metrics(items: Sequence[CompletionItem], scores: Sequence[ContinuationScore]) -> dict:
    """LAMBADA's ``acc`` (greedy), ``ppl`` and ``bits_per_byte`` (see the module docstring)."""
    if len(items) != len(scores):
        raise ValueError(f"{len(items)} items but {len(scores)} scores")
    n = len(items)
    if not n:
        return {"n": 0, "acc": float("nan"), "ppl": float("nan"), "bits_per_byte": float("nan"), "chance": 0.0}
    return {
        "n": n,
        "acc": sum(s.greedy for s in scores) / n,
        "ppl": math.exp(-math.fsum(s.logprob for s in scores) / n),
        "bits_per_byte": math.fsum(-s.logprob / LN2 / len(it.target.encode("utf-8"))
                                   for it, s in zip(items, scores)) / n,
        "chance": 0.0,
    }


def evaluate_items(model: nn.Module, tokenizer, items: Sequence[Item], **score_kwargs) -> dict:
    """The metrics of one task's items (all multiple-choice or all completion)."""
    if all(isinstance(it, MultipleChoiceItem) for it in items):
        pairs = [(it.context, ch) for it in items for ch in it.choices]
        flat = score_continuations(model, tokenizer, pairs, **score_kwargs)
        grouped, off = [], 0
        for it in items:
            grouped.append(flat[off:off + len(it.choices)])
            off += len(it.choices)
        return multiple_choice_metrics(items, grouped)
    if all(isinstance(it, CompletionItem) for it in items):
        scores = score_continuations(model, tokenizer, [(it.context, it.target) for it in items], **score_kwargs)
        return completion_metrics(items, scores)
    raise ValueError("items mix multiple-choice and completion items (or hold something else)")


def evaluate_tasks(
    model: nn.Module,
    tokenizer,
    tasks: Sequence[str] | Mapping[str, Sequence[Item]] = PAPER_TASKS,
    *,
    limit: int | None = None,
    cache_dir=None,
    tasks_dir=None,
    log: Callable[[str], None] | None = None,
    **score_kwargs,
) -> dict:
    """Zero-shot evaluation: ``{"tasks": {name: metrics}, "average": mean of the tasks' score}``.

    ``tasks``: names (loaded with :func:`~adahop.data.tasks.load_task`, first ``limit`` docs of
    each) or a mapping name -> items already loaded. Each task's metrics hold ``primary`` (the
    metric's name) and ``score`` (its value): ``acc_norm`` for multiple choice, ``acc`` for
    LAMBADA. ``score_kwargs`` go to :func:`score_continuations` (``max_seq_len``, ``batch_size``,
    ``device``, ``prefix``, ``autocast_dtype``)."""
    if isinstance(tasks, str):
        raise ValueError("tasks must be a sequence of task names (or a mapping), not a single string")
    if isinstance(tasks, Mapping):
        loaded = dict(tasks)
    else:
        for name in tasks:
            task_spec(name)  # unknown names fail before anything is downloaded or scored
        loaded = {name: load_task(name, limit=limit, cache_dir=cache_dir, tasks_dir=tasks_dir) for name in tasks}
    if not loaded:
        raise ValueError("no tasks to evaluate")
    _resolve_max_seq_len(model, score_kwargs.get("max_seq_len"))
    _check_vocab(model, tokenizer)
    results = {}
    for name, items in loaded.items():
        t0 = time.perf_counter()
        metrics = evaluate_items(model, tokenizer, items, **score_kwargs)
        is_completion = bool(items) and isinstance(items[0], CompletionItem)
        try:
            primary = task_spec(name).primary_metric
        except ValueError:  # a task of the caller's own
            primary = "acc" if is_completion else "acc_norm"
        metrics.update(primary=primary, score=metrics[primary], seconds=time.perf_counter() - t0)
        results[name] = metrics
        if log is not None:
            log(f"{name}: {primary} {metrics['score']:.4f} (n={metrics['n']}, chance {metrics['chance']:.3f}, "
                f"{metrics['seconds']:.1f}s)")
    average = sum(m["score"] for m in results.values()) / len(results)
    return {"tasks": results, "average": average,
            "average_of": {name: m["primary"] for name, m in results.items()}}


# --------------------------------------------------------------------------------------------
# Held-out loss


def bits_per_byte(loss_nats_per_token: float, tokens: int, nbytes: int) -> float:
    """``loss / ln 2`` bits per token times ``tokens / bytes`` tokens per byte."""
    if tokens <= 0 or nbytes <= 0:
        raise ValueError(f"tokens ({tokens}) and bytes ({nbytes}) must be positive")
    return loss_nats_per_token / LN2 * tokens / nbytes


def _split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, torch.Tensor):  # a window of T+1 tokens: inputs and targets shifted by one
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise ValueError(f"a token batch must be [B, T+1] with T >= 1, got {tuple(batch.shape)}")
        return batch[:, :-1], batch[:, 1:]
    inputs, targets = batch
    if inputs.shape != targets.shape:
        raise ValueError(f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape")
    return inputs, targets


def heldout_loss(
    model: nn.Module,
    batches_per_source: Mapping[str, Iterable],
    *,
    sizes: Mapping[str, tuple[int, int]] | None = None,
    device: torch.device | str | None = None,
    autocast_dtype: torch.dtype | None = None,
    ignore_index: int = -100,
) -> dict:
    """Held-out next-token loss per source.

    ``batches_per_source``: source name -> iterable of ``(inputs, targets)`` LongTensor pairs
    ``[B, T]`` (as the trainer gets them) or ``[B, T+1]`` token windows. Targets equal to
    ``ignore_index`` are not counted. ``sizes``: source -> ``(tokens, bytes)`` of its held-out
    shards (the corpus manifest), for bits per byte (``None`` for a source without sizes).

    Returns ``{"sources": {name: {"loss", "bpb", "tokens"}}, "loss", "bpb", "tokens"}``: the
    overall ``loss`` is token-weighted over all sources, the overall ``bpb`` is total bits over
    total estimated bytes (``None`` unless every source has sizes)."""
    device = torch.device(device) if device is not None else _model_device(model)
    sizes = dict(sizes or {})
    unknown = set(sizes) - set(batches_per_source)
    if unknown:
        raise ValueError(f"sizes given for sources without batches: {sorted(unknown)}")
    per_source = {}
    total_nats = total_tokens = total_bytes = 0.0
    all_bytes = True
    with eval_mode(model):
        for name, batches in batches_per_source.items():
            nats, count = 0.0, 0
            for batch in batches:
                inputs, targets = _split_batch(batch)
                inputs, targets = inputs.to(device), targets.to(device)
                if autocast_dtype is not None:
                    with torch.autocast(device.type, dtype=autocast_dtype):
                        logits = model(inputs)
                else:
                    logits = model(inputs)
                # float64 accumulation: a held-out set can hold millions of tokens
                nats += nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                    ignore_index=ignore_index, reduction="sum").double().item()
                count += int((targets != ignore_index).sum())
            if count == 0:
                raise ValueError(f"source {name!r}: no held-out tokens")
            loss = nats / count
            entry = {"loss": loss, "bpb": None, "tokens": count}
            if name in sizes:
                tokens, nbytes = sizes[name]
                entry["bpb"] = bits_per_byte(loss, tokens, nbytes)
                total_bytes += count * nbytes / tokens
            else:
                all_bytes = False
            per_source[name] = entry
            total_nats += nats
            total_tokens += count
    if not per_source:
        raise ValueError("no sources to evaluate")
    return {
        "sources": per_source,
        "loss": total_nats / total_tokens,
        "bpb": total_nats / LN2 / total_bytes if all_bytes else None,
        "tokens": int(total_tokens),
    }

