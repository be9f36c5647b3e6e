"""One tensor's calibration observation at one step, computed on the tensor's device.

What calibration records of a tensor (X as [T, K], W as [N, K], G as [T, N]) at a step: its label
(``detect``), the detector scores, the energy share of the top-k rows and columns, and how well it
quantizes along each dim under naive MXFP4, IHT and IHT + OE at a ladder of k (``quant_error``),
so that a policy can use more than the labels (docs/method.md, 'Calibration').

A micro-batch split into parts (``TrainConfig.calibration_micro_batches``: the parts' forward and
backward passes run one after the other, for memory) is still one observation: each part leaves a
``TensorPart`` (its rows' variances and energies, its columns' means, variances and energies, on
one power-of-two scale), and the parts merge into the statistics of the whole tensor, to float
rounding, without ever holding it. The detector's scores depend on how many rows a tensor has (a
few outlier tokens stand out more among fewer), so observing each part on its own would change
the labels.

Device and host. ``observe_on_device`` leaves everything on the device: a ``DeviceObservation``
(the label as an index, the statistics as one float64 vector, the profiles as tensors, whether the
tensor was finite), with no data-dependent Python branch, so a training step that observes every
layer never waits for the device; calibration adds these up on the device
(``patterns.calibration``). ``observe_tensor`` and ``observe_parts`` return the same read back to
Python (a ``TensorObservation``; one read), for the study tools (``analyze``) and tests. A
tensor holding NaN or Inf gets "none" and NaN statistics (its numbers are computed and masked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adahop.patterns.detect import (
    PATTERNS,
    all_finite,
    as_rows,
    label_of,
    rescale,
    score_tensor,
    share_tensor,
    slice_energies,
    unit_scaled_exponent,
)
from adahop.patterns.quant_error import PROFILE_DIMS, QuantTensors, oe_k_ladder, quant_tensors, stat_names

STAT_NAMES = ("cv_row", "cv_col", "row_energy_topk", "col_energy_topk")
# With the quantization statistics: the tensor's squared Frobenius norm, in its own scale (the sum
# over a micro-batch's parts; the mean over the calibration steps, as every statistic).
ENERGY = "energy"


@dataclass
class TensorObservation:
    """An observation read back to the host."""

    pattern: str
    cv_row: float
    cv_col: float
    row_energy_topk: float
    col_energy_topk: float
    quant: dict = field(default_factory=dict)  # quant_error.quant_stats: name -> value


@dataclass
class DeviceObservation:
    """An observation on the device. ``values``: float64, one per name of ``names`` (``STAT_NAMES``,
    then the quantization statistics'), NaN where undefined or the tensor is not finite;
    ``label``: 0-d int64, the index of the pattern in ``PATTERNS``; ``profiles``: name -> 1-d
    tensor; ``profiles_present``: 0-d bool, whether the profiles are part of the observation (the
    tensor, or its first part, had energy: ``quant_error.QuantTensors.defined``); ``finite``:
    0-d bool."""

    label: torch.Tensor
    names: tuple[str, ...]
    values: torch.Tensor
    profiles: dict
    profiles_present: torch.Tensor
    finite: torch.Tensor

    def read(self) -> TensorObservation:
        """The observation as Python data (one read of the device): ``quant`` holds the
        quantization statistics, then the profiles (lists) when present; for a tensor that is not
        finite, every one of them NaN."""
        sizes = [p.numel() for p in self.profiles.values()]
        head = torch.stack((self.label.double(), self.finite.double(), self.profiles_present.double()))
        flat = torch.cat([head, self.values, *(p.double() for p in self.profiles.values())]).tolist()
        label, finite, present = flat[:3]
        values = dict(zip(self.names, flat[3:3 + len(self.names)]))
        quant = {n: values[n] for n in self.names[len(STAT_NAMES):]}
        if present:
            at = 3 + len(self.names)
            for name, n in zip(self.profiles, sizes):
                quant[name], at = (flat[at:at + n] if finite else math.nan), at + n
        return TensorObservation(PATTERNS[int(label)], *(values[s] for s in STAT_NAMES), quant)


@dataclass
class TensorPart:
    """One part of a tensor split along its rows (a micro-batch's tokens), as ``observe_on_device``
    merges it, all on the device: the part scaled by ``2**-exp`` (``detect.unit_scaled``; ``exp``
    a 0-d int64 tensor) and, on that scale, its rows' variances and squared norms, its columns'
    means, variances and squared norms, and its quantization statistics
    (``quant_error.quant_tensors``, with the part's own squared norm, ``ENERGY``; None when not
    asked). ``finite``: 0-d bool, False where the
    part holds NaN or Inf (its other numbers are then meaningless)."""

    finite: torch.Tensor
    exp: torch.Tensor
    row_var: torch.Tensor
    row_energy: torch.Tensor
    col_mean: torch.Tensor
    col_var: torch.Tensor
    col_energy: torch.Tensor
    quant: QuantTensors | None = None

    @property
    def rows(self) -> int:
        return self.row_var.numel()


def tensor_part(t: torch.Tensor, *, k: int, quant: bool = True,
                profile_dims: tuple[int, ...] = PROFILE_DIMS) -> TensorPart:
    """The ``TensorPart`` of ``t`` (as 2-D rows; see ``observe_tensor`` for ``k``, ``quant`` and
    ``profile_dims``). Nothing is read back."""
    ks = oe_k_ladder(k)
    m = as_rows(t).detach()
    finite = all_finite(m)
    m, exp = unit_scaled_exponent(m)
    rows, cols = m.shape
    row_e, col_e = slice_energies(m)
    stats = None
    if quant:
        if m.numel():
            stats = quant_tensors(m, ks, energies=(row_e, col_e), profile_dims=profile_dims)
        else:  # nothing to say, not even the shape
            nan = torch.full((), math.nan, dtype=torch.float64, device=m.device)
            stats = QuantTensors(dict.fromkeys(stat_names(ks), nan), {},
                                 torch.zeros((), dtype=torch.bool, device=m.device))
        # The tensor's own squared norm (not scale-free, unlike the others): what the loss-aware
        # policy weighs a GEMM's relative error with (loss_aware_policy). 0 for an empty tensor.
        stats.stats[ENERGY] = torch.ldexp(row_e.double().sum(), 2 * exp)
    # (a variance needs two values: a single row or column gets zeros, which the scores ignore)
    row_var = m.var(dim=1) if cols > 1 and rows else torch.zeros(rows, device=m.device)
    col_var = m.var(dim=0) if rows > 1 and cols else torch.zeros(cols, device=m.device)
    col_mean = m.mean(dim=0) if rows else torch.zeros(cols, device=m.device)
    return TensorPart(finite, exp, row_var, row_e, col_mean, col_var, col_e, stats)


def observe_on_device(parts: list[TensorPart], *, tau: float, k: int) -> DeviceObservation:
    """The observation of the tensor whose row-parts are ``parts`` (``tensor_part`` of each, in
    any order), on the device: what the whole tensor gives, to float rounding (exactly, for one
    part). Per row everything is the part's own; per column the variances merge by Chan's formula
    and the squared norms add, on the largest part's scale. The quantization statistics are the
    parts' means weighted by their energy (exact for the NSRs and profiles of naive MXFP4 and IHT,
    whose blocks lie within a part; each part ranks its own OE candidates), their OE top-k shares
    recomputed from the merged slice energies, and "rows" the total. The profiles are present
    when the first part's are."""
    if not parts:
        raise ValueError("observe_parts needs at least one part")
    first = parts[0]
    if len(parts) == 1:
        finite, quant = first.finite, first.quant
        row_var, col_var, row_e, col_e = first.row_var, first.col_var, first.row_energy, first.col_energy
    else:
        finite = torch.stack([p.finite for p in parts]).all()
        row_var, col_var, row_e, col_e, weights = _merge(parts)
        quant = _merge_quant([p.quant for p in parts], weights, row_e, col_e) if first.quant is not None else None
    scores = score_tensor(row_var, col_var)
    if row_var.numel() == 0 or col_var.numel() == 0:
        shares = torch.full((2,), math.nan, dtype=torch.float64, device=row_var.device)
    else:
        shares = share_tensor(row_e, col_e, k).double()
    label = torch.where(finite, label_of(scores, tau), PATTERNS.index("none"))
    if quant is None:
        values, names, profiles, present = torch.cat([scores, shares]), STAT_NAMES, {}, torch.zeros_like(finite)
    else:
        values = torch.cat([scores, shares, torch.stack(list(quant.stats.values()))])
        names, profiles, present = STAT_NAMES + tuple(quant.stats), quant.profiles, first.finite & first.quant.defined
    return DeviceObservation(label, names, torch.where(finite, values, math.nan), profiles, present, finite)


def observe_parts(parts: list[TensorPart], *, tau: float, k: int) -> TensorObservation:
    """``observe_on_device`` read back to the host."""
    return observe_on_device(parts, tau=tau, k=k).read()


def observe_tensor(t: torch.Tensor, *, tau: float, k: int, quant: bool = True,
                   profile_dims: tuple[int, ...] = PROFILE_DIMS) -> TensorObservation:
    """What calibration records of one tensor at one step, read back to the host: the label, the
    detector scores, the top-k energy shares and (``quant``) the quantization statistics at the
    OE k ladder of ``k`` (``quant_error.oe_k_ladder``), with profiles along ``profile_dims`` (dim 1
    by default; a weight's dim 0 too, whose index is a feature). A tensor holding NaN or Inf gets
    "none" and NaN statistics. One scaled copy of the tensor serves every statistic."""
    return observe_parts([tensor_part(t, k=k, quant=quant, profile_dims=profile_dims)], tau=tau, k=k)


def _merge(parts: list[TensorPart]):
    """The row and column statistics of the whole tensor from its parts, on the scale of the
    part with the largest exponent (``rescale``: exact powers of two), and each part's share of
    the energy (float64 [parts]; equal shares when there is no energy)."""
    device = parts[0].row_var.device
    # (a part of zeros has no scale of its own: it must not set the common one)
    has_energy = torch.stack([p.row_energy.sum() > 0 for p in parts])
    exps = torch.stack([p.exp for p in parts])
    exp = torch.where(has_energy.any(), torch.where(has_energy, exps, torch.iinfo(exps.dtype).min).max(), 0)
    row_var = torch.cat([rescale(p.row_var, 2 * (p.exp - exp)) for p in parts])
    row_e = torch.cat([rescale(p.row_energy, 2 * (p.exp - exp)) for p in parts])
    n = torch.stack([torch.full((), float(p.rows), dtype=torch.float64, device=device) for p in parts])
    means = torch.stack([rescale(p.col_mean, p.exp - exp).double() for p in parts])  # [parts, cols]
    m2 = torch.stack([rescale(p.col_var, 2 * (p.exp - exp)).double() for p in parts]) * (n - 1)[:, None]
    mean = (means * n[:, None]).sum(0) / n.sum()
    # Chan et al.: the sum of squared deviations of the whole from the parts' own and their means'
    col_var = ((m2 + n[:, None] * (means - mean).square()).sum(0) / (n.sum() - 1)).float()
    col_e = torch.stack([rescale(p.col_energy, 2 * (p.exp - exp)) for p in parts]).sum(0)
    energies = torch.stack([rescale(p.row_energy, 2 * (p.exp - exp)).sum() for p in parts]).double()
    total = energies.sum()
    weights = torch.where(total > 0, energies / total, 1.0 / len(parts))
    return row_var, col_var, row_e, col_e, weights


def _merge_quant(quants: list[QuantTensors], weights: torch.Tensor, row_e: torch.Tensor,
                 col_e: torch.Tensor) -> QuantTensors:
    """The parts' quantization statistics as one tensor's (``observe_on_device``); a part without
    energy (all zeros: its NSRs are NaN) weighs nothing, unless no part has any. The weighted sums
    run in float64, part by part, uncompensated (the same on every Python; Python 3.12's ``sum``
    of floats compensates, and would differ in the last place)."""
    counted = weights > 0
    counted = counted | ~counted.any()
    zero = torch.zeros((), dtype=torch.float64, device=weights.device)

    def weighted(values: list[torch.Tensor | None]) -> torch.Tensor:
        total = zero
        for w, c, v in zip(weights, counted, values):
            if v is not None:  # (an empty part has no profiles; it has no weight either)
                total = total + torch.where(c, w * v.double(), 0.0)
        return total

    stats = {}
    for name, first in quants[0].stats.items():
        if name == "rows":
            stats[name] = torch.stack([q.stats[name] for q in quants]).sum()
        elif name == "cols":
            stats[name] = first
        elif name == ENERGY:  # the whole tensor's squared norm: the parts' add up
            stats[name] = torch.stack([q.stats[name] for q in quants]).sum()
        elif name.startswith("share_"):  # the share of the k largest slices of the whole tensor
            energy = row_e if name.startswith("share_rows") else col_e
            top = int(name.split("@")[1])
            total = energy.sum()
            share = (energy.topk(min(top, energy.numel())).values.sum() / total).double()
            stats[name] = torch.where(total > 0, torch.where(share > 1.0, 1.0, share), math.nan)
        else:
            stats[name] = weighted([q.stats[name] for q in quants])
    profiles = {}
    for name, first in quants[0].profiles.items():
        if any(name in q.profiles and q.profiles[name].shape != first.shape for q in quants):
            raise ValueError(f"the parts' profiles {name} differ in length: a profile along the split dim "
                             "cannot merge")
        profiles[name] = weighted([q.profiles.get(name) for q in quants])
    return QuantTensors(stats, profiles, quants[0].defined)
