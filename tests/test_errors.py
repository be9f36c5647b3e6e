"""Foreseeable errors are one line naming what went wrong, never "This is a bug in adahop": bad
--threads, a checkpoint that does not fit the model, a full disk under torch.save, damaged
Hugging Face folders and sharded checkpoints, the GPU out of memory, a rank lost under torchrun."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from adahop import cli
from adahop.data import corpus as D
from adahop.data import sources as S
from adahop.train import checkpoint as C

from tiny_lm import TinyLM


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    src = S.cpython_stdlib_source(modules=("json", "textwrap"), name="stdlib-mini")
    D.build_corpus(out, sources=[src], tokenizer="byte", progress=False)
    return out


def train_args(corpus, out, steps=2):
    return ["train", "--preset", "debug", "--recipe", "bf16", "--corpus", str(corpus), "--out", str(out),
            "--steps", str(steps), "--seq-len", "32", "--no-progress"]


def one_line_error(capsys, *fragments):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "bug in adahop" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


@pytest.mark.parametrize("command", [["train"], ["analyze", "--model", "smollm2"]])
def test_negative_threads_are_refused_by_the_parser(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--threads", "-3"])
    assert e.value.code == 2
    assert "--threads: expected an integer >= 0, got -3" in capsys.readouterr().err


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    import adahop.train.trainer as trainer_mod

    run = tmp_path / "run"
    train = trainer_mod.train
    monkeypatch.setattr(trainer_mod, "train", lambda *a, **kw: train(*a, **kw, stop_after=2))
    assert cli.main(train_args(corpus, run, steps=3)) == 0  # stopped after step 2, its checkpoint
    monkeypatch.setattr(trainer_mod, "train", train)
    found = C.latest_checkpoint(run / "checkpoints")
    state = torch.load(found, weights_only=True)
    emb = state["model"]["tok_embeddings.weight"]
    state["model"]["tok_embeddings.weight"] = torch.zeros(emb.shape[0] + 1, emb.shape[1])  # another model's
    torch.save(state, found)
    capsys.readouterr()
    assert cli.main(["eval", "--run", str(run), "--tasks", "--heldout-batches", "1"]) == 2
    one_line_error(capsys, f"{found} does not fit the model", "size mismatch for tok_embeddings.weight")
    assert cli.main(train_args(corpus, run, steps=3)) == 2  # the resume
    one_line_error(capsys, f"{found} does not fit the model", "tok_embeddings.weight")
    from adahop.analyze.inputs import load_subject

    with pytest.raises(ValueError, match="does not fit the model: size mismatch for tok_embeddings.weight"):
        load_subject(f"run:{run}")


def test_a_full_disk_under_torch_save_names_the_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    real_save = torch.save

    def save_on_full_disk(obj, f, *args, **kwargs):  # torch's own writer on a file that takes no bytes
        real_save(obj, "/dev/full", *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_full_disk)
    run = tmp_path / "full"
    assert cli.main(train_args(corpus, run)) == 2
    one_line_error(capsys, "cannot write or read", str(run / "checkpoints" / "step_000000002.pt"),
                   "torch.save failed", "is the disk full?")
    assert not list((run / "checkpoints").glob("*.tmp"))  # the partial file is gone


@pytest.fixture()
def hf_folder(tmp_path):
    pytest.importorskip("safetensors")
    from test_continued_pretraining import HF_SMALL
    from test_pretrained import hf_weights, write_hf

    return write_hf(tmp_path / "hf", HF_SMALL, hf_weights(HF_SMALL), shards=2)


def test_damaged_hugging_face_folders_name_the_file(hf_folder):
    from adahop.llama.pretrained import load_hf_llama

    index = hf_folder / "model.safetensors.index.json"
    shard = sorted(hf_folder.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{shard} is not a readable safetensors file"):
        load_hf_llama(hf_folder)
    shard.write_bytes(data)
    good_index = index.read_text()
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=f"{index} has no weight_map"):
        load_hf_llama(hf_folder)
    index.write_text(good_index)
    config = hf_folder / "config.json"
    config.write_text('{"model_type": "llama", ')
    with pytest.raises(ValueError, match=f"{config} is not valid JSON"):
        load_hf_llama(hf_folder)
    config.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"{config} holds a JSON list, not an object"):
        load_hf_llama(hf_folder)


def test_a_damaged_tokenizer_json_names_the_file(tmp_path):
    pytest.importorskip("tokenizers")
    from adahop.data.tokenizer import BPETokenizer

    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=f"{bad} is not a tokenizer file the tokenizers library reads"):
        BPETokenizer.from_file(bad)


@pytest.mark.parametrize("error, says", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"),
     ["out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB", "lower --batch-size"]),
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:23446. This is typically caused by a remote worker crashing."),
     ["lost another rank of the run", "torchrun's summary names its rank"]),
])
def test_out_of_memory_and_a_lost_rank_are_not_called_bugs(error, says, tmp_path, capsys, monkeypatch):
    def fail(args):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "train", fail)
    assert cli.main(train_args(tmp_path, tmp_path / "r")) == 2
    one_line_error(capsys, *says)


# ---- sharded checkpoints ---------------------------------------------------------------------------
def _tiny():
    torch.manual_seed(0)
    model = TinyLM(vocab=64, d=32, layers=1, heads=2, seq_len=8)
    return model, torch.optim.AdamW(model.parameters())


@pytest.fixture()
def sharded(tmp_path):
    """A sharded checkpoint of one process (torch.distributed.checkpoint needs no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt = _tiny()
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    opt.step()
    path = tmp_path / "step_000000001"
    with pytest.warns(UserWarning):  # dcp warns that it runs without a process group
        dcp.save({"model": C._tensors(get_model_state_dict(model)),
                  "optim": get_optimizer_state_dict(model, opt)["state"]}, storage_writer=dcp.FileSystemWriter(path))
    (path / C.SHARDED_STATE).write_text(json.dumps({"format": C.SHARDED_FORMAT, "format_version": C.SHARDED_VERSION,
                                                    "world_size": 1, "step": 1, "config": {}}))
    torch.save({"data": {}}, C.rank_file(path, 0))
    return path


def _load(path):
    model, opt = _tiny()
    return C.load_sharded(path, model=model, optimizer=opt, par=SimpleNamespace(rank=0, world=1))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_damaged_sharded_checkpoints_are_one_line_naming_the_file(sharded):
    assert _load(sharded)["step"] == 1
    part = sharded / "__0_0.distcp"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{part} is truncated: {len(data) // 2} bytes"):
        _load(sharded)
    part.unlink()
    with pytest.raises(ValueError, match=f"{part} is missing"):
        _load(sharded)
    part.write_bytes(b"\0" * len(data))  # the right size, no zip inside: dcp's own error, named
    with pytest.raises(ValueError, match=f"cannot read the sharded checkpoint {sharded}: a .distcp part is damaged"):
        _load(sharded)
    part.write_bytes(data)
    meta = sharded / ".metadata"
    good = meta.read_bytes()
    meta.write_bytes(b"garbage")
    with pytest.raises(ValueError, match=f"cannot read {sharded}/.metadata"):
        _load(sharded)
    meta.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=f"cannot read {sharded}/.metadata"):
        _load(sharded)
    shutil.rmtree(sharded)


def test_a_checkpoint_exception_that_escapes_is_one_line(tmp_path, capsys, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    def fail(args):
        raise CheckpointException("Failed to load", {0: (OSError(5, "Input/output error"), None)})

    monkeypatch.setitem(cli.COMMANDS, "train", fail)
    assert cli.main(train_args(tmp_path, tmp_path / "r")) == 2
    one_line_error(capsys, "a sharded checkpoint could not be read or written: OSError", "Input/output error")


# ---- a corpus without held-out text ----------------------------------------------------------------
def test_a_corpus_without_held_out_text_is_refused_before_training(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        D.build_corpus(tmp_path / "none", sources=[S.cpython_stdlib_source(modules=("textwrap",), name="one")],
                       tokenizer="byte", val_fraction=0.0, progress=False)
    (tmp_path / "c").mkdir()
    assert cli.main(["data", "--out", str(tmp_path / "c"), "--val-fraction", "0", "--no-progress"]) == 2
    one_line_error(capsys, "val_fraction must be in (0, 1)")
    # one document: nothing can be held out, the validation shard is empty
    one_doc = tmp_path / "one_doc"
    one_doc.mkdir()
    D.build_corpus(one_doc, sources=[S.cpython_stdlib_source(modules=("textwrap",), name="one")], tokenizer="byte",
                   progress=False)
    assert D.load_corpus(one_doc).shard_info("one", "val")["tokens"] == 0
    run = tmp_path / "run"
    assert cli.main(train_args(one_doc, run)) == 2
    one_line_error(capsys, "the held-out shard of 'one' has 0 tokens, fewer than one window of seq_len + 1 = 33",
                   "--val-fraction")
    assert not (run / "log.jsonl").exists() and not list(run.glob("checkpoints/step_*"))  # no step was trained
