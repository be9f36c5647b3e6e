"""Profile three training steps of a model after calibration: CUDA kernel time by kernel, and the
wall time of those steps. python prof_train.py RECIPE SIZE OUTDIR"""
import json, sys, time, torch
from torch.profiler import profile, ProfilerActivity
from adahop.cli import open_run
from adahop.train.data import load_corpus
from adahop.train.recipes import preset
from adahop.train.trainer import train

recipe, size, out = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = preset("h200_125m", recipe=recipe, model_size=size, steps=60, calibration_steps=10, out_dir=f"runs/prof_{recipe}_{size}",
             corpus_dir=".carry/corpus", progress=False)
corpus = load_corpus(cfg.corpus_dir)
model, batches = open_run(cfg, corpus)
P0, P1 = 30, 33
state = {}

class Done(Exception):
    pass

def on_step(step, m):
    if step == P0:
        torch.cuda.synchronize(); state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]); state["prof"].__enter__(); state["t0"] = time.perf_counter()
    if step == P1:
        torch.cuda.synchronize(); wall = (time.perf_counter() - state["t0"]) / (P1 - P0)
        prof = state["prof"]; prof.__exit__(None, None, None)
        evs = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
        evs.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in evs) / 1e3 / (P1 - P0)
        rows = [(e.key[:90], round(e.device_time_total / 1e3 / (P1 - P0), 3), e.count // (P1 - P0)) for e in evs[:40]]
        print(f"PROF {recipe} {size}: wall {wall*1e3:.1f} ms/step, CUDA kernels {total:.1f} ms/step")
        for r in rows[:25]:
            print("  ", r)
        json.dump({"recipe": recipe, "size": size, "wall_ms_per_step": wall * 1e3, "cuda_ms_per_step": total, "top": rows},
                  open(f"{out}/prof_{recipe}_{size}.json", "w"), indent=1)
        raise Done

try:
    train(cfg, model=model, train_batches=batches, on_step=on_step, resume=False)
except Done:
    pass
