"""Calibration: per-layer statistics of X, W and G over the first training steps, then a vote.

During calibration a layer runs its GEMMs in high precision and, every step, classifies its
activation X (as [T, K]), weight W ([N, K]) and output gradient G ([T, N]). It also records the
detector scores and the energy share of the top-k rows and columns, so that a future policy can use
more than the labels (docs/method.md, 'Calibration'). When the layer has seen ``calibration_steps``
backward passes, each tensor's pattern is the majority vote of its labels (a tie between the leaders
gives "none": without a clear majority we make no structural claim), and the patterns stay frozen
for the rest of training.

Everything here is plain Python data, so it goes into a ``state_dict`` (extra state) that loads
with ``torch.load(weights_only=True)`` and dumps to JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from adahop.patterns.detect import PATTERNS, classify_scores, outlier_scores, topk_energy_share

TENSOR_ROLES = ("x", "w", "g")  # activation [T, K], weight [N, K], output gradient [T, N]
STAT_NAMES = ("cv_row", "cv_col", "row_energy_topk", "col_energy_topk")


@dataclass
class TensorObservation:
    pattern: str
    cv_row: float
    cv_col: float
    row_energy_topk: float
    col_energy_topk: float


def observe_tensor(t: torch.Tensor, *, tau: float, k: int) -> TensorObservation:
    scores = outlier_scores(t)
    share_r, share_c = topk_energy_share(t, k)
    return TensorObservation(classify_scores(scores, tau), scores.cv_row, scores.cv_col, share_r, share_c)


@dataclass
class TensorCalibration:
    """Votes and running sums of one tensor role of one layer."""

    votes: dict = field(default_factory=lambda: {p: 0 for p in PATTERNS})
    sums: dict = field(default_factory=lambda: {s: 0.0 for s in STAT_NAMES})
    finite_counts: dict = field(default_factory=lambda: {s: 0 for s in STAT_NAMES})

    def add(self, obs: TensorObservation) -> None:
        self.votes[obs.pattern] += 1
        for s in STAT_NAMES:
            v = getattr(obs, s)
            if math.isfinite(v):
                self.sums[s] += v
                self.finite_counts[s] += 1

    @property
    def steps(self) -> int:
        return sum(self.votes.values())

    def majority(self) -> str:
        best = max(self.votes.values())
        leaders = [p for p in PATTERNS if self.votes[p] == best]
        return leaders[0] if len(leaders) == 1 else "none"

    def means(self) -> dict:
        return {
            s: (self.sums[s] / self.finite_counts[s] if self.finite_counts[s] else math.nan)
            for s in STAT_NAMES
        }

    def to_dict(self) -> dict:
        return {"votes": dict(self.votes), "sums": dict(self.sums), "finite_counts": dict(self.finite_counts)}

    @classmethod
    def from_dict(cls, d: dict) -> TensorCalibration:
        return cls(dict(d["votes"]), dict(d["sums"]), dict(d["finite_counts"]))


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
