"""Hugging Face transformers models (adahop.hf): converted, trained with their own loss, saved
and loaded with their modes. Small random models built from a config (no download); skipped
where transformers is not installed (the `hf` extra)."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

import adahop  # noqa: E402
from adahop import hf  # noqa: E402

VOCAB, SEQ = 64, 32
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)


def build(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL))  # biases on q, k, v


def numerics(recipe="adahop_lv2"):
    return adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=2, backend="reference").with_gemm_settings(
        oe_k=4)


def counting_batch(g: torch.Generator, batch=4) -> torch.Tensor:
    """Rows that count up by a random stride from a random start (mod VOCAB): learnable."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def train_steps(model, steps: int, seed=0) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        ids = counting_batch(g)
        loss = model(input_ids=ids, labels=ids).loss  # the model's own shifted cross-entropy
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_converted_model_trains_with_its_own_loss(kind):
    model = build(kind)
    adahop.convert_to_adahop_training(model, config=numerics())
    layers = adahop.adahop_layers(model)
    assert len(layers) == 14 and not any("lm_head" in name for name in layers)  # 7 per block, head kept
    if kind == "qwen2":
        assert layers["model.layers.0.self_attn.q_proj"].bias is not None
    losses = train_steps(model, 8)
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    assert adahop.is_calibrated(model)
    # after calibration the layers run MXFP4 GEMMs, not only BF16 ones
    assert any(mode != "bf16" for layer in layers.values() for mode in layer.modes.values())


def test_the_models_own_save_pretrained_cannot_hold_the_extra_state(tmp_path):
    """Why adahop.hf.save_pretrained exists: safetensors take tensors only."""
    model = build("llama")
    adahop.convert_to_adahop_training(model, config=numerics())
    with pytest.raises(Exception):  # noqa: B017  (transformers' own error; its type is not ours)
        model.save_pretrained(tmp_path / "plain")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_save_and_load_round_trip_the_weights_and_the_modes(kind, tmp_path):
    model = build(kind)
    adahop.convert_to_adahop_training(model, config=numerics())
    train_steps(model, 3)
    assert adahop.is_calibrated(model)
    hf.save_pretrained(model, tmp_path / "m")
    saved_modes = json.loads((tmp_path / "m" / hf.MODES_FILE).read_text())
    cls = type(model)
    loaded = hf.from_pretrained(cls, tmp_path / "m")
    assert set(adahop.adahop_layers(loaded)) == set(adahop.adahop_layers(model))
    ours, theirs = hf.tensor_state_dict(model), hf.tensor_state_dict(loaded)
    assert set(ours) <= set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name
    for name, layer in adahop.adahop_layers(loaded).items():
        mine = adahop.adahop_layers(model)[name]
        assert layer.modes == mine.modes and layer.patterns == mine.patterns, name
        assert layer.config.to_dict() == mine.config.to_dict()
    assert saved_modes == {n: {**m.modes, "patterns": m.patterns} for n, m in adahop.adahop_layers(loaded).items()}
    ids = counting_batch(torch.Generator().manual_seed(5))
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    # and the loaded model trains on, in MXFP4 from its first step (no new calibration)
    losses = train_steps(loaded, 2)
    assert all(math.isfinite(v) for v in losses)
    assert all(not layer.calibrating for layer in adahop.adahop_layers(loaded).values())


def test_a_model_saved_while_calibrating_keeps_its_weights_and_calibrates_again(tmp_path):
    model = build("llama")
    adahop.convert_to_adahop_training(model, config=numerics())
    train_steps(model, 1)  # calibration needs 2
    with pytest.warns(UserWarning, match="still calibrating"):
        hf.save_pretrained(model, tmp_path / "m")
    assert not (tmp_path / "m" / hf.MODES_FILE).exists()
    loaded = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "m")
    assert all(layer.calibrating for layer in adahop.adahop_layers(loaded).values())
    assert torch.equal(loaded.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_a_plain_folder_needs_a_config(tmp_path):
    build("llama").save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="pass config="):
        hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "plain")
    model = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path / "plain", config=numerics("mxfp4"))
    assert len(adahop.adahop_layers(model)) == 14 and adahop.is_calibrated(model)


def test_saving_a_model_with_no_adahop_layer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no AdaHOPLinear"):
        hf.save_pretrained(build("llama"), tmp_path / "m")
