"""Record what calibration computes, exactly, to compare two revisions of the code bit for bit.

Not a test (pytest does not collect it): a tool for changes that must keep calibration's numbers.
It runs a fixed set of cases through the public calibration API (``observe_tensor``,
``observe_parts``, ``quant_stats``, ``LayerCalibration``, and converted tiny models calibrating:
table and measured policies, BF16 and IHT calibration GEMMs, micro-batch parts, a resume) and
writes every float as its hex, every dict as its (key, value) pairs in order:

    python tests/calibration_record.py OUT.json [--device cuda]     # on each revision
    python tests/calibration_record.py --compare A.json B.json       # exit 1 on a difference

The two files must come from the same machine and device (reductions round differently
elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_patterns_scale import planted  # noqa: E402

import adahop  # noqa: E402
from adahop.patterns.calibration import LayerCalibration, observe_parts, observe_tensor, tensor_part  # noqa: E402
from adahop.patterns.detect import unit_scaled  # noqa: E402
from adahop.patterns.quant_error import quant_stats  # noqa: E402

from tiny_lm import TinyLM  # noqa: E402


def exact(v):
    """JSON of ``v`` with floats as hex and dicts as ordered pairs."""
    if dataclasses.is_dataclass(v):
        return exact({f.name: getattr(v, f.name) for f in dataclasses.fields(v)})
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return {"int": v}
    if isinstance(v, float):
        return {"float": "nan" if math.isnan(v) else v.hex()}
    if isinstance(v, dict):
        return {"dict": [[k, exact(x)] for k, x in v.items()]}
    if isinstance(v, (list, tuple)):
        return [exact(x) for x in v]
    raise TypeError(f"cannot record {type(v).__name__}")


def tensor_cases(device):
    """(name, tensor) of the single-tensor cases."""
    cases = []
    for kind in ("row", "col", "none"):
        for shape in ((256, 192), (100, 37), (33, 64)):
            cases.append((f"{kind}{shape}", planted(kind, shape, seed=len(cases), device=device)))
    cases.append(("big_row", planted("row", (2048, 600), seed=1, device=device)))
    cases.append(("big_col", planted("col", (1500, 1300), seed=2, device=device)))
    base = planted("row", (128, 96), seed=3, device=device)
    cases += [("tiny", base * 2.0**-100), ("subnormal", base * 2.0**-140), ("huge", base * 2.0**100),
              ("f64_tiny", base.double() * 2.0**-600), ("f64_huge", base.double() * 2.0**600),
              ("bf16", base.bfloat16()), ("f16", base.half()), ("f64", base.double())]
    cases += [("zeros", torch.zeros(64, 64, device=device)), ("ones", torch.ones(64, 64, device=device)),
              ("nan", torch.full((64, 64), math.nan, device=device))]
    one_inf = base.clone()
    one_inf[5, 7] = math.inf
    one_nan = base.clone()
    one_nan[9, 1] = math.nan
    cases += [("one_inf", one_inf), ("one_nan", one_nan), ("neg_inf", -one_inf)]
    cases += [("empty_rows", torch.zeros(0, 64, device=device)), ("empty_cols", torch.zeros(64, 0, device=device))]
    cases += [(name, planted(kind, shape, device=device)) for name, kind, shape in (
        ("one_row", "none", (1, 64)), ("one_col", "none", (64, 1)), ("vector", "none", (128,)),
        ("3d", "col", (4, 16, 64)))]
    return cases


def part_cases(device):
    """(name, parts) of the observe_parts cases."""
    t = planted("row", (1024, 128), seed=1, device=device)
    t[:, 5] *= 4
    zero_last, zero_first = t.clone(), t.clone()
    zero_last[768:] = 0
    zero_first[:256] = 0
    far = t.double().clone()
    far[256:512] *= 2.0**-80
    very_far = t.double().clone()
    very_far[256:512] *= 2.0**-300
    nan_later, nan_first = t.clone(), t.clone()
    nan_later[600, 3] = math.nan
    nan_first[3, 3] = math.inf
    return [
        ("chunks4", t.chunk(4)), ("zero_last", zero_last.chunk(4)), ("zero_first", zero_first.chunk(4)),
        ("far", far.chunk(4)), ("very_far", very_far.chunk(4)), ("nan_later", nan_later.chunk(4)),
        ("nan_first", nan_first.chunk(4)), ("uneven", t[:10].chunk(3)), ("single_rows", t[:4].chunk(4)),
        ("all_zero", torch.zeros(64, 32, device=device).chunk(2)), ("one_part", (t,)),
    ]


def observations(device) -> dict:
    out = {}
    for name, t in tensor_cases(device):
        for k in (4, 16):
            for dims in ((1,), (1, 0)):
                out[f"{name}/k{k}/d{dims}"] = observe_tensor(t, tau=2.0, k=k, profile_dims=dims)
        out[f"{name}/noquant"] = observe_tensor(t, tau=2.0, k=8, quant=False)
        out[f"{name}/tau1.5"] = observe_tensor(t, tau=1.5, k=8, quant=False)
    for name, parts in part_cases(device):
        for quant in (True, False):
            # (profiles along dim 0 merge only for parts of one length)
            for dims in ((1,), (1, 0)) if len({p.shape[0] for p in parts}) == 1 else ((1,),):
                ps = [tensor_part(p, k=8, quant=quant, profile_dims=dims) for p in parts]
                out[f"parts/{name}/q{quant}/d{dims}"] = observe_parts(ps, tau=2.0, k=8)
    return out


def quant_stat_cases(device) -> dict:
    out = {}
    for kind, shape in (("col", (96, 80)), ("row", (100, 37)), ("row", (2048, 1536))):
        m = unit_scaled(planted(kind, shape, seed=5, device=device))
        out[f"{kind}{shape}"] = quant_stats(m, [2, 8, 64])
        out[f"{kind}{shape}/both"] = quant_stats(m, [4], profile_dims=(1, 0))
        out[f"{kind}{shape}/exact"] = quant_stats(m, [16], max_slices=10**9, max_length=10**9)
    out["zeros"] = quant_stats(torch.zeros(64, 64, device=device), [4])
    out["empty"] = quant_stats(torch.zeros(0, 64, device=device), [4])
    return out


def calibrations(device) -> dict:
    """LayerCalibration states after sequences of observations, NaN and zero ones among them."""
    out = {}
    seqs = {
        "mixed": [planted("col", (256, 192), seed=s, device=device) for s in range(3)]
        + [torch.full((256, 192), math.nan, device=device), torch.zeros(256, 192, device=device),
           planted("row", (256, 192), seed=9, device=device)],
        "nan_first": [torch.full((64, 96), math.nan, device=device), planted("row", (64, 96), device=device)],
        "zero_first": [torch.zeros(64, 96, device=device), planted("row", (64, 96), device=device)],
    }
    for name, ts in seqs.items():
        for quant in (True, False):
            cal = LayerCalibration()
            for i, t in enumerate(ts):
                for role in ("x", "w", "g"):
                    cal.add(role, observe_tensor(t if role != "w" else t.t(), tau=2.0, k=8, quant=quant,
                                                 profile_dims=(1, 0) if role == "w" else (1,)))
                if i == 1:
                    out[f"{name}/q{quant}/mid"] = cal.to_dict()
            out[f"{name}/q{quant}/state"] = cal.to_dict()
            out[f"{name}/q{quant}/summary"] = cal.summary()
            out[f"{name}/q{quant}/patterns"] = cal.patterns()
            back = LayerCalibration.from_dict(torch_roundtrip(cal.to_dict()))
            out[f"{name}/q{quant}/back"] = back.summary()
    return out


def torch_roundtrip(d):
    import io

    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def batches(seed, steps, batch=4, seq=32, vocab=64):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        s = (start + stride * torch.arange(seq + 1)) % vocab
        yield s[:, :-1], s[:, 1:]


def model_run(device, recipe, gemms="bf16", parts=1, steps=4, calibration_steps=3, resume_after=None) -> dict:
    torch.manual_seed(0)
    model = TinyLM(vocab=64, d=64, layers=2, heads=4, seq_len=32).to(device)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=calibration_steps,
                                               calibration_gemms=gemms).with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(model, config=cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {}
    for step, (inp, tgt) in enumerate(batches(0, steps)):
        inp, tgt = inp.to(device), tgt.to(device)
        opt.zero_grad()
        ctx = adahop.calibration_parts(model, parts) if parts > 1 else _null()
        with ctx:
            for pi, pt in zip(inp.chunk(parts), tgt.chunk(parts)):
                loss = torch.nn.functional.cross_entropy(model(pi).float().flatten(0, 1), pt.flatten()) / parts
                loss.backward()
        opt.step()
        layers = adahop.adahop_layers(model)
        out[f"step{step + 1}"] = {f: {"state": m.get_extra_state(), "calibrating": m.calibrating}
                                  for f, m in layers.items()}
        if resume_after == step + 1:  # a fresh model from the state_dict (through torch.save)
            state = torch_roundtrip(model.state_dict())
            torch.manual_seed(1)
            model = TinyLM(vocab=64, d=64, layers=2, heads=4, seq_len=32).to(device)
            adahop.convert_to_adahop_training(model, config=cfg)
            model.load_state_dict(state)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for f, m in adahop.adahop_layers(model).items():
        out[f"final/{f}"] = {"summary": m.calibration.summary(), "patterns": m.patterns, "modes": m.modes,
                             "oe_ks": m.oe_ks}
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def record(device, quick=False) -> dict:
    out = {"observations": observations(device), "quant_stats": quant_stat_cases(device),
           "calibrations": calibrations(device)}
    runs = {}
    for recipe in ("adahop_lv2", "adahop_measured"):
        for gemms in ("bf16",) if quick else ("bf16", "iht"):
            for parts in (1, 2):
                runs[f"{recipe}/{gemms}/p{parts}"] = model_run(device, recipe, gemms, parts)
        runs[f"{recipe}/resume"] = model_run(device, recipe, resume_after=1)
    out["models"] = runs
    return out


def diff(a, b, path=""):
    """The differences between two recordings (a dict's key order too)."""
    if type(a) is not type(b):
        yield f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict) and "dict" in a and "dict" in b:
        ka, kb = [k for k, _ in a["dict"]], [k for k, _ in b["dict"]]
        if ka != kb:
            yield f"{path}: key order {ka} != {kb}" if sorted(ka) == sorted(kb) else f"{path}: keys {ka} != {kb}"
        da, db = dict(a["dict"]), dict(b["dict"])
        for k in da.keys() & db.keys():
            yield from diff(da[k], db[k], f"{path}/{k}")
    elif isinstance(a, dict):
        if a.keys() != b.keys():
            yield f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a.keys() & b.keys():
            yield from diff(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        if len(a) != len(b):
            yield f"{path}: length {len(a)} != {len(b)}"
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                yield from diff(x, y, f"{path}[{i}]")
    elif a != b:
        yield f"{path}: {a!r} != {b!r}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--compare", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="without the models calibrating with IHT GEMMs")
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.files)
        problems = list(diff(a, b))
        for line in problems[:200]:
            print(line)
        print(f"{len(problems)} difference(s)")
        return 1 if problems else 0
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.device.startswith("cuda"):  # the math attention: the same bits run to run
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    Path(args.files[0]).write_text(json.dumps(exact(record(args.device, args.quick))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
