"""adahop in torchtitan (adahop.titan): the debug Llama of torchtitan built on the CPU, converted,
trained a few steps through torchtitan's own optimizer container. Skipped without torchtitan
(``pip install "adahop[titan]"``; CI installs only the test extra).

torchtitan's language models attend with FlexAttention, whose backward is CUDA-only ("FlexAttention
does not support backward on CPU"): the CPU model here takes torchtitan's
``ScaledDotProductAttention`` instead (causal, no document masks; the linears are unchanged).
"""

import json
from types import SimpleNamespace

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan")

from torchtitan.components.checkpointer.base import ModelWrapper  # noqa: E402
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.linear import Linear  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from adahop import adahop_layers  # noqa: E402
from adahop.formats.rng import mix_seeds  # noqa: E402
from adahop.titan.hooks import AdaHOPHook  # noqa: E402
from adahop.titan.linear import AdaHOPConverter, AdaHOPTitanLinear  # noqa: E402

BLOCK_LINEARS = ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                 "feed_forward.w3")
N_LAYERS = 6  # torchtitan's llama3 debugmodel: 6 blocks of dim 256, vocab 2048


def debug_config(recipe=None, **overrides):
    """torchtitan's llama3 debugmodel config (with the AdaHOP converter of ``recipe``), with SDPA
    attention (module doc)."""
    converters = None if recipe is None else [AdaHOPConverter.Config(recipe=recipe, config_overrides=overrides)]
    model_config = model_registry("debugmodel", converters=converters).model
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_config


def build(recipe=None, **overrides):
    torch.manual_seed(0)
    model = debug_config(recipe, **overrides).build()
    model.init_weights(buffer_device=None)
    return model


def batch(seed=1, rows=2, seq=32):
    tokens = torch.randint(0, 2048, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(seq).expand(rows, seq)


def forward_backward(model, tokens, positions):
    y = model(tokens, positions)
    y.float().pow(2).mean().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_converter_swaps_the_block_linears_only():
    model = build("mxfp4")
    layers = adahop_layers(model)
    assert sorted(layers) == sorted(f"layers.{i}.{name}" for i in range(N_LAYERS) for name in BLOCK_LINEARS)
    # each named by its fqn (its SR seed goes by it)
    assert all(layer.layer_name == fqn and isinstance(layer, AdaHOPTitanLinear) for fqn, layer in layers.items())
    assert type(model.lm_head) is Linear  # the LM head stays torchtitan's Linear
    assert type(model.tok_embeddings).__name__ == "Embedding"
    model.verify_module_protocol()  # what torchtitan's trainer checks after building


def test_converter_refuses_an_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe"):
        AdaHOPConverter.Config(recipe="fp3").build()


def against_stock(recipe):
    """``(y, g, y_ref, g_ref)``: outputs and gradients of the model converted to ``recipe`` and of
    the stock model, the same weights and batch."""
    ref, model = build(), build(recipe)
    model.load_state_dict(ref.state_dict(), strict=True)
    tokens, positions = batch()
    return (*forward_backward(model, tokens, positions), *forward_backward(ref, tokens, positions))


def test_bf16_recipe_matches_the_stock_model_bit_for_bit():
    y, g, y_ref, g_ref = against_stock("bf16")
    assert torch.equal(y, y_ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[k], g_ref[k]) for k in g)


def test_mxfp4_recipe_is_close_to_the_stock_model():
    y, g, y_ref, g_ref = against_stock("mxfp4")
    assert not torch.equal(y, y_ref)  # the block GEMMs did run in MXFP4
    # MXFP4 (4-bit elements, a shared 8-bit scale per 32, stochastic rounding of the gradients)
    # in the 30 block GEMMs, the LM head in full precision; measured on two batches: 1.0% on the
    # logits, 5.2% on all the gradients together, at most 36% on one tensor's gradient (a block's,
    # in this untrained model, whose gradients are small and noisy).
    assert (y - y_ref).norm() / y_ref.norm() < 0.03
    flat, flat_ref = (torch.cat([v.flatten() for v in grads.values()]) for grads in (g, g_ref))
    assert (flat - flat_ref).norm() / flat_ref.norm() < 0.1
    assert max(((g[k] - g_ref[k]).norm() / g_ref[k].norm()).item() for k in g) < 0.5


def test_state_dict_keys_are_torchtitans_both_ways():
    ref, model = build(), build("adahop_lv2")
    assert model.state_dict().keys() == ref.state_dict().keys()  # no _extra_state: torchtitan's names only
    model.load_state_dict(ref.state_dict(), strict=True)
    back = build()
    back.load_state_dict(model.state_dict(), strict=True)
    assert all(torch.equal(back.state_dict()[k], ref.state_dict()[k]) for k in ref.state_dict())
    # torchtitan's checkpointer view (it reads .shape of every value: a dict extra state broke it)
    assert ModelWrapper(model).state_dict().keys() == ref.state_dict().keys()


def test_meta_build_then_init_gives_each_layer_its_sr_seed():
    with torch.device("meta"):  # as torchtitan's trainer builds it
        model = debug_config("mxfp4").build()
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=None)
    for fqn, layer in adahop_layers(model).items():
        assert layer.rng_state.tolist() == [mix_seeds(layer.config.seed, layer.layer_id), 0], fqn


def test_hook_runs_the_schedule_and_keeps_the_modes(tmp_path):
    # adahop_lv2_tail's schedule (fprop BF16 from 82%) over 5 steps: the switch after step 4
    model = build("adahop_lv2", calibration_steps=1, calibration_gemms="bf16")
    from adahop import recipe

    schedule = recipe("adahop_lv2_tail").schedule
    modes_file = tmp_path / "adahop_modes.json"
    optimizers = default_adamw(lr=1e-4).build(model_parts=[model])
    hook = AdaHOPHook(schedule, 5, modes_file)
    hook(optimizers, [model], None)
    switched_at = []
    for step in range(5):
        optimizers.zero_grad()
        forward_backward(model, *batch(seed=step))
        optimizers.step()
        if hook.switched:
            switched_at.append(step)
        if step == 0:  # calibrated by the first step: the modes are written after it
            written = json.loads(modes_file.read_text())
            assert sorted(written) == sorted(adahop_layers(model))
    assert switched_at == [4]  # floor(0.82 * 5) = 4 steps done
    assert all(layer.modes["fprop"] == "bf16" for layer in adahop_layers(model).values())

    # a resumed run: a fresh model takes the modes from the file when the optimizer is built
    resumed = build("adahop_lv2", calibration_steps=1, calibration_gemms="bf16")
    AdaHOPHook(schedule, 5, modes_file)(default_adamw(lr=1e-4).build(model_parts=[resumed]), [resumed], None)
    assert {f: m.modes for f, m in adahop_layers(resumed).items()} == {
        f: {**m.modes, "fprop": written[f]["fprop"]} for f, m in adahop_layers(model).items()}
    with pytest.raises(ValueError, match="past the 5 steps"):
        optimizers.zero_grad()
        forward_backward(model, *batch())
        optimizers.step()


def test_trainer_config_and_its_command_line_flags(tmp_path):
    from torchtitan.config import ConfigManager

    from adahop.titan.trainer import AdaHOPTrainer

    config = ConfigManager().parse_args(["--module", "adahop.titan", "--config", "llama3_debugmodel_adahop",
                                         "--adahop.recipe", "mxfp4", "--training.steps", "20",
                                         "--dump_folder", str(tmp_path)])
    assert isinstance(config, AdaHOPTrainer.Config)
    assert (config.adahop.recipe, config.adahop.calibration_steps, config.training.steps) == ("mxfp4", 2, 20)


def test_trainer_runs_each_step_through_the_calibrator(monkeypatch):
    """AdaHOPTrainer's train_step / forward_backward_step around torchtitan's (which need CUDA to
    be made: here a trainer without __init__, torchtitan's two methods stood in for)."""
    from torchtitan.trainer import Trainer

    from adahop.titan.trainer import AdaHOPOptions, AdaHOPTrainer

    model = build("adahop_lv2", calibration_steps=2)
    seen = []

    def titan_train_step(self, data_iterator):  # torchtitan's: one micro-batch, then the optimizer
        tokens, positions = next(data_iterator)
        return self.forward_backward_step(input_dict={"input": tokens, "positions": positions}, labels=tokens,
                                          global_valid_tokens=torch.tensor(float(tokens.numel())))

    def titan_forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        seen.append(tuple(input_dict["input"].shape))
        loss = self.model_parts[0](input_dict["input"], input_dict["positions"]).float().pow(2).sum()
        (loss / global_valid_tokens).backward()
        return loss.detach() / global_valid_tokens

    monkeypatch.setattr(Trainer, "train_step", titan_train_step)
    monkeypatch.setattr(Trainer, "forward_backward_step", titan_forward_backward_step)
    trainer = AdaHOPTrainer.__new__(AdaHOPTrainer)
    trainer.model_parts = [model]
    trainer.parallel_dims = SimpleNamespace(pp_enabled=False, dp_enabled=False)
    trainer.config = SimpleNamespace(adahop=AdaHOPOptions(calibration_micro_batches=2))
    trainer._calibrator, trainer._calibrator_made, trainer._calibration_step = None, False, None
    for step in (1, 2, 3):
        trainer.step = step
        trainer.train_step(iter([batch(seed=step, rows=4)]))
    # two calibrating steps, each micro-batch of 4 rows run as 2 parts; then whole
    assert seen == [(2, 32)] * 4 + [(4, 32)]
    assert all(not m.calibrating for m in adahop_layers(model).values())

    trainer.parallel_dims = SimpleNamespace(pp_enabled=True, dp_enabled=False)
    trainer.model_parts = [build("adahop_lv2")]
    trainer._calibrator_made = False
    with pytest.raises(ValueError, match="calibrating under pipeline parallelism"):
        trainer.train_step(iter([batch()]))
