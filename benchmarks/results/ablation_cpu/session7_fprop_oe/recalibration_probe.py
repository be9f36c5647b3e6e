"""Diagnostic: patterns and lv2 modes at calibration (steps 1-30) vs after 300 steps of training
(a second calibration on the trained weights), tiny model on the CPU.

    python recalibration_probe.py SEED CORPUS_DIR    (corpus: adahop data --sources shakespeare
                                                      gcide python-doc wordnet brown)"""
import collections
import sys

import torch

import adahop
from adahop.cli import open_run
from adahop.patterns.calibration import LayerCalibration
from adahop.train.data import load_corpus
from adahop.train.recipes import preset
from adahop.train.trainer import train
torch.set_num_threads(1)
seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
corpus_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/corpus"
cfg = preset("cpu", recipe="adahop_lv2", seed=seed, out_dir=f"/tmp/recal{seed}", corpus_dir=corpus_dir, progress=False)
corpus = load_corpus(cfg.corpus_dir)
model, batches = open_run(cfg, corpus)
train(cfg, model=model, train_batches=batches, resume=False)
layers = adahop.adahop_layers(model)
first = {n: (dict(l.patterns), dict(l.modes)) for n, l in layers.items()}
for l in layers.values():  # calibrate again on the trained network (BF16 meanwhile)
    l.calibration = LayerCalibration(); l.modes = None
model.train()
for _ in range(cfg.calibration_steps):
    x, y = next(batches)
    loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)
second = {n: (dict(l.patterns), dict(l.modes)) for n, l in layers.items()}


def count(state: dict, index: int, keys) -> list:
    """How many layers have each (key, value) in ``state[layer][index]`` (0: patterns, 1: modes)."""
    return sorted(collections.Counter((k, state[n][index][k]) for n in layers for k in keys).items())


print("modes at init:", count(first, 1, ("fprop", "dgrad", "wgrad")))
print("modes at step 300:", count(second, 1, ("fprop", "dgrad", "wgrad")))
print("patterns at init:", count(first, 0, ("x", "w", "g")))
print("patterns at step 300:", count(second, 0, ("x", "w", "g")))
