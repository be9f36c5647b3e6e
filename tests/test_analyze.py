"""The outlier study (adahop.analyze, adahop analyze): a tiny model with planted outliers, the report
folder and its schema, the GEMM errors against independent computations, bad input."""

import json
import math
from collections import namedtuple

import pytest
import torch
from torch import nn

import adahop
from adahop import cli
from adahop.analyze import REPORT_FILES, SCHEMA, figures, run_study, validate
from adahop.analyze.collect import capture_step, find_linears
from adahop.analyze.strategies import gemm_errors, layer_gemms, sqnr_db
from adahop.data import corpus as D
from adahop.data import sources as S
from adahop.drift import measure_drift
from adahop.linear import make_gemm_plan, mxfp4_gemm
from adahop.ops import get_backend

from tiny_lm import TinyLM, batches, encode_bytes, load_corpus

OUTLIER_CHANNELS = [3, 17, 50]  # of fc1's input: X column-wise
OUTLIER_ROWS = [5, 40, 77]  # of fc1's weight: W row-wise (output features)
OUTLIER_TOKENS = [7, 100, 200]  # weighted 50x in the loss: G row-wise
OE_K = 4


class Planted(nn.Module):
    """Two layers with planted outliers, and four that the study must leave out, each for its own
    reason: a dim below 32, never called, NaN in its input, no gradient reaching its output."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(64, 128, bias=False)
        self.fc2 = nn.Linear(128, 64, bias=False)
        self.small = nn.Linear(64, 16, bias=False)
        self.unused = nn.Linear(64, 64, bias=False)
        self.broken = nn.Linear(64, 64, bias=False)
        self.detached = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            for m in (self.fc1, self.fc2, self.small, self.unused, self.broken, self.detached):
                m.weight.normal_(0, 0.1, generator=g)
            self.fc1.weight[OUTLIER_ROWS] *= 30

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        bad = x.clone()
        bad[0, 0] = math.nan
        side = torch.nan_to_num(self.broken(bad), nan=0.0).mean() + self.small(x).mean()
        self.detached(x.detach())
        return y + 0 * side


def planted_batches(steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(256, 64, generator=g)
        x[:, OUTLIER_CHANNELS] *= 30
        w = torch.ones(256, 1)
        w[OUTLIER_TOKENS] = 50
        yield x, w


def weighted_loss(model, batch):
    x, w = batch
    return (model(x) * w).square().mean()


def all_iht(summary):  # a custom policy: what a measured policy plugs into
    return {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    policies = {**adahop.analyze.default_policies(OE_K), "all_iht": all_iht}
    result = run_study(Planted(), planted_batches(3), steps=3, sqnr_steps=2, loss_fn=weighted_loss, out=out,
                       oe_ks=(4, 16), policy_oe_k=OE_K, policies=policies, progress=False)
    return result, out


def layer(study, name):
    return next(la for la in study["layers"] if la["name"] == name)


def test_report_names_the_planted_patterns(study):
    st, out = study
    fc1, fc2 = layer(st, "fc1"), layer(st, "fc2")
    assert {r: fc1["tensors"][r]["pattern"] for r in "xwg"} == {"x": "col", "w": "row", "g": "row"}
    assert fc2["tensors"]["g"]["pattern"] == "row"
    # policy.py's flips: fprop (X, W^T), dgrad (G, W), wgrad (G^T, X)
    assert {g: tuple(fc1["gemms"][g]["pair"]) for g in ("fprop", "dgrad", "wgrad")} == {
        "fprop": ("col", "col"), "dgrad": ("row", "row"), "wgrad": ("col", "col")}
    assert fc1["policies"]["lv2"]["fprop"]["mode"] == "bf16"
    assert fc1["policies"]["lv1"]["fprop"] == {"mode": "iht+oe_right", "oe_k": OE_K, "strategy": f"iht+oe_right@{OE_K}"}
    md = (out / "summary.md").read_text()
    assert "| `fc1` | col | row | row | (col, col) | (row, row) | (col, col) |" in md
    assert "| X | 2 of 2 (100.0%)" in md  # planted patterns do not change over the steps


def test_left_out_layers_are_listed_with_the_reason(study):
    st, out = study
    skipped = {s["name"]: s["reason"] for s in st["skipped"]}
    assert skipped == {
        "small": "out_features = 16 < 32 (one MXFP4 block)",
        "unused": "not called in the forward",
        "broken": "x holds NaN or Inf",
        "detached": "no gradient reached its output (it does not affect the loss)",
    }
    md = (out / "summary.md").read_text()
    assert "- `broken`: x holds NaN or Inf" in md
    assert [la["name"] for la in st["layers"]] == ["fc1", "fc2"]


def test_every_file_is_written_and_the_json_validates(study):
    st, out = study
    for name in REPORT_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    on_disk = json.loads((out / "study.json").read_text())
    assert validate(on_disk) == []
    assert json.loads((out / "schema.json").read_text()) == SCHEMA
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        jsonschema.Draft202012Validator(SCHEMA).validate(on_disk)
    # the validator can fail: a wrong label, a missing field, a wrong type, an unknown key
    bad = json.loads(json.dumps(on_disk))
    bad["layers"][0]["tensors"]["x"]["steps"][0]["pattern"] = "diagonal"
    del bad["layers"][1]["gemms"]["fprop"]["pairs"]
    bad["settings"]["steps"] = "3"
    bad["surprise"] = 1
    errors = validate(bad)
    assert len(errors) == 4, errors
    assert any("'diagonal' is not one of" in e for e in errors) and any("missing 'pairs'" in e for e in errors)


def test_pngs_are_non_empty_with_labelled_axes(study, tmp_path, monkeypatch):
    st, out = study
    for name in figures.FIGURES:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    seen = {}
    save = figures.save_figure

    def keep(fig, path):
        seen[path.name] = [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]
        return save(fig, path)

    monkeypatch.setattr(figures, "save_figure", keep)
    figures.write_figures(st, tmp_path)
    assert set(seen) == set(figures.FIGURES)
    for name, axes in seen.items():
        assert axes and all(y for _, y in axes), name  # every panel has a y label
        assert any(x for x, _ in axes), name  # and the figure an x label


def test_sqnr_equals_an_independent_computation(study):
    """The study's SQNRs of fc1's GEMMs (step 0) against (a) fake quantization + Hadamard written
    out here and (b) the library's mxfp4_gemm in the OE modes, which the study derives from IHT."""
    st, _ = study
    model = Planted()
    batch = next(planted_batches(1))
    _, captured, _ = capture_step(model, batch, find_linears(model), weighted_loss)
    c = captured["fc1"]
    fc1 = layer(st, "fc1")
    ref = c.x_TK.double() @ c.w_NK.double().t()
    signal = ref.square().sum().item()

    def err(approx):
        return (ref - approx.double()).square().sum().item()

    def fq(t):
        return adahop.fake_quantize_mxfp4(t, dim=-1, scale_mode="even", rounding="rne")

    iht = fq(adahop.block_hadamard(c.x_TK, dim=-1, size=32)) @ fq(adahop.block_hadamard(c.w_NK, dim=-1, size=32)).t()
    naive = fq(c.x_TK) @ fq(c.w_NK).t()
    assert fc1["gemms"]["fprop"]["sqnr_db"]["iht"][0] == pytest.approx(sqnr_db(signal, err(iht)), abs=1e-4)
    assert fc1["gemms"]["fprop"]["sqnr_db"]["mxfp4"][0] == pytest.approx(sqnr_db(signal, err(naive)), abs=1e-4)

    backend = get_backend("reference")
    for gemm, mode in (("fprop", "iht+oe_right"), ("fprop", "iht+oe_left"), ("dgrad", "iht+oe_left"),
                       ("wgrad", "iht+oe_right")):
        op = layer_gemms(c.x_TK, c.w_NK, c.g_TN)[gemm]
        a_hp = op.a_matrix().to(torch.bfloat16).float()
        b_hp = op.b_matrix().to(torch.bfloat16).float()
        plan = make_gemm_plan(mode, adahop.GemmConfig(oe_k=OE_K), sr_seeds=(None, None), signs_seed=0)
        c_hat = mxfp4_gemm(plan, backend, op.a, op.a_dim, op.b, op.b_dim,
                           a_hp=lambda idx, a_hp=a_hp: a_hp if idx is None else a_hp[idx], b_hp=lambda b_hp=b_hp: b_hp,
                           out_dtype=torch.float32)
        ref_g = op.a_matrix().double() @ op.b_matrix().double()
        want = sqnr_db(ref_g.square().sum().item(), (ref_g - c_hat.double()).square().sum().item())
        got = fc1["gemms"][gemm]["sqnr_db"][f"{mode}@{OE_K}"][0]
        assert got == pytest.approx(want, abs=1e-4), (gemm, mode)
        assert got > fc1["gemms"][gemm]["sqnr_db"]["iht"][0]  # BF16 slices only remove error here
    # the high-precision share of OE-left in fprop is k over the tokens
    assert fc1["gemms"]["fprop"]["hp_share"][f"iht+oe_left@{OE_K}"] == OE_K / 256


def test_policies_and_the_ceiling(study):
    st, _ = study
    sm = st["summary"]
    assert set(sm["policies"]) == {"lv2", "lv1", "measured", "measured_fixed_k", "all_iht"}
    iht = [v for la in st["layers"] for g in ("fprop", "dgrad", "wgrad") for v in la["gemms"][g]["sqnr_db"]["iht"]]
    assert sm["policies"]["all_iht"]["mean_sqnr_db"] == pytest.approx(sum(iht) / len(iht))
    assert sm["policies"]["all_iht"]["hp_flop_share"] == 0
    assert sm["measured_gemms"] == 2 * 3 * 2  # layers x GEMMs x measured steps
    for la in st["layers"]:
        for g, d in la["gemms"].items():
            for i, best in enumerate(d["best"]):
                assert best != "bf16" and (g != "wgrad" or "oe_left" not in best)
                assert d["best_sqnr_db"][i] == max(d["sqnr_db"][s][i] for s in sm["ceiling"]["candidates"][g])
    # lv2 runs fc1's (col, col) GEMMs in BF16: fprop and wgrad, 2 of fc1's 3 equal GEMMs
    fc1_flops = layer(st, "fc1")["gemms"]["fprop"]["flops"]
    fc2_flops = layer(st, "fc2")["gemms"]["fprop"]["flops"]
    assert sm["policies"]["lv2"]["hp_flop_share"] >= 2 * fc1_flops / (3 * (fc1_flops + fc2_flops))


def test_an_hf_style_module_and_its_kv_projections():
    """Names and outputs as a Hugging Face model has them: ``.logits``, ``lm_head`` (left out, as
    convert leaves it out), ``self_attn.k_proj`` (a K/V projection for the findings)."""
    Out = namedtuple("Out", "logits")

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(32, 32, bias=False) for _ in range(3))

        def forward(self, h):
            return h + self.q_proj(h) * torch.sigmoid(self.k_proj(h)) + self.v_proj(h)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

        def forward(self, h):
            return self.self_attn(h)

    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            self.layers = nn.ModuleList([Block(), Block()])
            self.lm_head = nn.Linear(32, 50, bias=False)

        def forward(self, ids):
            h = self.embed(ids)
            for la in self.layers:
                h = la(h)
            return Out(self.lm_head(h))

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 33))
    st = run_study(HFStyle(), [(ids[:, :-1], ids[:, 1:])] * 2, steps=2, sqnr_steps=1, progress=False)
    assert [la["name"] for la in st["layers"]] == [f"layers.{b}.self_attn.{p}_proj" for b in (0, 1) for p in "qkv"]
    assert [la["block"] for la in st["layers"]] == [0, 0, 0, 1, 1, 1]
    kv = next(o for o in st["summary"]["observations"] if o["id"] == "kv_g_row")
    assert "of 4 K/V projections" in kv["evidence"] and "k_proj" in kv["evidence"] and "v_proj" in kv["evidence"]
    assert validate(json.loads(json.dumps(adahop.analyze.report.json_ready(st)))) == []


def test_gemm_errors_sees_the_planted_outer_dim_outliers():
    """OE-right on B's planted outer columns takes most of the error away; naive MXFP4 and IHT are
    alike on them (outer-dim outliers scale whole blocks: docs/method.md, 'Strategy per GEMM')."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    w = torch.randn(96, 128, generator=g)
    w[[3, 30]] *= 40  # two output rows of W: outer columns of B = W^T in fprop
    op = layer_gemms(x, w, torch.randn(256, 96, generator=g))["fprop"]
    e = gemm_errors(op, oe_ks=(2,))
    assert e.sqnr_db["iht+oe_right@2"] > e.sqnr_db["iht"] + 10
    assert e.oe_energy_share["iht+oe_right@2"] > 0.9
    assert abs(e.sqnr_db["iht"] - e.sqnr_db["mxfp4"]) < 1.0
    assert e.hp_share["iht+oe_right@2"] == 2 / 96 and e.hp_share["bf16"] == 1.0


def test_patterns_only_and_the_scale_of_g(tmp_path):
    """sqnr_steps=0 records patterns only, and the report still validates. A loss scaled by 2**-40
    makes G 1e12 times smaller (the reference detector's absolute 1e-8 hid its row outliers
    there): the labels, scores and quantization statistics are those of the unscaled loss (a
    power of two, so that MXFP4's errors scale exactly too: other factors move values within
    their binade, and MXFP4's error with them)."""
    st = run_study(Planted(), planted_batches(1), steps=1, sqnr_steps=0, out=tmp_path, progress=False,
                   loss_fn=lambda m, b: weighted_loss(m, b) * 2.0**-40)
    ref = run_study(Planted(), planted_batches(1), steps=1, sqnr_steps=0, progress=False, loss_fn=weighted_loss)
    assert validate(json.loads((tmp_path / "study.json").read_text())) == []
    for name in ("fc1", "fc2"):
        g, g_ref = layer(st, name)["tensors"]["g"], layer(ref, name)["tensors"]["g"]
        assert g["pattern"] == g_ref["pattern"] == "row"
        assert g["steps"][0]["rms"] == pytest.approx(g_ref["steps"][0]["rms"] * 2.0**-40, rel=1e-4)
        # (but G's own squared norm, which is 2**-80 the unscaled one's)
        assert g["mean"].pop("energy") == pytest.approx(g_ref["mean"].pop("energy") * 2.0**-80, rel=1e-5)
        assert g["mean"] == pytest.approx(g_ref["mean"], rel=1e-5)
        assert layer(st, name)["policies"] == layer(ref, name)["policies"]
    assert st["summary"]["measured_gemms"] == 0 and "sqnr_db" not in layer(st, "fc1")["gemms"]["fprop"]
    assert "No GEMM was multiplied" in (tmp_path / "summary.md").read_text()


def test_bad_models_give_clear_errors():
    with pytest.raises(ValueError, match="has no nn.Linear layers"):
        run_study(nn.Sequential(nn.ReLU()), [], progress=False)
    converted = adahop.convert_to_adahop_training(nn.Sequential(nn.Linear(64, 64)),
                                                  config=adahop.AdaHOPConfig.from_recipe_name("mxfp4"))
    with pytest.raises(ValueError, match="converted already"):
        run_study(converted, [], progress=False)
    tiny = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"every linear layer was left out .*in_features = 8 < 32"):
        run_study(tiny, [torch.randn(40, 8)], steps=1, loss_fn=lambda m, x: m(x).sum(), progress=False)
    with pytest.raises(ValueError, match="ran out after 1 of 2 steps"):
        run_study(Planted(), planted_batches(1), steps=2, loss_fn=weighted_loss, progress=False)
    with pytest.raises(ValueError, match="a batch must be"):
        run_study(Planted(), [torch.randn(4, 64)], steps=1, progress=False)


# ---- the command line -------------------------------------------------------------------------------
def one_line_error(capsys, *fragments):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for f in fragments:
        assert f in err, (f, err)


def test_cli_bad_input(tmp_path, capsys):
    out = ["--out", str(tmp_path / "rep")]
    assert cli.main(["analyze", "--model", "gpt5", *out]) == 2
    one_line_error(capsys, "--model must be one of smollm2, smollm2:PATH, hf:FOLDER, run:FOLDER")
    assert cli.main(["analyze", "--model", f"smollm2:{tmp_path / 'absent.gguf'}", *out]) == 2
    one_line_error(capsys, "no SmolLM2 file at")
    corrupt = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    corrupt.write_bytes(b"GGUF" + b"\0" * 100)
    if pytest.importorskip("gguf"):
        assert cli.main(["analyze", "--model", f"smollm2:{corrupt}", *out]) == 2
        one_line_error(capsys, "sha256 mismatch")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert cli.main(["analyze", "--model", "gpt5", "--out", str(a_file)]) == 2  # --out first, before the model
    one_line_error(capsys, str(a_file), "is not a folder")
    assert cli.main(["analyze", "--model", f"run:{tmp_path / 'nowhere'}", *out]) == 2
    one_line_error(capsys, "is not a run folder of adahop train")
    assert cli.main(["analyze", "--model", "smollm2", "--layers", "(", *out]) == 2
    one_line_error(capsys, "--layers '(' is not a regular expression")
    assert cli.main(["analyze", "--model", "smollm2", "--tau", "-1", *out]) == 2
    one_line_error(capsys, "tau must be a positive number")
    with pytest.raises(SystemExit):
        cli.main(["analyze", "--model", "smollm2", "--steps", "0"])


def test_cli_on_a_run_folder(tmp_path, capsys):
    corpus, run, rep = tmp_path / "corpus", tmp_path / "run", tmp_path / "rep"
    src = S.cpython_stdlib_source(modules=("json", "textwrap", "string", "argparse"), name="stdlib-mini")
    D.build_corpus(corpus, sources=[src], tokenizer="byte", progress=False)
    assert cli.main(["train", "--preset", "debug", "--recipe", "adahop_lv2", "--corpus", str(corpus), "--out", str(run),
                     "--steps", "2", "--seq-len", "32", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["analyze", "--model", f"run:{run}", "--steps", "2", "--tokens", "128", "--layers",
                     r"layers\.1\.", "--oe-k", "4", "--policy-oe-k", "4", "--out", str(rep), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "7 layers studied, 0 left out" in printed and f"report: {rep}/summary.md" in printed
    st = json.loads((rep / "study.json").read_text())
    assert validate(st) == []
    assert [la["name"].split(".")[1] for la in st["layers"]] == ["1"] * 7
    assert st["layers"][0]["tokens"] == 128 and st["data"]["seq_len"] == 32  # the run's context
    assert "adahop analyze --model run:" in st["model"]["command"]
    assert cli.main(["analyze", "--model", f"run:{run}", "--sources", "shakespeare", "--out", str(rep)]) == 2
    one_line_error(capsys, "the run's corpus has stdlib-mini")


# ---- drift of a calibrated model ----------------------------------------------------------------------
def test_measure_drift_sees_a_planted_change_and_leaves_training_alone():
    """A tiny LM calibrated with adahop_lv2 and re-measured on the same kind of batches; then its
    first layer's weight gets outlier rows (a label and a mode change), which only apply=True
    puts into the layer. Gradients and the SR call counters are as before the measurement."""
    torch.manual_seed(0)
    model = TinyLM(d=64, layers=1, heads=2, seq_len=64)
    cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=2, backend="reference")
    adahop.convert_to_adahop_training(model, config=cfg.with_gemm_settings(oe_k=4))
    tokens = encode_bytes(load_corpus()[:20000])
    for inputs, targets in batches(tokens, batch=4, seq_len=64, steps=2, seed=0):
        nn.functional.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1)).backward()
    assert adahop.is_calibrated(model)
    layers = adahop.adahop_layers(model)
    frozen = {n: dict(m.modes) for n, m in layers.items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    calls = {n: m.calls for n, m in layers.items()}

    def measure(apply=False):
        return measure_drift(model, batches(tokens, batch=4, seq_len=64, steps=2, seed=1), apply=apply)

    same = measure()
    assert same["steps"] == 2 and same["layers"] == len(layers)
    assert same["label_changes"] <= 2 and set(same["changed"]) <= set(layers)
    assert {n: m.calls for n, m in layers.items()} == calls
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())

    name, target = next((n, m) for n, m in layers.items() if n.endswith("up"))
    with torch.no_grad():
        target.weight[[1, 9]] *= 60  # outlier rows of W: row-wise, and fprop's pair changes
    drift = measure()
    assert drift["changed"][name]["patterns"]["w"][1] == "row"
    assert "fprop" in drift["changed"][name]["modes"] and target.modes == frozen[name]
    measure(apply=True)
    assert target.modes["fprop"] == drift["changed"][name]["modes"]["fprop"][1] and target.patterns["w"] == "row"
    with pytest.raises(ValueError, match="needs a calibrated adaptive model"):
        measure_drift(nn.Sequential(nn.Linear(4, 4)), [])


def test_drift_leaves_the_bf16_phase_to_the_schedule():
    """Once a BF16 phase switched the forward (``apply_bf16_phase``), its BF16 is the schedule's:
    re-measuring does not report it against the policy's mode, and ``apply`` keeps it (and no
    OE k for it) while the other GEMMs follow the new decision. A forward set back to MXFP4
    afterwards is the policy's again."""
    from adahop.schedule import apply_bf16_phase

    torch.manual_seed(0)
    model = TinyLM(d=64, layers=1, heads=2, seq_len=64)
    cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=1, backend="reference")
    adahop.convert_to_adahop_training(model, config=cfg)
    tokens = encode_bytes(load_corpus()[:20000])
    for inputs, targets in batches(tokens, batch=4, seq_len=64, steps=1, seed=0):
        nn.functional.cross_entropy(model(inputs).reshape(-1, 256), targets.reshape(-1)).backward()
    layers = adahop.adahop_layers(model)
    policy = {n: dict(m.modes) for n, m in layers.items()}
    assert any(m["fprop"] != "bf16" for m in policy.values())  # the phase changes something
    assert apply_bf16_phase(model, ("fprop",))
    drift = measure_drift(model, batches(tokens, batch=4, seq_len=64, steps=1, seed=1), apply=True)
    assert not [n for n, e in drift["changed"].items() if "fprop" in e.get("modes", {})]
    assert all(m.modes["fprop"] == "bf16" and "fprop" not in (m.oe_ks or {}) for m in layers.values())
    name, layer = next((n, m) for n, m in layers.items() if policy[n]["fprop"] != "bf16")
    layer.set_modes({**layer.modes, "fprop": policy[name]["fprop"]})
    with torch.no_grad():
        layer.weight[[1, 9]] *= 60  # outlier rows of W: the forward's pair changes
    drift = measure_drift(model, batches(tokens, batch=4, seq_len=64, steps=1, seed=1))
    assert "fprop" in drift["changed"][name]["modes"]
