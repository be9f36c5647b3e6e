"""Calibration: per-layer statistics of X, W and G over the first training steps, then a vote.

During calibration a layer runs its GEMMs in high precision and, every step, classifies its
activation X (as [T, K]), weight W ([N, K]) and output gradient G ([T, N]). It also records the
detector scores, the energy share of the top-k rows and columns, and how well the tensor quantizes
along each dim under naive MXFP4, IHT and IHT + OE at a ladder of k (``quant_error``), so that a
policy can use more than the labels (docs/method.md, 'Calibration'). When the layer has seen ``calibration_steps``
backward passes, each tensor's pattern is the majority vote of its labels (a tie between the leaders
gives "none": without a clear majority we make no structural claim), and the patterns stay frozen
for the rest of training.

Everything here is plain Python data, so it goes into a ``state_dict`` (extra state) that loads
with ``torch.load(weights_only=True)`` and dumps to JSON. The statistics are running sums keyed by
name: the state of an older calibration (without the quantization statistics) loads as it is, and
its summary simply lacks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adahop.patterns.detect import PATTERNS, classify_scores, scores_of, shares_of, slice_energies, unit_rows
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
    m = unit_rows(t)
    scores = scores_of(m)
    ks = oe_k_ladder(k)
    if m is None or m.numel() == 0:
        share_r = share_c = math.nan
        stats = dict.fromkeys(stat_names(ks), math.nan) if quant else {}
    else:
        energies = slice_energies(m)
        share_r, share_c = shares_of(*energies, k)
        stats = quant_stats(m, ks, energies=energies, profile_dims=profile_dims) if quant else {}
    return TensorObservation(classify_scores(scores, tau), scores.cv_row, scores.cv_col, share_r, share_c, stats)


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
