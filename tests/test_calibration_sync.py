"""Calibration reads nothing back to the host until it ends (patterns.calibration): a calibrating
step queues its observations on the device and accumulates them there; only the step whose
count reaches ``calibration_steps`` (the freeze) reads them. What it accumulates there is what
the host accumulates from the same observations read back, to the bit.

On the CPU there is no queue to stall, so the test makes every Python-level way of reading a
tensor's data raise (``no_host_reads``) and runs the calibrating steps of a tiny converted model
inside it. On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` catches the synchronizing calls
of the C++ side too (``test_calibration_steps_do_not_synchronize_the_gpu``).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from calibration_record import batches

import adahop
from adahop.patterns.calibration import LayerCalibration, observe_on_device, tensor_part

from tiny_lm import TinyLM

VOCAB, SEQ = 64, 32


class HostRead(AssertionError):
    pass


_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "cpu", "numpy",
          "__array__", "nonzero", "masked_select", "unique", "is_nonzero")
_TORCH_READS = ("equal", "allclose", "is_nonzero", "nonzero", "masked_select", "unique")


_ALLOWED = [0]


@contextlib.contextmanager
def host_reads_allowed():
    """Inside ``no_host_reads``, lets reads through again (for what is no part of calibration)."""
    _ALLOWED[0] += 1
    try:
        yield
    finally:
        _ALLOWED[0] -= 1


@contextlib.contextmanager
def no_host_reads():
    """Inside, every way Python code reads a tensor's data back raises ``HostRead``: ``item``,
    ``tolist``, ``bool``/``float``/``int``/index conversion (``if t``, ``math.isfinite(t)``,
    ``max(a, b)``), ``cpu``/``numpy``, ``to`` a CPU device, the data-dependent shapes (``nonzero``,
    ``masked_select``, ``unique``, a boolean mask as an index) and ``torch.equal``/``allclose``."""
    saved = {}

    def refuse(owner, name):
        def read(*args, **kwargs):
            if not _ALLOWED[0]:
                raise HostRead(f"a host read during a calibrating step: {owner.__name__}.{name}")
            return saved[(owner, name)](*args, **kwargs)

        return read

    def to(self, *args, **kwargs):
        device = kwargs.get("device", args[0] if args else None)
        if not _ALLOWED[0] and isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu":
            raise HostRead("a host read during a calibrating step: to('cpu')")
        return saved[(torch.Tensor, "to")](self, *args, **kwargs)

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if not _ALLOWED[0] and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in parts):
            raise HostRead("a host read during a calibrating step: a boolean mask as an index")
        return saved[(torch.Tensor, "__getitem__")](self, index)

    patches = [(torch.Tensor, name, refuse(torch.Tensor, name)) for name in _READS]
    patches += [(torch, name, refuse(torch, name)) for name in _TORCH_READS]
    patches += [(torch.Tensor, "to", to), (torch.Tensor, "__getitem__", getitem)]
    own = {(owner, name): name in vars(owner) for owner, name, _ in patches}
    for owner, name, fn in patches:
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, fn)
    try:
        yield
    finally:
        for (owner, name), fn in saved.items():
            if own[(owner, name)]:
                setattr(owner, name, fn)
            else:  # inherited (torch._C.TensorBase's): inherited again
                delattr(owner, name)


def test_the_guard_catches_every_read():
    t = torch.ones(3)
    reads = [lambda: t[0].item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: float(t[0]), lambda: int(t[0]),
             lambda: [0, 1][t[0].long()], lambda: t.cpu(), lambda: t.numpy(), lambda: t.to("cpu"),
             lambda: t[t > 0], lambda: t.nonzero(), lambda: torch.equal(t, t), lambda: max(t[0], t[1])]
    with no_host_reads():
        for read in reads:
            with pytest.raises(HostRead):
                read()
        (t + 1).to(torch.float64)[0:2]  # the ops themselves run
    assert t[0].item() == 1.0 and torch.equal(t, t)  # restored


def calibrate(device, recipe, gemms, parts, steps, guard) -> TinyLM:
    """A tiny model converted to ``recipe``, trained for ``steps`` calibration steps, each (but
    the last: the freeze) inside ``guard()``; the optimizer step runs outside (it is no part of
    calibration)."""
    torch.manual_seed(0)
    model = TinyLM(vocab=VOCAB, d=64, layers=2, heads=4, seq_len=SEQ).to(device)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=steps, calibration_gemms=gemms)
    adahop.convert_to_adahop_training(model, config=cfg.with_gemm_settings(oe_k=4))
    for step, (inputs, targets) in enumerate(batches(0, steps, seq=SEQ, vocab=VOCAB)):
        inputs, targets = inputs.to(device), targets.to(device)
        last = step == steps - 1
        split = adahop.calibration_parts(model, parts) if parts > 1 else contextlib.nullcontext()
        with split, (contextlib.nullcontext() if last else guard()):
            for part_inputs, part_targets in zip(inputs.chunk(parts), targets.chunk(parts)):
                logits = model(part_inputs)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), part_targets.flatten())
                (loss / parts).backward()
        assert adahop.is_calibrated(model) == last
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
    return model


@pytest.mark.parametrize("recipe", ["adahop_lv2", "adahop_measured"])
@pytest.mark.parametrize("gemms,parts", [("bf16", 1), ("bf16", 2), ("iht", 1), ("iht", 2)])
def test_calibration_steps_read_nothing_back_until_the_freeze(recipe, gemms, parts, monkeypatch):
    if gemms == "iht":
        # IHT calibration runs its GEMMs through the backend: on the CPU the reference, which
        # reads its stochastic-rounding seed by design (formats.rng.SRStream.seed; the GPU
        # backends derive it on the device). That read is the GEMM's, not calibration's.
        from adahop.formats.rng import SRStream

        seed = SRStream.seed

        def seed_read_by_the_reference(self):
            with host_reads_allowed():
                return seed(self)

        monkeypatch.setattr(SRStream, "seed", seed_read_by_the_reference)
    model = calibrate("cpu", recipe, gemms, parts, steps=3, guard=no_host_reads)
    layers = adahop.adahop_layers(model)
    assert all(m.calibration.steps == 3 and m.modes is not None for m in layers.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("recipe", ["adahop_lv2", "adahop_measured"])
@pytest.mark.parametrize("gemms,parts", [("bf16", 1), ("bf16", 2), ("iht", 1)])
def test_calibration_steps_do_not_synchronize_the_gpu(recipe, gemms, parts):
    @contextlib.contextmanager
    def no_sync():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

    calibrate("cuda", recipe, gemms, parts, steps=3, guard=no_sync)


def _nan_safe(v):
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, dict):
        return {k: _nan_safe(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_nan_safe(x) for x in v]
    return v


@pytest.mark.parametrize("quant", [True, False])
def test_device_sums_are_the_host_sums_of_the_same_observations(quant):
    """Observations (NaN, zero and planted tensors, some split in parts) added on the device, and
    the same read back and added on the host: the same state and summary, key order included.
    Reads in between (a checkpoint) and a state loaded from plain data (a profile seen but never
    finite: None) continue alike."""
    g = torch.Generator().manual_seed(0)

    def tensor(i):
        t = torch.randn(96, 64, generator=g)
        if i % 5 == 1:
            t[:, 3] *= 30
        if i % 5 == 2:
            t[7] *= 30
        if i == 6:
            t[70, 5] = math.inf  # in the second part: the first part's profiles come, not finite
        return {3: torch.full((96, 64), math.nan), 4: torch.zeros(96, 64)}.get(i, t)

    def observations():
        for i in range(8):
            t = tensor(i)
            for role in ("x", "w", "g"):
                dims = (1, 0) if role == "w" else (1,)
                parts = [t] if role == "w" or i % 2 else list(t.chunk(2))
                yield i, role, observe_on_device([tensor_part(p, k=8, quant=quant, profile_dims=dims) for p in parts],
                                                 tau=2.0, k=8)

    start = {r: {"votes": {"row": 0, "col": 0, "none": 1}, "sums": {"cv_row": 1.0, "cv_col": 1.0,
                 "row_energy_topk": 0.5, "col_energy_topk": 0.5, "prof_iht_d1": None},
                 "finite_counts": {"cv_row": 1, "cv_col": 1, "row_energy_topk": 1, "col_energy_topk": 1,
                                   "prof_iht_d1": 0}} for r in ("x", "w", "g")}
    for first in (None, start):
        on_device = LayerCalibration() if first is None else LayerCalibration.from_dict(first)
        on_host = LayerCalibration() if first is None else LayerCalibration.from_dict(first)
        for i, role, obs in observations():
            on_host.add(role, obs.read())
            on_device.add(role, obs)
            if i == 5 and role == "g":  # a read in between
                assert on_device.to_dict() == on_host.to_dict()
        assert on_device.steps == on_host.steps == 8 + (first is not None)
        d, h = on_device.to_dict(), on_host.to_dict()
        assert d == h
        assert [list(t["sums"]) for t in d.values()] == [list(t["sums"]) for t in h.values()]  # key order
        assert _nan_safe(on_device.summary()) == _nan_safe(on_host.summary())
