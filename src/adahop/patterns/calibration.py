"""Calibration: per-layer statistics of X, W and G over the first training steps, then a vote.

During calibration a layer runs its GEMMs in high precision and, every step, classifies its
activation X (as [T, K]), weight W ([N, K]) and output gradient G ([T, N]). It also records the
detector scores, the energy share of the top-k rows and columns, and how well the tensor quantizes
along each dim under naive MXFP4, IHT and IHT + OE at a ladder of k (``quant_error``), so that a
policy can use more than the labels (docs/method.md, 'Calibration'). When the layer has seen ``calibration_steps``
backward passes, each tensor's pattern is the majority vote of its labels (a tie between the leaders
gives "none": without a clear majority we make no structural claim), and the patterns stay frozen
for the rest of training.

A micro-batch split into parts (``TrainConfig.calibration_micro_batches``: the parts' forward and
backward passes run one after the other, for memory) is still one observation: each part leaves a
``TensorPart`` (its rows' variances and energies, its columns' means, variances and energies, on
one power-of-two scale), and ``observe_parts`` merges them into the statistics of the whole
tensor, to float rounding, without ever holding it. The detector's scores depend on how many rows
a tensor has (a few outlier tokens stand out more among fewer), so observing each part on its own
would change the labels.

Everything here is plain Python data, so it goes into a ``state_dict`` (extra state) that loads
with ``torch.load(weights_only=True)`` and dumps to JSON. The statistics are running sums keyed by
name: the state of an older calibration (without the quantization statistics) loads as it is, and
its summary simply lacks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adahop.patterns.detect import (
    PATTERNS,
    as_rows,
    classify_scores,
    is_finite,
    rescale,
    scores_of_variances,
    shares_of,
    slice_energies,
    unit_scaled_exponent,
)
from adahop.patterns.quant_error import PROFILE_DIMS, oe_k_ladder, quant_stats, stat_names

TENSOR_ROLES = ("x", "w", "g")  # activation [T, K], weight [N, K], output gradient [T, N]
STAT_NAMES = ("cv_row", "cv_col", "row_energy_topk", "col_energy_topk")


@dataclass
class TensorObservation:
    pattern: str
    cv_row: float
    cv_col: float
    row_energy_topk: float
    col_energy_topk: float
    quant: dict = field(default_factory=dict)  # quant_error.quant_stats: name -> value


def observe_tensor(t: torch.Tensor, *, tau: float, k: int, quant: bool = True,
                   profile_dims: tuple[int, ...] = PROFILE_DIMS) -> TensorObservation:
    """What calibration records of one tensor at one step: the label, the detector scores, the
    top-k energy shares and (``quant``) the quantization statistics at the OE k ladder of ``k``
    (``quant_error.oe_k_ladder``), with profiles along ``profile_dims`` (dim 1 by default; a
    weight's dim 0 too, whose index is a feature). A tensor holding NaN or Inf gets "none" and NaN
    statistics. One scaled copy of the tensor serves every statistic."""
    return observe_parts([tensor_part(t, k=k, quant=quant, profile_dims=profile_dims)], tau=tau, k=k)


@dataclass
class TensorPart:
    """One part of a tensor split along its rows (a micro-batch's tokens), as ``observe_parts``
    merges it: the part scaled by ``2**-exp`` (``detect.unit_scaled``) and, on that scale, its
    rows' variances and squared norms, its columns' means, variances and squared norms, and its
    quantization statistics (``quant_error.quant_stats``; {} when not asked). ``finite`` False:
    the part holds NaN or Inf (then nothing else is kept)."""

    finite: bool
    exp: int = 0
    row_var: torch.Tensor | None = None
    row_energy: torch.Tensor | None = None
    col_mean: torch.Tensor | None = None
    col_var: torch.Tensor | None = None
    col_energy: torch.Tensor | None = None
    quant: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.row_var.numel()


def tensor_part(t: torch.Tensor, *, k: int, quant: bool = True,
                profile_dims: tuple[int, ...] = PROFILE_DIMS) -> TensorPart:
    """The ``TensorPart`` of ``t`` (as 2-D rows; see ``observe_tensor`` for ``k``, ``quant`` and
    ``profile_dims``)."""
    ks = oe_k_ladder(k)
    m = as_rows(t).detach()
    if not is_finite(m):
        return TensorPart(False, quant=dict.fromkeys(stat_names(ks), math.nan) if quant else {})
    m, exp = unit_scaled_exponent(m)
    rows, cols = m.shape
    row_e, col_e = slice_energies(m)
    stats = {}
    if quant:
        stats = (quant_stats(m, ks, energies=(row_e, col_e), profile_dims=profile_dims) if m.numel()
                 else dict.fromkeys(stat_names(ks), math.nan))
    # (a variance needs two values: a single row or column gets zeros, which the scores ignore)
    row_var = m.var(dim=1) if cols > 1 and rows else torch.zeros(rows, device=m.device)
    col_var = m.var(dim=0) if rows > 1 and cols else torch.zeros(cols, device=m.device)
    col_mean = m.mean(dim=0) if rows else torch.zeros(cols, device=m.device)
    return TensorPart(True, exp, row_var, row_e, col_mean, col_var, col_e, stats)


def observe_parts(parts: list[TensorPart], *, tau: float, k: int) -> TensorObservation:
    """The observation of the tensor whose row-parts are ``parts`` (``tensor_part`` of each, in
    any order): what ``observe_tensor`` gives for the whole tensor, to float rounding (exactly,
    for one part). Per row everything is the part's own; per column the variances merge by Chan's
    formula and the squared norms add, on the largest part's scale. The quantization statistics
    are the parts' means weighted by their energy (exact for the NSRs and profiles of naive MXFP4
    and IHT, whose blocks lie within a part; each part ranks its own OE candidates), their OE top-k
    shares recomputed from the merged slice energies, and "rows" the total."""
    if not parts:
        raise ValueError("observe_parts needs at least one part")
    if not all(p.finite for p in parts):
        stats = dict.fromkeys(parts[0].quant, math.nan)
        return TensorObservation("none", math.nan, math.nan, math.nan, math.nan, stats)
    if len(parts) == 1:
        p = parts[0]
        row_var, col_var, row_e, col_e, stats = p.row_var, p.col_var, p.row_energy, p.col_energy, dict(p.quant)
    else:
        row_var, col_var, row_e, col_e, weights = _merge(parts)
        stats = _merge_quant([p.quant for p in parts], weights, row_e, col_e)
    scores = scores_of_variances(row_var, col_var)
    if row_var.numel() == 0 or col_var.numel() == 0:
        share_r = share_c = math.nan
    else:
        share_r, share_c = shares_of(row_e, col_e, k)
    return TensorObservation(classify_scores(scores, tau), scores.cv_row, scores.cv_col, share_r, share_c, stats)


def _merge(parts: list[TensorPart]):
    """The row and column statistics of the whole tensor from its parts, on the scale of the
    part with the largest exponent (``rescale``: exact powers of two), and each part's share of
    the energy."""
    # (a part of zeros has no scale of its own: it must not set the common one)
    exp = max((p.exp for p in parts if bool(p.row_energy.sum() > 0)), default=0)
    row_var = torch.cat([rescale(p.row_var, 2 * (p.exp - exp)) for p in parts])
    row_e = torch.cat([rescale(p.row_energy, 2 * (p.exp - exp)) for p in parts])
    n = torch.tensor([float(p.rows) for p in parts], dtype=torch.float64, device=row_var.device)
    means = torch.stack([rescale(p.col_mean, p.exp - exp).double() for p in parts])  # [parts, cols]
    m2 = torch.stack([rescale(p.col_var, 2 * (p.exp - exp)).double() for p in parts]) * (n - 1)[:, None]
    mean = (means * n[:, None]).sum(0) / n.sum()
    # Chan et al.: the sum of squared deviations of the whole from the parts' own and their means'
    col_var = ((m2 + n[:, None] * (means - mean).square()).sum(0) / (n.sum() - 1)).float()
    col_e = torch.stack([rescale(p.col_energy, 2 * (p.exp - exp)) for p in parts]).sum(0)
    energies = torch.stack([rescale(p.row_energy, 2 * (p.exp - exp)).sum() for p in parts]).double()
    weights = (energies / energies.sum()).tolist() if energies.sum() > 0 else [1.0 / len(parts)] * len(parts)
    return row_var, col_var, row_e, col_e, weights


def _merge_quant(quants: list[dict], weights: list[float], row_e: torch.Tensor, col_e: torch.Tensor) -> dict:
    """The parts' quantization statistics as one tensor's (``observe_parts``); a part without
    energy (all zeros: its NSRs are NaN) weighs nothing."""
    parts = [(w, q) for w, q in zip(weights, quants) if w > 0] or list(zip(weights, quants))
    if not quants[0]:
        return {}
    out = {}
    for name, first in quants[0].items():
        if name == "rows":
            out[name] = float(sum(q[name] for q in quants))
        elif name == "cols":
            out[name] = first
        elif name.startswith("share_"):  # the share of the k largest slices of the whole tensor
            energy = row_e if name.startswith("share_rows") else col_e
            top = int(name.split("@")[1])
            total = energy.sum()
            out[name] = (min((energy.topk(min(top, energy.numel())).values.sum() / total).item(), 1.0)
                         if total > 0 else math.nan)
        elif isinstance(first, list):
            out[name] = [sum(w * q[name][i] for w, q in parts) for i in range(len(first))]
        else:
            out[name] = sum(w * q[name] for w, q in parts)
    return out


@dataclass
class TensorCalibration:
    """Votes and running sums of one tensor role of one layer."""

    votes: dict = field(default_factory=lambda: {p: 0 for p in PATTERNS})
    sums: dict = field(default_factory=lambda: {s: 0.0 for s in STAT_NAMES})
    finite_counts: dict = field(default_factory=lambda: {s: 0 for s in STAT_NAMES})

    def add(self, obs: TensorObservation) -> None:
        self.votes[obs.pattern] += 1
        values = {**{s: getattr(obs, s) for s in STAT_NAMES}, **obs.quant}
        for s, v in values.items():
            self.finite_counts.setdefault(s, 0)
            if isinstance(v, list):  # a profile: summed element-wise, when whole and of one length
                total = self.sums.setdefault(s, None)
                if all(math.isfinite(e) for e in v) and (total is None or len(total) == len(v)):
                    self.sums[s] = list(v) if total is None else [a + b for a, b in zip(total, v)]
                    self.finite_counts[s] += 1
                continue
            self.sums.setdefault(s, 0.0)
            if math.isfinite(v):
                self.sums[s] += float(v)
                self.finite_counts[s] += 1

    @property
    def steps(self) -> int:
        return sum(self.votes.values())

    def majority(self) -> str:
        best = max(self.votes.values())
        leaders = [p for p in PATTERNS if self.votes[p] == best]
        return leaders[0] if len(leaders) == 1 else "none"

    def means(self) -> dict:
        """Mean of each statistic over the steps where it was finite (NaN if it never was; a
        profile that never was is left out)."""
        out = {}
        for s, total in self.sums.items():
            n = self.finite_counts[s]
            if isinstance(total, list):
                out[s] = [v / n for v in total]
            elif total is not None:
                out[s] = total / n if n else math.nan
        return out

    def to_dict(self) -> dict:
        return {"votes": dict(self.votes), "sums": dict(self.sums), "finite_counts": dict(self.finite_counts)}

    @classmethod
    def from_dict(cls, d: dict) -> TensorCalibration:
        sums = {s: list(v) if isinstance(v, (list, tuple)) else v for s, v in d["sums"].items()}
        return cls(dict(d["votes"]), sums, dict(d["finite_counts"]))


@dataclass
class LayerCalibration:
    """Calibration state of one layer: one ``TensorCalibration`` per role."""

    tensors: dict = field(default_factory=lambda: {r: TensorCalibration() for r in TENSOR_ROLES})

    def add(self, role: str, obs: TensorObservation) -> None:
        self.tensors[role].add(obs)

    @property
    def steps(self) -> int:
        """Completed calibration steps: the number of observed output gradients."""
        return self.tensors["g"].steps

    def patterns(self) -> dict:
        return {r: self.tensors[r].majority() for r in TENSOR_ROLES}

    def summary(self) -> dict:
        """What a policy sees: per role, the voted pattern and the mean statistics."""
        return {r: {"pattern": self.tensors[r].majority(), **self.tensors[r].means()} for r in TENSOR_ROLES}

    def to_dict(self) -> dict:
        return {r: t.to_dict() for r, t in self.tensors.items()}

    @classmethod
    def from_dict(cls, d: dict) -> LayerCalibration:
        return cls({r: TensorCalibration.from_dict(d[r]) for r in TENSOR_ROLES})
