"""Model conversion (adahop.convert), checkpoints (state_dict extra state), the modes JSON
(adahop.modes_io), a few training steps of a converted tiny transformer under every recipe, and the
example loop of examples/, mostly on the tests' TinyLM (tests/tiny_lm.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import adahop
from adahop import AdaHOPConfig, AdaHOPLinear
from adahop.policy import policy_result

from tiny_lm import TinyLM, batches, encode_bytes, lm_loss, load_corpus

RECIPES = tuple(adahop.RECIPES)
ADAPTIVE = tuple(r for r in RECIPES if AdaHOPConfig.from_recipe_name(r).adaptive)
BLOCK_LINEARS = ("qkv", "proj", "up", "down")



@pytest.fixture(scope="module")
def tokens():
    return encode_bytes(load_corpus())


def tiny(seed=0, d=32, layers=2, heads=2, seq_len=16):
    torch.manual_seed(seed)
    return TinyLM(d=d, layers=layers, heads=heads, seq_len=seq_len)


def block_names(layers=2):
    return {f"blocks.{i}.{n}" for i in range(layers) for n in BLOCK_LINEARS}


def step(model, inputs, targets):
    loss = lm_loss(model, inputs, targets)
    loss.backward()
    return loss.detach()


def fixed_batch(seed=0, batch=2, seq_len=16, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    chunk = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
    return chunk[:, :-1], chunk[:, 1:]


# ------------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("recipe", RECIPES)
def test_convert_tinylm(recipe):
    model = tiny()
    params_before = dict(model.named_parameters())
    ids_before = [id(p) for p in model.parameters()]
    cfg = AdaHOPConfig.from_recipe_name(recipe)
    out = adahop.convert_to_adahop_training(model, config=cfg)
    assert out is model
    layers = adahop.adahop_layers(model)
    assert set(layers) == block_names()
    for fqn, layer in layers.items():
        assert type(layer) is AdaHOPLinear and layer.layer_name == fqn and layer.config == cfg
        assert layer.training
        assert layer.calibrating == cfg.adaptive
    assert type(model.lm_head) is nn.Linear
    assert not any(type(m) is nn.Linear for m in model.modules() if m is not model.lm_head)
    # the same Parameter objects, under the same names
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[k] is params_before[k] for k in params_before)
    assert [id(p) for p in model.parameters()] == ids_before
    assert model.blocks[0].qkv.weight.device.type == "cpu"  # not left on the meta device
    # it runs, and converting again changes nothing
    step(model, *fixed_batch())
    adahop.convert_to_adahop_training(model, config=cfg)
    assert adahop.adahop_layers(model) == layers


def test_optimizer_built_before_conversion_updates_converted_layers():
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"))
    w0 = model.blocks[0].up.weight.detach().clone()
    step(model, *fixed_batch())
    opt.step()
    assert not torch.equal(model.blocks[0].up.weight, w0)


def test_module_filter_fn():
    model = tiny()
    seen = []

    def only_mlp(mod, fqn):
        seen.append(fqn)
        return fqn.endswith((".up", ".down"))

    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"), module_filter_fn=only_mlp)
    assert set(adahop.adahop_layers(model)) == {f"blocks.{i}.{n}" for i in range(2) for n in ("up", "down")}
    assert type(model.blocks[0].qkv) is nn.Linear and type(model.lm_head) is nn.Linear
    assert set(seen) == block_names() | {"lm_head"}  # called for every nn.Linear, with its fqn

    # a custom filter may also convert the head (the default would not)
    model = tiny()
    cfg = AdaHOPConfig.from_recipe_name("bf16")
    adahop.convert_to_adahop_training(model, config=cfg, module_filter_fn=lambda m, n: True)
    assert isinstance(model.lm_head, AdaHOPLinear)


class TiedLM(nn.Module):
    """A head tied to the embedding, under a name that is not in the head-name list."""

    def __init__(self, vocab=64, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.decoder = nn.Linear(d, vocab, bias=False)
        self.decoder.weight = self.embed.weight

    def forward(self, idx):
        return self.decoder(torch.relu(self.body(self.embed(idx))))


def test_tied_head_is_excluded_under_any_name():
    model = TiedLM()
    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"))
    assert set(adahop.adahop_layers(model)) == {"body"}
    assert type(model.decoder) is nn.Linear
    assert model.decoder.weight is model.embed.weight
    out = model(torch.randint(0, 64, (2, 5)))
    out.sum().backward()
    assert model.embed.weight.grad is not None


@pytest.mark.parametrize("bias", [False, True])
def test_bare_linear_is_converted_and_returned(bias):
    lin = nn.Linear(40, 24, bias=bias)
    out = adahop.convert_to_adahop_training(lin, config=AdaHOPConfig.from_recipe_name("mxfp4_iht"))
    assert isinstance(out, AdaHOPLinear) and out is not lin
    assert out.weight is lin.weight and out.bias is lin.bias
    assert (out.in_features, out.out_features) == (40, 24)
    x = torch.randn(5, 40)
    y = out(x)
    assert y.shape == (5, 24)
    assert torch.isfinite(y).all() and not torch.equal(y, lin(x))  # really quantized
    # a filter refusing it leaves it alone
    lin2 = nn.Linear(8, 8)
    cfg = AdaHOPConfig.from_recipe_name("mxfp4")
    with pytest.warns(UserWarning, match="refused all 1 convertible"):
        assert adahop.convert_to_adahop_training(lin2, config=cfg, module_filter_fn=lambda m, n: False) is lin2


def test_convert_refuses_bad_arguments():
    with pytest.raises(ValueError):
        adahop.convert_to_adahop_training(tiny(), config="mxfp4")
    with pytest.raises(ValueError):
        adahop.convert_to_adahop_training("model", config=AdaHOPConfig.from_recipe_name("mxfp4"))
    with pytest.raises(ValueError):
        AdaHOPConfig.from_recipe_name("fp8")


# ------------------------------------------------------------------------------- checkpoints


def calibrated_tiny(recipe, steps_after=2, calibration_steps=2, seed=0):
    """A converted TinyLM trained through its calibration and a few quantized steps after."""
    model = tiny(seed)
    cfg = AdaHOPConfig.from_recipe_name(recipe, calibration_steps=calibration_steps).with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(model, config=cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(calibration_steps + steps_after):
        opt.zero_grad()
        step(model, *fixed_batch(seed=100 + i))
        opt.step()
    return model, cfg


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", ["adahop_lv2", "adahop_lv1", "tseng"])
def test_state_dict_round_trip(recipe, tmp_path):
    model, cfg = calibrated_tiny(recipe)
    assert adahop.is_calibrated(model)
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    sd = torch.load(path, weights_only=True)

    fresh = tiny(seed=1)  # other initial weights: everything must come from the checkpoint
    adahop.convert_to_adahop_training(fresh, config=cfg)
    if cfg.adaptive:
        assert not adahop.is_calibrated(fresh)
    fresh.load_state_dict(sd)  # strict
    old, new = adahop.adahop_layers(model), adahop.adahop_layers(fresh)
    for fqn in old:
        assert new[fqn].patterns == old[fqn].patterns
        assert new[fqn].modes == old[fqn].modes
        assert new[fqn].calls == old[fqn].calls > 0
        assert new[fqn].get_extra_state() == old[fqn].get_extra_state()
        if cfg.adaptive:
            assert not new[fqn].calibrating and old[fqn].patterns is not None

    # the next step is bit-identical: outputs and the stochastically rounded gradients
    batch = fixed_batch(seed=7)
    for m in (model, fresh):
        m.zero_grad(set_to_none=True)
    out_old = model(batch[0])
    out_new = fresh(batch[0])
    assert torch.equal(out_old, out_new)
    nn.functional.cross_entropy(out_old.flatten(0, 1), batch[1].flatten()).backward()
    nn.functional.cross_entropy(out_new.flatten(0, 1), batch[1].flatten()).backward()
    g_old, g_new = grads_of(model), grads_of(fresh)
    assert g_old.keys() == g_new.keys() and len(g_old) > 0
    for k in g_old:
        assert torch.equal(g_old[k], g_new[k]), k


def test_state_dict_round_trip_mid_calibration(tmp_path):
    """A checkpoint taken while calibrating resumes the vote, it does not restart it: the model
    that went on and the one resumed from its checkpoint take the same steps (two calibration
    steps to the freeze, then two quantized ones with stochastic rounding) with the same
    calibration state, modes, logits and gradients, bit for bit."""
    cfg = AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=4).with_gemm_settings(oe_k=4)
    model = tiny()
    adahop.convert_to_adahop_training(model, config=cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(2):
        opt.zero_grad()
        step(model, *fixed_batch(seed=100 + i))
        opt.step()
    torch.save(model.state_dict(), tmp_path / "mid.pt")
    resumed = tiny(seed=3)  # other initial weights: everything must come from the checkpoint
    adahop.convert_to_adahop_training(resumed, config=cfg)
    resumed.load_state_dict(torch.load(tmp_path / "mid.pt", weights_only=True))
    opt_resumed = torch.optim.SGD(resumed.parameters(), lr=0.05)
    for layer in adahop.adahop_layers(resumed).values():
        assert layer.calibrating and layer.calibration.steps == 2

    def same_state():
        old, new = adahop.adahop_layers(model), adahop.adahop_layers(resumed)
        assert old.keys() == new.keys()
        for fqn in old:
            assert new[fqn].get_extra_state() == old[fqn].get_extra_state(), fqn
        for (name, p), (name2, q) in zip(model.named_parameters(), resumed.named_parameters()):
            assert name == name2 and torch.equal(p, q), name

    same_state()
    for i in range(2, 6):
        inputs, targets = fixed_batch(seed=100 + i)
        outs = []
        for m, o in ((model, opt), (resumed, opt_resumed)):
            o.zero_grad(set_to_none=True)
            logits = m(inputs)
            nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            outs.append((logits.detach(), grads_of(m)))
            o.step()
        (y_old, g_old), (y_new, g_new) = outs
        assert torch.equal(y_old, y_new), f"step {i}: logits differ"
        assert g_old.keys() == g_new.keys() and len(g_old) > 0
        for k in g_old:
            assert torch.equal(g_old[k], g_new[k]), (i, k)
        same_state()
        assert adahop.is_calibrated(resumed) == (i >= 3)  # frozen by the 4th backward pass
    for layer in adahop.adahop_layers(resumed).values():
        assert layer.calibration.steps == 4 and layer.calls == 6
        assert any(mode != "bf16" for mode in layer.modes.values())  # the last steps quantized


def test_unconverted_state_dict_loads_into_converted_model():
    plain = tiny(seed=5)
    sd = plain.state_dict()
    assert not any(k.endswith("_extra_state") for k in sd)
    model, cfg = calibrated_tiny("adahop_lv2")
    modes = {k: dict(v.modes) for k, v in adahop.adahop_layers(model).items()}
    calls = {k: v.calls for k, v in adahop.adahop_layers(model).items()}
    result = model.load_state_dict(sd)  # strict: no missing _extra_state
    assert not result.missing_keys and not result.unexpected_keys
    for k, v in plain.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    # the layers keep their own calibrated state
    assert {k: v.modes for k, v in adahop.adahop_layers(model).items()} == modes
    assert {k: v.calls for k, v in adahop.adahop_layers(model).items()} == calls

    # and into a freshly converted (still calibrating) model
    fresh = tiny()
    adahop.convert_to_adahop_training(fresh, config=cfg)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.blocks[1].down.weight, plain.blocks[1].down.weight)
    assert not adahop.is_calibrated(fresh)


# -------------------------------------------------------------------------------- modes JSON


def test_modes_json_round_trip(tmp_path):
    model, cfg = calibrated_tiny("adahop_lv1")
    path = tmp_path / "modes.json"
    adahop.save_modes(model, path)
    data = json.loads(path.read_text())
    layers = adahop.adahop_layers(model)
    assert set(data) == set(layers)
    for fqn, entry in data.items():
        assert set(entry) == {"fprop", "dgrad", "wgrad", "patterns"}
        assert {g: entry[g] for g in ("fprop", "dgrad", "wgrad")} == layers[fqn].modes
        assert entry["patterns"] == layers[fqn].patterns
        assert set(entry["patterns"]) == {"x", "w", "g"}
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind

    fresh = tiny(seed=2)
    adahop.convert_to_adahop_training(fresh, config=cfg)
    assert not adahop.is_calibrated(fresh)
    adahop.load_modes(fresh, path)
    assert adahop.is_calibrated(fresh)
    for fqn, layer in adahop.adahop_layers(fresh).items():
        assert layer.modes == layers[fqn].modes and layer.patterns == layers[fqn].patterns
    adahop.save_modes(fresh, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == data
    # the loaded modes are really used: the forward is quantized right away (a bf16 twin with the
    # same weights gives another output)
    twin = tiny(seed=2)
    adahop.convert_to_adahop_training(twin, config=AdaHOPConfig.from_recipe_name("bf16"))
    idx = fixed_batch()[0]
    with torch.no_grad():
        assert torch.equal(twin(idx), tiny(seed=2)(idx))
        assert not torch.equal(fresh(idx), twin(idx))


def test_modes_json_without_patterns_and_with_chosen_modes(tmp_path):
    model = tiny()
    cfg = AdaHOPConfig.from_recipe_name("adahop_lv2").with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(model, config=cfg)
    modes = {fqn: {"fprop": "mxfp4", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"} for fqn in block_names()}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(modes))
    adahop.load_modes(model, path)
    for layer in adahop.adahop_layers(model).values():
        assert layer.modes == modes[layer.layer_name]
        assert not layer.calibrating
    step(model, *fixed_batch())


def test_modes_json_errors(tmp_path):
    model, cfg = calibrated_tiny("adahop_lv2", steps_after=0)
    path = tmp_path / "modes.json"
    adahop.save_modes(model, path)
    data = json.loads(path.read_text())

    fresh = tiny()
    adahop.convert_to_adahop_training(fresh, config=cfg)
    missing = dict(data)
    del missing["blocks.1.up"]
    (tmp_path / "missing.json").write_text(json.dumps(missing))
    with pytest.raises(ValueError, match="blocks.1.up"):
        adahop.load_modes(fresh, tmp_path / "missing.json")
    unknown = dict(data, **{"blocks.9.up": data["blocks.1.up"]})
    (tmp_path / "unknown.json").write_text(json.dumps(unknown))
    with pytest.raises(ValueError, match="blocks.9.up"):
        adahop.load_modes(fresh, tmp_path / "unknown.json")
    bad = json.loads(json.dumps(data))
    bad["blocks.0.qkv"]["wgrad"] = "iht+oe_left"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError):
        adahop.load_modes(fresh, tmp_path / "bad.json")

    calibrating = tiny()
    adahop.convert_to_adahop_training(calibrating, config=cfg)
    with pytest.raises(ValueError, match="calibrating"):
        adahop.save_modes(calibrating, tmp_path / "never.json")
    assert not (tmp_path / "never.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "missing.json", "modes.json", "unknown.json"]


# -------------------------------------------------------------------------------- training


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_tiny_transformer_trains_under_every_recipe(recipe, tokens):
    torch.manual_seed(0)
    model = TinyLM(d=64, layers=2, seq_len=64)
    cfg = AdaHOPConfig.from_recipe_name(recipe, calibration_steps=3).with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(model, config=cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-8)
    losses = []
    for inputs, targets in batches(tokens, batch=8, seq_len=64, steps=25, seed=0):
        loss = lm_loss(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert len(losses) == 25
    assert all(math.isfinite(v) for v in losses), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # byte-level LM: ln(256) = 5.55 at the start; seen: first-5 mean ~5.0, last-5 mean ~2.7
    assert last < first - 1.0, (first, last)
    layers = adahop.adahop_layers(model)
    assert len(layers) == 8
    if recipe in ADAPTIVE:
        assert adahop.is_calibrated(model)
        level = cfg.policy
        if level == "loss_aware":  # one decision over the model, from every layer's statistics
            decided = cfg.model_policy({name: layer.calibration.summary() for name, layer in layers.items()})
        for name, layer in layers.items():
            assert layer.calibration.steps == 3
            if level == "loss_aware":
                modes, oe_ks = policy_result(decided[name])
                assert layer.modes == modes and (layer.oe_ks or {}) == oe_ks
            elif level == "measured":  # the modes (and OE k) the measured policy picks from the statistics
                modes, oe_ks = policy_result(cfg.policy_fn(layer.calibration.summary()))
                assert layer.modes == modes and (layer.oe_ks or {}) == oe_ks
            else:
                assert layer.modes == adahop.modes_from_patterns(layer.patterns, level)
    for layer in layers.values():
        # the counter that seeds stochastic rounding; the bf16 recipe's layers are F.linear
        # (no draws, nothing counted, so that torch.compile traces them)
        assert layer.calls == (0 if recipe == "bf16" else 25)


def test_example_your_own_loop_runs_end_to_end(capsys):
    """examples/your_own_loop.py: convert, calibrate, train past the freeze, print the modes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "your_own_loop.py"
    spec = importlib.util.spec_from_file_location("your_own_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "6", "--calibration-steps", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "calibrated False" in out and "step    5" in out and "calibrated True" in out
    assert "layers.0.attention.wq" in out and out.count("modes: fprop=bf16, dgrad=iht") == 14
    assert "step    4  fprop GEMMs to BF16 in 14 layers" in out  # adahop_lv2_tail: floor(0.82 * 6) = 4 steps done
    assert example.main(["--steps", "6", "--calibration-steps", "3", "--device", "cpu", "--fprop-bf16-from", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward GEMMs to BF16" not in out and "modes: fprop=iht" in out
    with pytest.raises(SystemExit):  # a switch before the calibration ends
        example.main(["--steps", "6", "--calibration-steps", "5", "--device", "cpu"])
    assert "after the calibration's 5 steps: give at least 7 steps" in capsys.readouterr().err


class _SameForwardLinear(nn.Linear):
    """An nn.Linear subclass that keeps nn.Linear's forward (only a marker)."""


class _OwnForwardLinear(nn.Linear):
    """An nn.Linear subclass computing something else with its weight: not convertible."""

    def forward(self, x):
        return super().forward(x) * 2


def test_linear_subclass_with_linear_forward_is_converted():
    model = nn.Sequential(_SameForwardLinear(32, 32), nn.ReLU(), _OwnForwardLinear(32, 32), nn.Linear(32, 8))
    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"),
                                      module_filter_fn=lambda m, n: True)
    assert set(adahop.adahop_layers(model)) == {"0", "3"}
    assert type(model[2]) is _OwnForwardLinear  # its forward is its own: left alone


def test_multihead_attention_projection_is_not_converted():
    # nn.MultiheadAttention reads out_proj.weight and never calls out_proj: converting it would
    # claim MXFP4 for a GEMM that runs in full precision
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(32, 2), "ff": nn.Linear(32, 32)})
    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"),
                                      module_filter_fn=lambda m, n: True)
    assert set(adahop.adahop_layers(model)) == {"ff"}


def test_gpt2_conv1d_model_converts_nothing_and_says_what_it_found():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                                                  n_positions=16))
    with pytest.warns(UserWarning, match=r"converted no layer: .*refused all 1 .*not converted: 4 Conv1D"):
        adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"))
    assert not adahop.adahop_layers(model)


def test_conv_model_and_refusing_filter_warn():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    with pytest.warns(UserWarning, match=r"has no nn\.Linear .*not converted: none"):
        adahop.convert_to_adahop_training(conv, config=AdaHOPConfig.from_recipe_name("mxfp4"))
    with pytest.warns(UserWarning, match="the module_filter_fn refused all 9 convertible"):
        adahop.convert_to_adahop_training(tiny(), config=AdaHOPConfig.from_recipe_name("mxfp4"),
                                          module_filter_fn=lambda m, n: False)


def test_a_conversion_that_converts_says_nothing(recwarn):
    model = tiny()
    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"))
    adahop.convert_to_adahop_training(model, config=AdaHOPConfig.from_recipe_name("mxfp4"))  # again: converted
    assert not [w for w in recwarn if "converted no layer" in str(w.message)]
