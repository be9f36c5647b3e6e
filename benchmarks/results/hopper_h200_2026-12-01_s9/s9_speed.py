"""Session 9: training speed of one (recipe, size, compile, AdamW implementation) on one GPU.
Steady tokens/s over steps [P0, P1) (after calibration and compilation), peak memory, the losses
of the first steps, and a profile of three steps after P1 (CUDA kernel time by kernel).
python s9_speed.py RECIPE SIZE {eager,compile} {fused,foreach} OUT.jsonl"""
import json, os, sys, time, torch
from torch.profiler import profile, ProfilerActivity
import adahop.train.trainer as trainer_mod
from adahop.cli import open_run
from adahop.train.data import load_corpus
from adahop.train.recipes import preset

recipe, size, mode, opt_impl, out = sys.argv[1:6]
P0, P1, PROF = 30, 60, 3
cfg = preset("h200_125m", recipe=recipe, model_size=size, steps=1000, calibration_steps=10,
             out_dir=f"runs/s9_{recipe}_{size}_{mode}_{opt_impl}", corpus_dir=".carry/corpus", progress=False,
             compile=(mode == "compile"))
if opt_impl == "foreach":
    orig = trainer_mod.make_optimizer
    def make_optimizer(model, cfg):
        opt = orig(model, cfg)
        for g in opt.param_groups:
            g["fused"] = None
            g["foreach"] = True
        return opt
    trainer_mod.make_optimizer = make_optimizer
corpus = load_corpus(cfg.corpus_dir)
model, batches = open_run(cfg, corpus)
state = {"t_start": time.perf_counter()}

class Done(Exception):
    pass

def on_step(step, m):
    if step == 1:
        torch.cuda.synchronize(); state["first_step_s"] = time.perf_counter() - state["t_start"]
    if step == P0:
        torch.cuda.synchronize(); state["t0"] = time.perf_counter()
    if step == P1:
        torch.cuda.synchronize(); state["steady_s_per_step"] = (time.perf_counter() - state["t0"]) / (P1 - P0)
        shapes = os.environ.get("PROF_SHAPES") == "1"
        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if shapes else [ProfilerActivity.CUDA]
        state["prof"] = profile(activities=acts, record_shapes=shapes); state["prof"].__enter__()
    if step == P1 + PROF:
        torch.cuda.synchronize()
        prof = state["prof"]; prof.__exit__(None, None, None)
        if os.environ.get("PROF_SHAPES") == "1":
            ops = [e for e in prof.key_averages(group_by_input_shape=True)
                   if e.key.startswith("aten::") and e.device_time_total > 0 and e.key not in ("aten::mm", "aten::_scaled_mm")]
            ops.sort(key=lambda e: -e.self_device_time_total)
            state["ops_by_shape"] = [(e.key, str(e.input_shapes)[:120], round(e.self_device_time_total / 1e3 / PROF, 3), e.count // PROF) for e in ops[:40]]
            for r in state["ops_by_shape"][:25]:
                print("  OP", r)
        evs = [e for e in prof.key_averages() if e.device_time_total > 0 and (e.device_type.name == "CUDA" or os.environ.get("PROF_SHAPES") != "1")]
        evs.sort(key=lambda e: -e.device_time_total)
        state["cuda_ms_per_step"] = sum(e.device_time_total for e in evs) / 1e3 / PROF
        state["top"] = [(e.key[:80], round(e.device_time_total / 1e3 / PROF, 3), e.count // PROF) for e in evs[:30]]
        raise Done

try:
    trainer_mod.train(cfg, model=model, train_batches=batches, on_step=on_step, resume=False)
except Done:
    pass
tokens = cfg.batch_size * cfg.seq_len
log = [json.loads(l) for l in open(f"{cfg.out_dir}/log.jsonl") if l.strip()]
res = {"recipe": recipe, "size": size, "mode": mode, "adamw": opt_impl,
       "steady_tok_s": tokens / state["steady_s_per_step"], "steady_ms_per_step": 1e3 * state["steady_s_per_step"],
       "first_step_s": state["first_step_s"], "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
       "cuda_ms_per_step": state["cuda_ms_per_step"], "losses": [r["loss"] for r in log][:P1], "top": state["top"],
       "ops_by_shape": state.get("ops_by_shape")}
print(f"RESULT {recipe:12s} {size:5s} {mode:8s} {opt_impl:8s} {res['steady_tok_s']:10.0f} tok/s "
      f"{res['steady_ms_per_step']:7.1f} ms/step  cuda {res['cuda_ms_per_step']:7.1f}  first step {res['first_step_s']:5.1f} s  "
      f"peak {res['peak_gib']:.2f} GiB  loss@{P1} {res['losses'][-1]:.4f}")
for r in res["top"][:12]:
    print("   ", r)
with open(out, "a") as f:
    f.write(json.dumps(res) + "\n")
