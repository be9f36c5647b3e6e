"""The size rule of adahop.convert (which nn.Linear layers stay in BF16 for being too small), its
composition with the LM-head rule, ``bf16_linears``, the refusal of bad thresholds, and the rule
in `adahop train` / `adahop eval` (`--min-features`)."""

from __future__ import annotations

import json

import pytest
from torch import nn

import adahop
from adahop import convert as C

CFG = adahop.AdaHOPConfig.from_recipe_name("mxfp4", backend="reference")


class Sizes(nn.Module):
    """Linears of several sizes, layer_size (the harmonic mean of in and out) in brackets, and a
    tied LM head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.small = nn.Linear(32, 16)  # [21.3]
        self.wide = nn.Linear(32, 256)  # [56.9]
        self.mid = nn.Linear(64, 64)  # [64]
        self.tall = nn.Linear(512, 128)  # [204.8]
        self.big = nn.Linear(128, 128)  # [128]
        self.proj = nn.Linear(32, 64)  # [42.7]
        self.head = nn.Linear(256, 64)  # [102.4]: an LM head by its name
        self.tied = nn.Linear(32, 64, bias=False)  # [42.7]
        self.tied.weight = self.embed.weight  # an LM head by its tied weight


def converted(model):
    return set(adahop.adahop_layers(model))


def test_size_filter_alone():
    m = Sizes()
    keep = C.size_filter(64)
    assert {n for n, mod in m.named_modules() if type(mod) is nn.Linear and keep(mod, n)} == {
        "mid", "tall", "big", "head"}
    assert all(C.size_filter(0)(mod, n) for n, mod in m.named_modules() if type(mod) is nn.Linear)
    assert not any(C.size_filter(10_000)(mod, n) for n, mod in m.named_modules() if type(mod) is nn.Linear)


@pytest.mark.parametrize("min_features, expected", [
    (0, {"small", "wide", "mid", "tall", "big", "proj"}),  # every layer but the two LM heads
    (21, {"small", "wide", "mid", "tall", "big", "proj"}),
    (22, {"wide", "mid", "tall", "big", "proj"}),
    (64, {"mid", "tall", "big"}),  # exactly 64 converts; wide (32 -> 256: 56.9) goes, head stays out
    (65, {"tall", "big"}),
    (129, {"tall"}),  # min(in, out) = 128 but layer_size 204.8
    (205, set()),
])
def test_default_filter_composes_size_and_lm_head(min_features, expected):
    m = Sizes()
    out = adahop.convert_to_adahop_training(m, config=CFG,
                                            module_filter_fn=C.default_module_filter(m, min_features=min_features))
    assert out is m and converted(m) == expected
    assert type(m.head) is nn.Linear and type(m.tied) is nn.Linear  # LM heads at every threshold


def test_default_threshold_converts_every_size():
    # MIN_FEATURES is the library default; at 0 the default conversion is the LM-head rule alone
    m = Sizes()
    adahop.convert_to_adahop_training(m, config=CFG)
    expected = {n for n, mod in Sizes().named_modules()
                if type(mod) is nn.Linear and n not in ("head", "tied")
                and C.layer_size(mod.in_features, mod.out_features) >= C.MIN_FEATURES}
    assert converted(m) == expected


def test_bf16_linears_says_why():
    m = Sizes()
    adahop.convert_to_adahop_training(m, config=CFG, module_filter_fn=C.default_module_filter(m, min_features=64))
    reasons = C.bf16_linears(m, min_features=64)
    assert set(reasons) == {"small", "wide", "proj", "head", "tied"}
    assert C.layer_size(32, 256) == C.layer_size(256, 32) == 2 * 32 * 256 / 288
    assert reasons["head"] == "LM head (name ends in 'head')"
    assert reasons["tied"] == "LM head (weight tied to an nn.Embedding)"
    assert reasons["small"] == "size: layer_size(32, 16) = 21.3 < min_features = 64"
    assert reasons["wide"] == "size: layer_size(32, 256) = 56.8 < min_features = 64"  # (56.89, never rounded up)
    # a layer both rules accept but a custom filter refused
    m = Sizes()
    default = C.default_module_filter(m)
    adahop.convert_to_adahop_training(m, config=CFG, module_filter_fn=lambda mod, fqn: default(mod, fqn)
                                      and fqn != "big")
    assert C.bf16_linears(m) == {"big": "refused by the module_filter_fn given",
                                 "head": "LM head (name ends in 'head')",
                                 "tied": "LM head (weight tied to an nn.Embedding)"}


def test_a_model_that_is_one_linear():
    lin = nn.Linear(32, 16)
    assert adahop.convert_to_adahop_training(lin, config=CFG, module_filter_fn=C.default_module_filter(
        lin, min_features=32)) is lin
    assert type(adahop.convert_to_adahop_training(lin, config=CFG)) is adahop.AdaHOPLinear


@pytest.mark.parametrize("bad", [-1, 1.5, 64.0, "64", None, True])
def test_bad_thresholds_are_one_line_value_errors(bad):
    m = Sizes()
    for make in (lambda: C.size_filter(bad), lambda: C.default_module_filter(m, min_features=bad),
                 lambda: C.bf16_linears(m, min_features=bad)):
        with pytest.raises(ValueError, match=r"^min_features must be an int >= 0") as e:
            make()
        assert "\n" not in str(e.value)


# ---- benchmarks/bench_linear.py, section sizes: the grid and the table with a fake timer ---------------------
def test_bench_linear_sizes_grid_and_table(monkeypatch, capsys):
    """The section's shape list (every (out, in) pair of the grid, each variant paired once
    against BF16) and what it decides: a fake timer makes every shape with layer_size >= 128
    pay, and (64, 256) (102.4) too, for adahop_lv2; mxfp4 pays nowhere. (The layers are built on the CPU, the
    timed functions never called; tests/test_benchmarks.py runs them under the interpreter.)"""
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    monkeypatch.syspath_prepend(bench_dir)
    import bench_linear as bl
    import common

    grid = (32, 64, 128, 256)
    monkeypatch.setattr(common, "DEVICE", "cpu")
    expected = [(n, k, v) for n in grid for k in grid for v in bl.SIZE_VARIANTS]
    calls = []

    def fake_paired(base_fn, fn, pairs, rep):
        n, k, v = expected[len(calls)]
        calls.append((n, k, v, pairs, rep))
        pays = v == "adahop_lv2" and (C.layer_size(n, k) >= 128 or (n, k) == (64, 256))
        return (1.25 if pays else 0.8), [2.0] * pairs, [1.0] * pairs

    monkeypatch.setattr(bl, "paired_speedup", fake_paired)
    rows = bl.section_sizes(grid, tokens=8, pairs=2, rep=50, timings=("eager",))
    assert len(calls) == len(expected) and all(c[3:] == (2, 50) for c in calls)
    shapes, summary = rows[:-2], rows[-2:]
    assert [tuple(r["shape"]) for r in shapes] == [(n, k) for n in grid for k in grid]
    assert all(r["tokens"] == 8 and r["bf16_ms"] == 2.0 and set(r["speedup_vs_bf16"]) == set(bl.SIZE_VARIANTS)
               for r in shapes)
    lv2, mx = summary
    assert lv2["summary"] == "adahop_lv2" and lv2["min_features"] == 128 and lv2["paying_left_in_bf16"] == [(64, 256)]
    assert len(lv2["paying"]) == 5 and lv2["shapes"] == 16
    assert mx["min_features"] is None and mx["paying"] == []
    table = capsys.readouterr().out
    assert "| 64 | 256 | 102 | 2.000 | 1.25x | 0.80x | adahop_lv2 |" in table
    assert "| 32 | 32 | 32 | 2.000 | 0.80x | 0.80x | - |" in table
    assert "adahop_lv2: 5/16 shapes pay; min_features = 128: every shape with layer_size >= 128 pays; " \
           "1 paying shapes below it" in table
    assert "mxfp4: 0/16 shapes pay; no threshold" in table
    # the threshold the table gives is the convert rule's: it converts exactly the shapes >= 128
    keep = C.size_filter(lv2["min_features"])
    assert [s for s in [tuple(r["shape"]) for r in shapes] if keep(nn.Linear(s[1], s[0]), "x")] == [
        s for s in lv2["paying"] if s != (64, 256)]


def test_train_and_eval_keep_the_size_rule(tmp_path, capsys):
    """``adahop train --min-features N`` leaves the small linears in BF16 (and says so), records
    N, and ``adahop eval`` rebuilds the run with the same conversion; a bad N is one line."""
    from adahop import cli
    from adahop.data import corpus as D
    from adahop.data import sources as S

    corpus = tmp_path / "corpus"
    D.build_corpus(corpus, sources=[S.cpython_stdlib_source(modules=("json", "textwrap"), name="mini")],
                   tokenizer="byte", progress=False)
    run = tmp_path / "run"
    args = ["train", "--preset", "debug", "--recipe", "mxfp4", "--corpus", str(corpus), "--out", str(run),
            "--steps", "2", "--seq-len", "32", "--no-progress"]
    # the tiny model: dim 64, 2 KV heads of 16 (wk, wv: 64 -> 32), FFN 192
    assert cli.main([*args, "--min-features", "64"]) == 0
    assert "4 linear layers stay BF16 by the size rule (layer_size < 64)" in capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["min_features"] == 64
    modes = json.loads((run / "modes.json").read_text())
    assert modes and not any(".wk" in n or ".wv" in n for n in modes)
    assert any(".wq" in n for n in modes) and any(".w1" in n for n in modes)
    assert cli.main(["eval", "--run", str(run), "--tasks", "--heldout-batches", "2"]) == 0
    assert cli.main([*args[:-1], "--out", str(tmp_path / "bad"), "--min-features", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("min_features must be an int >= 0 (0 converts every size), got -1")


def test_the_hopper_threshold_is_the_one_its_measurement_gives(monkeypatch):
    """``HOPPER_MIN_FEATURES`` against the committed H200 and H100 sweeps, for both recipes, eager
    and from a CUDA graph: every shape it converts is faster than BF16 in every timing, and the
    paying shapes it leaves in BF16 gain at most 4% (the data behind the constant)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import bench_linear as bl

    keep = C.size_filter(C.HOPPER_MIN_FEATURES)
    for folder, n_shapes in (("layer_sizes_h200_2026-12-06", 36), ("layer_sizes_h100_2026-12-06", 16)):
        data = root / "benchmarks/results" / folder / "sizes.jsonl"
        rows = [json.loads(line) for line in data.read_text().splitlines()]
        shapes = [r for r in rows if "shape" in r]
        assert {r["summary"] for r in rows if "summary" in r} == set(bl.size_keys()) and len(shapes) == n_shapes
        converted = [r for r in shapes if keep(nn.Linear(r["shape"][1], r["shape"][0]), "x")]
        assert converted and len(converted) < len(shapes)
        for r in shapes:
            ratios = r["speedup_vs_bf16"].values()
            if r in converted:
                assert min(ratios) > 1.0, (folder, r["shape"])
            else:
                assert max(ratios) < 1.05, (folder, r["shape"])
