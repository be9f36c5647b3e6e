"""The backend registry (adahop.ops.backends): the four built-in backends, and a backend registered
from outside, selectable by name (in a layer too) and refused with its own reason where it cannot run."""

import pytest
import torch

import adahop
from adahop.config import BACKEND_CHOICES
from adahop.ops import backends
from adahop.ops.backends import BackendEntry, ReferenceBackend
from adahop.ops.backends.hopper_fp8 import E4M3Operand, HopperFP8Backend


class DummyBackend(ReferenceBackend):
    """The reference's numerics under another name, counting its GEMMs."""

    name = "dummy"

    def __init__(self):
        self.gemms = 0

    def mm_nt(self, a, b, out_dtype):
        self.gemms += 1
        return super().mm_nt(a, b, out_dtype)


@pytest.fixture
def registry(monkeypatch):
    """``adahop.ops.backends`` with its registry and instances restored after the test."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_INSTANCES", {})
    return backends


def test_registry_lists_the_four_backends():
    assert backends.backend_names() == ("reference", "triton", "hopper_fp8", "native_mx")
    assert BACKEND_CHOICES == backends.backend_choices() == ("auto", *backends.backend_names())
    assert "reference" in backends.available_backends("cpu")


def test_capabilities_are_the_protocols_not_probes():
    assert not ReferenceBackend().has_quantize_both and not ReferenceBackend().has_quantize_and_pack
    hopper = HopperFP8Backend()  # (constructing one needs no GPU)
    assert hopper.has_quantize_both and hopper.has_quantize_and_pack


def _layer_output(backend_name: str) -> torch.Tensor:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4_iht", backend=backend_name)
    layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="probe")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return layer(x)


def test_a_registered_backend_is_selectable_by_name(registry):
    registry.register_backend(BackendEntry("dummy", unavailable=lambda device: None, factory=DummyBackend))
    dummy = registry.get_backend("dummy", "cpu")
    assert isinstance(dummy, DummyBackend) and registry.get_backend("dummy", "cpu") is dummy
    assert "dummy" in registry.available_backends("cpu") and "dummy" in registry.backend_choices()
    assert registry.get_backend("auto", "cpu").name == "reference"  # no auto rank: by name only
    # a layer configured with it runs its GEMMs there (the reference's numerics: the same output)
    y = _layer_output("dummy")
    assert dummy.gemms == 1
    assert torch.equal(y, _layer_output("reference"))


def test_an_unavailable_backend_is_refused_with_its_reason(registry):
    def unavailable(device):
        return f"dummy needs a frobnicator, not {device}"

    registry.register_backend(BackendEntry("dummy", unavailable=unavailable, factory=DummyBackend, auto_rank=0))
    assert registry.unavailable_reason("dummy", "cpu") == "dummy needs a frobnicator, not cpu"
    with pytest.raises(ValueError, match="dummy needs a frobnicator, not cpu"):
        registry.get_backend("dummy", "cpu")
    assert "dummy" not in registry.available_backends("cpu")
    assert registry.get_backend("auto", "cpu").name == "reference"  # ranked first, but cannot run here


def test_auto_takes_the_first_ranked_backend_that_runs(registry):
    registry.register_backend(BackendEntry("dummy", unavailable=lambda device: None, factory=DummyBackend,
                                           auto_rank=0))
    assert registry.get_backend("auto", "cpu").name == "dummy"


@pytest.mark.parametrize("name", ["auto", "reference"])
def test_a_taken_name_is_refused(registry, name):
    with pytest.raises(ValueError, match="is taken"):
        registry.register_backend(BackendEntry(name, unavailable=lambda device: None, factory=DummyBackend))
    assert registry.backend_names() == ("reference", "triton", "hopper_fp8", "native_mx")


# ---- options of an instance (hopper_fp8's use_fast_accum) ----------------------------------------------------
def test_each_set_of_options_gets_its_own_instance(registry):
    class WithOption(DummyBackend):
        def __init__(self, flag: bool = False):
            super().__init__()
            self.flag = flag

    registry.register_backend(BackendEntry("dummy", unavailable=lambda device: None, factory=WithOption,
                                           options=("flag",)))
    plain, flagged = registry.get_backend("dummy", "cpu"), registry.get_backend("dummy", "cpu", flag=True)
    assert plain is not flagged and not plain.flag and flagged.flag
    assert registry.get_backend("dummy", "cpu", flag=True) is flagged and registry.get_backend("dummy") is plain
    with pytest.raises(ValueError, match="backend 'dummy' takes no option 'fast'; its options: flag"):
        registry.get_backend("dummy", "cpu", fast=True)
    with pytest.raises(ValueError, match="backend 'reference' takes no option 'use_fast_accum'; its options: none"):
        registry.get_backend("reference", "cpu", use_fast_accum=True)


def test_hopper_fast_accumulation_is_a_setting_of_its_instance(registry, monkeypatch):
    """The layers' hopper_fp8 (no options) keeps accurate accumulation whatever another caller asks:
    ``use_fast_accum=True`` is another instance, and no instance can be switched."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # an H100, as far as the checks can tell
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA H100")
    shared = registry.get_backend("hopper_fp8", "cuda")
    fast = registry.get_backend("hopper_fp8", "cuda", use_fast_accum=True)
    assert fast is not shared and fast.use_fast_accum and not shared.use_fast_accum
    assert registry.get_backend("auto", "cuda") is shared
    with pytest.raises(AttributeError):
        shared.use_fast_accum = True
    with pytest.raises(ValueError, match="use_fast_accum must be True or False"):
        HopperFP8Backend(use_fast_accum=1)

    seen = []

    def fake_scaled_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum):  # the CPU has no FP8 GEMM
        seen.append(use_fast_accum)
        return (a.float() @ b.float() * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    op = E4M3Operand(torch.ones((16, 32), dtype=torch.float8_e4m3fn), torch.ones(16))
    for backend in (shared, fast):
        assert torch.equal(backend.mm_nt(op, op, torch.bfloat16), torch.full((16, 16), 32.0, dtype=torch.bfloat16))
    assert seen == [False, True]
