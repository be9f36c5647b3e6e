"""Calibration: per-layer statistics of X, W and G over the first training steps, then a vote.

During calibration a layer runs its GEMMs in high precision and, every step, observes its
activation X (as [T, K]), weight W ([N, K]) and output gradient G ([T, N]) (``patterns.observation``:
the label, the detector scores, the top-k energy shares and the quantization statistics; docs/method.md,
'Calibration'). When the layer has seen ``calibration_steps`` backward passes, each tensor's
pattern is the majority vote of its labels (a tie between the leaders gives "none": without a
clear majority we make no structural claim), and the patterns stay frozen for the rest of training.

What calibration keeps, per tensor role: the votes, the running sum of each statistic over the
steps where it was finite (a profile, a list, element-wise, when whole and of one length), and
those counts; a summary is the vote and the means.

Where they live. A training step's observations stay on the device (``DeviceObservation``) and are
added there: each role's votes, counts and sums are one float64 vector on the observed tensor's
device (``_Layout`` says where each number is), and a step adds one vector to it, so a
calibrating step never waits for the device (a host read per statistic would serialize it). The
host reads the vector once, when something needs plain numbers: the vote and the summary at the
freeze (``summary``, ``patterns``; linear.py), a checkpoint (``to_dict``), the data-parallel merge
(``read_calibrations``; train/distributed.py). The read leaves the state as plain Python data again
(the device vector is dropped; the next device observation starts a new one from it). The sums are
the ones the host would make: every statistic in float64 (a float32 one converted exactly), added in
step order. Observations read back already (``TensorObservation``: the study tools, tests) are added
on the host.

The plain data is what goes into a ``state_dict`` (extra state): it loads with
``torch.load(weights_only=True)`` and dumps to JSON. The statistics are running sums keyed by name:
the state of an older calibration (without the quantization statistics) loads as it is, and its
summary simply lacks them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from adahop.patterns.detect import PATTERNS
from adahop.patterns.observation import (  # noqa: F401  (observe_tensor, observe_parts, tensor_part: public here)
    STAT_NAMES,
    DeviceObservation,
    TensorObservation,
    TensorPart,
    observe_on_device,
    observe_parts,
    observe_tensor,
    tensor_part,
)

TENSOR_ROLES = ("x", "w", "g")  # activation [T, K], weight [N, K], output gradient [T, N]


@dataclass(frozen=True)
class _Layout:
    """Where each number of a role's device vector is:

        [votes (one per PATTERNS) | finite counts (scalars, then profiles) | seen (profiles) |
         sums of the scalars | sums of the profiles, one after the other]

    ``scalars``: (name, index in the observation's ``values``); ``profiles``: (name, length).
    "seen": the observation had the profile (the host's state then holds the key, None until it
    was once finite). ``key``: the observations it takes (their names and profile lengths)."""

    key: tuple
    scalars: tuple
    profiles: tuple
    all_scalars: bool

    @staticmethod
    def key_of(obs: DeviceObservation) -> tuple:
        return obs.names, tuple((n, p.numel()) for n, p in obs.profiles.items())

    @classmethod
    def of(cls, obs: DeviceObservation, sums: dict) -> _Layout:
        """The layout of ``obs``'s statistics, but those the host holds in another form (a list
        where a number comes, a profile of another length, a number where a profile comes): they
        keep their host value, as the host's ``add`` leaves them."""
        scalars = tuple((n, i) for i, n in enumerate(obs.names)
                        if isinstance(sums.get(n, 0.0), (int, float)))
        profiles = tuple((n, p.numel()) for n, p in obs.profiles.items()
                         if sums.get(n) is None or (isinstance(sums[n], list) and len(sums[n]) == p.numel()))
        return cls(cls.key_of(obs), scalars, profiles, len(scalars) == len(obs.names))

    def size(self) -> int:
        return len(PATTERNS) + 2 * len(self.scalars) + 2 * len(self.profiles) + sum(n for _, n in self.profiles)

    def upload(self, cal: TensorCalibration, device: torch.device) -> torch.Tensor:
        """The vector holding ``cal``'s host state: zeros (made on the device) for a fresh one,
        else one copy from the host that does not wait for the device."""
        host = ([float(cal._votes.get(p, 0)) for p in PATTERNS]
                + [float(cal._counts.get(n, 0)) for n, _ in self.scalars + self.profiles]
                + [1.0 if n in cal._sums else 0.0 for n, _ in self.profiles]
                + [float(cal._sums.get(n, 0.0)) for n, _ in self.scalars])
        for n, length in self.profiles:
            host += cal._sums[n] if isinstance(cal._sums.get(n), list) else [0.0] * length
        if not any(host):
            return torch.zeros(len(host), dtype=torch.float64, device=device)
        t = torch.tensor(host, dtype=torch.float64)
        return t if device.type == "cpu" else t.to(device, non_blocking=True)

    def vector(self, obs: DeviceObservation) -> torch.Tensor:
        """What ``obs`` adds (on its device): a vote, and each statistic with a count of 1 where
        finite (a profile: present, of a finite tensor, all finite), else 0 and nothing."""
        device = obs.values.device
        values = obs.values if self.all_scalars else torch.stack([obs.values[i] for _, i in self.scalars])
        finite = torch.isfinite(values)
        parts = [(torch.arange(len(PATTERNS), device=device) == obs.label).double(), finite.double()]
        sums = [torch.where(finite, values, 0.0)]
        if self.profiles:
            seen = obs.profiles_present
            counted = []
            for name, _ in self.profiles:
                p = obs.profiles[name].double()
                ok = seen & obs.finite & torch.isfinite(p).all()
                counted.append(ok)
                sums.append(torch.where(ok, p, 0.0))
            parts += [torch.stack(counted).double(), seen.double().expand(len(self.profiles))]
        return torch.cat(parts + sums)

    def absorb(self, cal: TensorCalibration, values: list[float]) -> None:
        """Write the vector read back (``values``) into ``cal``'s host state."""
        n_s, n_p = len(self.scalars), len(self.profiles)
        votes, at = values[:len(PATTERNS)], len(PATTERNS)
        counts, at = values[at:at + n_s + n_p], at + n_s + n_p
        seen, at = values[at:at + n_p], at + n_p
        scalar_sums, at = values[at:at + n_s], at + n_s
        for p, v in zip(PATTERNS, votes):
            cal._votes[p] = int(v)
        for (name, _), c, s in zip(self.scalars, counts, scalar_sums):
            cal._counts[name] = int(c)
            cal._sums[name] = s
        for (name, length), c, was_seen in zip(self.profiles, counts[n_s:], seen):
            total, at = values[at:at + length], at + length
            if was_seen:
                cal._counts[name] = int(c)
                cal._sums[name] = total if c else None


class TensorCalibration:
    """Votes and running sums of one tensor role of one layer (see the module doc). As plain
    data: ``votes`` (pattern -> count), ``sums`` (statistic -> running sum: a float, a list for a
    profile, None for a profile never finite) and ``finite_counts``; reading any of them (or
    ``means``, ``majority``, ``to_dict``) reads the device observations added since the last read
    (``read_all``). ``steps`` is counted on the host and reads nothing."""

    def __init__(self, votes: dict | None = None, sums: dict | None = None, finite_counts: dict | None = None):
        self._votes = dict(votes) if votes is not None else {p: 0 for p in PATTERNS}
        self._sums = dict(sums) if sums is not None else {s: 0.0 for s in STAT_NAMES}
        self._counts = dict(finite_counts) if finite_counts is not None else {s: 0 for s in STAT_NAMES}
        self._layout: _Layout | None = None
        self._acc: torch.Tensor | None = None  # the device vector (_Layout), None when all is on the host
        self._pending = 0  # observations in _acc, not yet in _votes

    @property
    def votes(self) -> dict:
        self.read()
        return self._votes

    @property
    def sums(self) -> dict:
        self.read()
        return self._sums

    @property
    def finite_counts(self) -> dict:
        self.read()
        return self._counts

    @property
    def steps(self) -> int:
        """Observations so far (host-side: nothing is read)."""
        return sum(self._votes.values()) + self._pending

    def add(self, obs: DeviceObservation | TensorObservation) -> None:
        """Add one observation: a ``DeviceObservation`` on its device (no host read), a
        ``TensorObservation`` (Python data) on the host."""
        if isinstance(obs, DeviceObservation):
            self._add_on_device(obs)
        else:
            self.read()
            self._add_on_host(obs)

    def _add_on_device(self, obs: DeviceObservation) -> None:
        device = obs.values.device
        if self._layout is None or self._layout.key != _Layout.key_of(obs) or self._acc.device != device:
            self.read()  # (a new run of device observations: another layout or device, or a read since)
            self._layout = _Layout.of(obs, self._sums)
            self._acc = self._layout.upload(self, device)
        self._acc += self._layout.vector(obs)
        self._pending += 1

    def _add_on_host(self, obs: TensorObservation) -> None:
        self._votes[obs.pattern] += 1
        values = {**{s: getattr(obs, s) for s in STAT_NAMES}, **obs.quant}
        for s, v in values.items():
            self._counts.setdefault(s, 0)
            if isinstance(v, list):  # a profile: summed element-wise, when whole and of one length
                total = self._sums.setdefault(s, None)
                if all(math.isfinite(e) for e in v) and (total is None or len(total) == len(v)):
                    self._sums[s] = list(v) if total is None else [a + b for a, b in zip(total, v)]
                    self._counts[s] += 1
                continue
            self._sums.setdefault(s, 0.0)
            if math.isfinite(v):
                self._sums[s] += float(v)
                self._counts[s] += 1

    def read(self) -> None:
        """Bring the device observations to the host state (one read of the device; nothing to
        do when there are none)."""
        read_all([self])

    def majority(self) -> str:
        votes = self.votes
        best = max(votes.values())
        leaders = [p for p in PATTERNS if votes[p] == best]
        return leaders[0] if len(leaders) == 1 else "none"

    def means(self) -> dict:
        """Mean of each statistic over the steps where it was finite (NaN if it never was; a
        profile that never was is left out)."""
        self.read()
        out = {}
        for s, total in self._sums.items():
            n = self._counts[s]
            if isinstance(total, list):
                out[s] = [v / n for v in total]
            elif total is not None:
                out[s] = total / n if n else math.nan
        return out

    def to_dict(self) -> dict:
        self.read()
        return {"votes": dict(self._votes), "sums": dict(self._sums), "finite_counts": dict(self._counts)}

    @classmethod
    def from_dict(cls, d: dict) -> TensorCalibration:
        sums = {s: list(v) if isinstance(v, (list, tuple)) else v for s, v in d["sums"].items()}
        return cls(dict(d["votes"]), sums, dict(d["finite_counts"]))

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorCalibration):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        where = f", {self._pending} on the device" if self._acc is not None else ""
        return f"TensorCalibration(steps={self.steps}{where})"


def read_all(calibrations: Iterable[TensorCalibration]) -> None:
    """Bring the device observations of ``calibrations`` to their host state with one read per
    device (the vectors concatenated)."""
    by_device: dict = {}
    for cal in calibrations:
        if cal._acc is not None:
            by_device.setdefault(cal._acc.device, []).append(cal)
    for group in by_device.values():
        flat = torch.cat([cal._acc for cal in group]).tolist()  # the read
        at = 0
        for cal in group:
            n = cal._acc.numel()
            cal._layout.absorb(cal, flat[at:at + n])
            at += n
            cal._layout, cal._acc, cal._pending = None, None, 0


@dataclass
class LayerCalibration:
    """Calibration state of one layer: one ``TensorCalibration`` per role."""

    tensors: dict = field(default_factory=lambda: {r: TensorCalibration() for r in TENSOR_ROLES})

    def add(self, role: str, obs: DeviceObservation | TensorObservation) -> None:
        self.tensors[role].add(obs)

    @property
    def steps(self) -> int:
        """Completed calibration steps: the number of observed output gradients (host-side)."""
        return self.tensors["g"].steps

    def read(self) -> None:
        """The three roles' device observations to the host, in one read."""
        read_all(self.tensors.values())

    def patterns(self) -> dict:
        self.read()
        return {r: self.tensors[r].majority() for r in TENSOR_ROLES}

    def summary(self) -> dict:
        """What a policy sees: per role, the voted pattern and the mean statistics."""
        self.read()
        return {r: {"pattern": self.tensors[r].majority(), **self.tensors[r].means()} for r in TENSOR_ROLES}

    def to_dict(self) -> dict:
        self.read()
        return {r: t.to_dict() for r, t in self.tensors.items()}

    @classmethod
    def from_dict(cls, d: dict) -> LayerCalibration:
        return cls({r: TensorCalibration.from_dict(d[r]) for r in TENSOR_ROLES})


def read_calibrations(calibrations: Iterable[LayerCalibration]) -> None:
    """The device observations of many layers to the host, in one read (per device)."""
    read_all(t for cal in calibrations for t in cal.tensors.values())
