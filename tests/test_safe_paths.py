"""File names read from files stay inside their folder (adahop.safe_paths): the check itself, a
run folder's ``latest`` pointer and a sharded checkpoint's ``.metadata``. The corpus manifest,
the tokenizer config and the Hugging Face index are tested with their loaders (test_data.py,
test_pretrained.py)."""

import dataclasses
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from adahop.safe_paths import file_in, is_plain_name
from adahop.train import checkpoint as C


def test_plain_names_and_the_others():
    for name in ("step_000000010.pt", "model-00001-of-00002.safetensors", ".hidden", "a..b", "tokenizer"):
        assert is_plain_name(name), name
    for name in ("", ".", "..", "../x", "/etc/passwd", "a/b", "a/", "a\\b", "C:x", "x\0y", None, 3, ["a"]):
        assert not is_plain_name(name), name
    assert file_in("/data/c", "a.bin", "m.json") == Path("/data/c/a.bin")
    with pytest.raises(ValueError, match=r"^m.json \(a shard\) names '\.\./x': only a plain file name inside "
                                         r"/data/c is allowed \(no folder part, no '\.\.', not an absolute path\)$"):
        file_in("/data/c", "../x", "m.json (a shard)")


@pytest.mark.parametrize("name", ["../elsewhere/step_000000005.pt", "VICTIM", "sub/step_000000005.pt"])
def test_a_latest_pointer_leaving_the_folder_is_refused(tmp_path, name):
    """A checkpoint outside the run folder (loadable, of a matching name) is never what
    ``latest`` points to."""
    ckpt, elsewhere = tmp_path / "run" / "checkpoints", tmp_path / "run" / "elsewhere"
    for folder in (ckpt / "sub", elsewhere):
        folder.mkdir(parents=True)
        torch.save({"step": 5}, folder / "step_000000005.pt")
    name = str(elsewhere / "step_000000005.pt") if name == "VICTIM" else name
    (ckpt / C.LATEST).write_text(name)
    with pytest.raises(ValueError, match=r"latest names .*only a plain file name inside"):
        C.latest_checkpoint(ckpt)
    (ckpt / C.LATEST).write_text("step_000000005.pt")
    with pytest.raises(ValueError, match="points to 'step_000000005.pt', which is not a checkpoint"):
        C.latest_checkpoint(ckpt)  # (not there)


def test_a_sharded_checkpoint_naming_a_file_outside_is_refused(tmp_path):
    """A sharded checkpoint's ``.metadata`` names the files its tensors are read from: a name
    leaving the folder is refused when the metadata is read, before any tensor file is opened.
    (torch's own reader follows it: shown first.)"""
    import torch.distributed.checkpoint as dcp

    path, outside = tmp_path / "run" / "checkpoints" / "step_000000001", tmp_path / "outside"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process, no process group: "assuming ... a single process"
        dcp.save({"model": {"w": torch.arange(6.0)}}, storage_writer=dcp.FileSystemWriter(str(path)))
    outside.mkdir()
    meta = pickle.loads((path / ".metadata").read_bytes())
    for key, info in meta.storage_data.items():
        shutil.move(path / info.relative_path, outside / info.relative_path)
        meta.storage_data[key] = dataclasses.replace(info, relative_path=f"../../../outside/{info.relative_path}")
    (path / ".metadata").write_bytes(pickle.dumps(meta))

    got = {"model": {"w": torch.zeros(6)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, storage_reader=dcp.FileSystemReader(str(path)))
    assert torch.equal(got["model"]["w"], torch.arange(6.0))  # read from outside the folder
    with pytest.raises(ValueError, match=r"\.metadata \(a tensor's file\) names '\.\./\.\./\.\./outside/.*"
                                         "only a plain file name inside"):
        C._safe_reader(path).read_metadata()
