"""How well one tensor quantizes along each of its two dims: what a measured policy predicts a
GEMM's error from (docs/method.md, 'Calibration', 'Strategy per GEMM').

Every tensor of a linear layer is quantized along both of its dims, in different GEMMs (x_TK
activation, w_NK weight, g_TN output gradient):

    x  along K (dim 1): A of fprop        along T (dim 0): B of wgrad
    w  along K (dim 1): B of fprop        along N (dim 0): B of dgrad
    g  along N (dim 1): A of dgrad        along T (dim 0): A of wgrad

and outlier extraction takes the slices of the *other* dim (the outer one): rows when the tensor
is quantized along dim 1, columns along dim 0. So, per dim d of a tensor t, ``quant_stats`` gives
the noise-to-signal ratio NSR = ||Q(t) - t||^2 / ||t||^2 of

    nsr_mxfp4_d{d}     naive MXFP4 along d
    nsr_iht_d{d}       block Hadamard along d, then MXFP4 (the error is measured in the rotated
                       basis: the Hadamard is orthonormal, so it is the error of the product's
                       operand)
    nsr_oe_d{d}@{k}    IHT, with the k outer slices of the largest L2 norm kept exact (OE)

and, per k, the share of ||t||^2 in the k largest rows (``share_rows@{k}``) and columns
(``share_cols@{k}``), plus the tensor's ``rows`` and ``cols``. Along the dims of ``profile_dims``
also two *profiles* over the index of the quantization dim (lists, normalised by ||t||^2):
``prof_mxfp4_d{d}``, where naive MXFP4's error lands (it sums to nsr_mxfp4_d{d}), and
``prof_energy_d{d}``, where the energy is (it sums to 1), per index; ``prof_iht_d{d}`` and
``prof_oe_d{d}@{k}``, IHT's and OE's error per block of 32 (a Hadamard spreads the error evenly
within its block, not across blocks). What an operand's error costs a product depends on the
other operand's energy where the error lands: a naive MXFP4 outlier keeps its error on its own
block's elements, and a block of large values gets a large error under IHT too.
The numerics are the library's reference (``formats.mxfp4.quantize_mxfp4`` after
``transforms.hadamard.block_hadamard``, what ``ops.operand.quantize_operand`` runs): blocks and
Hadamard of 32, ``even`` scales, RNE. OE's BF16 slices are counted as exact (BF16's NSR is ~1e-5,
three orders below MXFP4's).

Cost. Calibration observes every layer at every step, so the quantizations run on a sample:
the k_max = max(ks) slices of the largest norm (OE's candidates) and up to ``max_slices`` of the
others (every n-th by index), each over up to ``max_length`` elements of the quantization dim
(the most energetic quarter of the aligned groups of 32, then every n-th: a group quantizes on
its own; a profiled dim is read whole). Each sampled element stands for as many as its slice and
group were sampled from, and an NSR is the weighted error over the weighted energy: exact when
nothing is sampled. The statistics are ratios, computed on ``detect.unit_scaled(t)`` (a power-of-two scaling, exact):
they do not depend on the tensor's scale, and no square under- or overflows.

Device and host. ``quant_tensors`` computes them on the tensor's device and leaves them there (a
``QuantTensors``: 0-d float64 tensors, profiles as 1-d tensors, and whether the tensor had energy
at all), so that calibration reads nothing back per step; ``quant_stats`` is the same read back
to Python numbers and lists, once. The device arithmetic is the one the host did on ``.item()``
values: float64 for the NSRs, and for a profile the float32 division by the (float32) signal that
``tensor / float`` runs (on CUDA, a multiply by its float32 reciprocal: ``_div_by_scalar``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from adahop.formats.mxfp4 import dequantize_mxfp4, pad_to_multiple, quantize_mxfp4
from adahop.patterns.detect import slice_energies
from adahop.transforms.hadamard import block_hadamard

BLOCK = 32  # MXFP4 block and Hadamard size of the statistics (the library's defaults)
QUANT_DIMS = (1, 0)
MAX_SLICES = 256  # sampled outer slices beyond OE's candidates
MAX_LENGTH = 1024  # sampled elements along the quantization dim (32 groups of 32)
# Profiles along dim 1 by default: its index is a feature (K of x and w, N of g), the same at every
# step; dim 0's index is a token for x and g, and only the weight's rows (N) are features.
PROFILE_DIMS = (1,)
OE_K_FACTORS = (0.25, 0.5, 1.0, 2.0)  # the OE k ladder, relative to the layer's k


def oe_k_ladder(k: int) -> tuple[int, ...]:
    """The OE k values observed for a layer whose configured k is ``k``: k/4, k/2, k, 2k."""
    return tuple(sorted({max(1, round(k * f)) for f in OE_K_FACTORS}))


def check_profile_dims(dims: Iterable[int]) -> tuple[int, ...]:
    dims = tuple(dims)
    if not set(dims) <= set(QUANT_DIMS):
        raise ValueError(f"profile_dims must be a subset of {QUANT_DIMS}, got {dims!r}")
    return dims


def stat_names(ks: Iterable[int]) -> tuple[str, ...]:
    """The keys ``quant_stats`` returns for OE k values ``ks``."""
    ks = sorted(set(ks))
    names = ["rows", "cols"]
    for d in QUANT_DIMS:
        names += [f"nsr_mxfp4_d{d}", f"nsr_iht_d{d}", *(f"nsr_oe_d{d}@{k}" for k in ks)]
    names += [f"share_rows@{k}" for k in ks] + [f"share_cols@{k}" for k in ks]
    return tuple(names)


def _quant_error(sub: torch.Tensor, iht: bool) -> torch.Tensor:
    """Squared error of each element of quantizing 2-D float32 ``sub`` along dim 1 (length a
    multiple of 32), after a block Hadamard when ``iht`` (then in the rotated basis)."""
    v = block_hadamard(sub, dim=1, size=BLOCK) if iht else sub
    q = dequantize_mxfp4(quantize_mxfp4(v, dim=1, block_size=BLOCK, scale_mode="even", rounding="rne"))
    return (q - v).square()


def _strided(n: int, most: int, device) -> torch.Tensor:
    """Up to ``most`` of range(n), every ceil(n / most)-th."""
    return torch.arange(0, n, max(1, -(-n // most)), device=device)[:most]


def _sample(order: torch.Tensor, keep: int, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``keep`` of ``order`` and every n-th of the others by index (up to ``most``),
    with their weights: 1 for the kept, (others / sampled) for the sampled."""
    top, rest = order[:keep], order[keep:]
    picked = rest.sort().values[_strided(rest.numel(), most, order.device)] if rest.numel() else rest
    weights = torch.ones(top.numel() + picked.numel(), device=order.device)
    if picked.numel():
        weights[top.numel():] = rest.numel() / picked.numel()
    return torch.cat((top, picked)), weights


def _div_by_scalar(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t / float(s)`` for a float32 tensor ``t`` and a float32 0-d tensor ``s``, without reading
    ``s`` back: the CPU divides; CUDA divides a tensor by a Python float as a multiply by the
    float32 reciprocal (aten's div_true_kernel_cuda), which a 0-d device divisor would not do."""
    return t * torch.reciprocal(s) if t.device.type == "cuda" else t / s


def _dim_stats(v: torch.Tensor, energy: torch.Tensor, order: torch.Tensor, index_energy: torch.Tensor,
               ks: list[int], d: int, profile: bool, max_slices: int, max_length: int) -> tuple[dict, dict]:
    """The NSRs (0-d float64 tensors) and, for a ``profile``, the profiles (1-d float32) of ``v``
    [outer, L] quantized along L (its dim ``d`` in the caller's tensor). ``energy``: exact squared
    norms of the outer slices, ``order``: their ranking (OE's); ``index_energy``: the squared
    norms along L. The sample: slices (OE's candidates, then every n-th) times aligned groups of
    32 along L (the most energetic quarter, then every n-th; all of them for a ``profile``), each
    cell weighted by how many it stands for; the NSRs are the weighted error over the weighted
    energy (exact when nothing is sampled)."""
    outer, length = v.shape
    k_max = min(max(ks), outer)
    rows, w_rows = _sample(order, k_max, max_slices)
    cells = pad_to_multiple(v[rows], BLOCK)
    n_groups = cells.shape[1] // BLOCK
    most = n_groups if profile else max(1, max_length // BLOCK)
    if n_groups > most:
        group_energy = pad_to_multiple(index_energy, BLOCK).reshape(n_groups, BLOCK).sum(1)
        groups, w_groups = _sample(torch.sort(group_energy, descending=True, stable=True).indices, most // 4,
                                   most - most // 4)
        cells = cells.reshape(rows.numel(), n_groups, BLOCK)[:, groups].reshape(rows.numel(), -1)
    else:
        w_groups = torch.ones(n_groups, device=v.device)
    # per element; an expand, which reads nothing back (repeat_interleave's int form went through a
    # tensor of repeats in some torch versions)
    weight = (w_rows[:, None] * w_groups[None, :])[:, :, None].expand(-1, -1, BLOCK).reshape(rows.numel(), -1)
    signal = (cells.square() * weight).sum()
    stats, profiles = {}, {}
    for mode in ("mxfp4", "iht"):
        err = _quant_error(cells, iht=mode == "iht") * weight
        total_err = err.sum().double()
        stats[f"nsr_{mode}_d{d}"] = total_err / signal.double()
        if mode == "iht":
            removed = torch.cumsum(err[:k_max].sum(1), 0)  # OE: the top slices' error, exact in BF16
            for k in ks:
                left = total_err - removed[min(k, k_max) - 1].double()
                stats[f"nsr_oe_d{d}@{k}"] = torch.where(left < 0, 0.0, left) / signal.double()  # max(left, 0)
            if profile:  # per block of 32: the Hadamard spreads the error evenly within a block
                per_block = err.reshape(err.shape[0], -1, BLOCK).sum(2)
                profiles[f"prof_iht_d{d}"] = _div_by_scalar(per_block.sum(0), signal)
                removed = torch.cumsum(per_block[:k_max], 0)
                for k in ks:
                    profiles[f"prof_oe_d{d}@{k}"] = _div_by_scalar(
                        (per_block.sum(0) - removed[min(k, k_max) - 1]).clamp(min=0), signal)
        elif profile:
            # naive MXFP4's error lands where the operand's outliers are: per index of L, beside
            # the energy there (the policy weighs it with the other operand's energy profile)
            profiles[f"prof_mxfp4_d{d}"] = _div_by_scalar(err.sum(0)[:length], signal)
            profiles[f"prof_energy_d{d}"] = index_energy / index_energy.sum()
    return stats, profiles


@dataclass
class QuantTensors:
    """``quant_stats`` on the device: ``stats``, each of ``stat_names`` as a 0-d float64 tensor
    (NaN where undefined); ``profiles``, name -> 1-d tensor (in ``quant_stats``' order; their
    values are meaningless where ``defined`` is False); ``defined``, a 0-d bool tensor: the tensor
    has energy (an all-zero or empty one has no NSRs and no profiles)."""

    stats: dict
    profiles: dict
    defined: torch.Tensor

    def read(self) -> dict:
        """What ``quant_stats`` returns: Python floats, the profiles as lists when defined. One
        read of the device."""
        sizes = [p.numel() for p in self.profiles.values()]
        flat = torch.cat([self.defined.double().reshape(1), torch.stack(list(self.stats.values())),
                          *(p.double() for p in self.profiles.values())]).tolist()
        out = dict(zip(self.stats, flat[1:1 + len(self.stats)]))
        if flat[0]:
            at = 1 + len(self.stats)
            for name, n in zip(self.profiles, sizes):
                out[name], at = flat[at:at + n], at + n
        return out


def quant_tensors(m: torch.Tensor, ks: Iterable[int], *, energies: tuple[torch.Tensor, torch.Tensor] | None = None,
                  profile_dims: Iterable[int] = PROFILE_DIMS, max_slices: int = MAX_SLICES,
                  max_length: int = MAX_LENGTH) -> QuantTensors:
    """The statistics of the module doc for finite 2-D ``m``, already ``unit_scaled``, on m's
    device (nothing is read back); NaN where undefined (an all-zero or empty tensor has no NSR).
    ``energies``: its rows' and columns' squared norms (``detect.slice_energies``), if the caller
    has them. ``profile_dims``: the dims whose profiles are kept (see the module doc)."""
    profile_dims = check_profile_dims(profile_dims)
    ks = sorted(set(ks))
    rows, cols = m.shape
    nan = torch.full((), math.nan, dtype=torch.float64, device=m.device)
    stats = dict.fromkeys(stat_names(ks), nan)
    stats["rows"], stats["cols"] = (torch.full((), float(n), dtype=torch.float64, device=m.device)
                                    for n in (rows, cols))
    if m.numel() == 0:
        return QuantTensors(stats, {}, torch.zeros((), dtype=torch.bool, device=m.device))
    row_e, col_e = energies if energies is not None else slice_energies(m)
    energies = {1: row_e, 0: col_e}  # of the outer slices: rows for d = 1, columns for d = 0
    total = energies[1].sum()
    defined = total != 0
    profiles = {}
    for d in QUANT_DIMS:
        e = energies[d]
        # OE's ranking: the largest norms first, ties to the lower index (ops/outliers.py)
        order = torch.sort(e, descending=True, stable=True).indices
        share = _div_by_scalar(torch.cumsum(e[order], 0), total)
        for k in ks:
            s = share[min(k, e.numel()) - 1].double()
            stats[f"share_{'rows' if d == 1 else 'cols'}@{k}"] = torch.where(s > 1.0, 1.0, s)  # min(s, 1)
        dim_stats, dim_profiles = _dim_stats(m if d == 1 else m.t(), e, order, energies[1 - d], ks, d,
                                             d in profile_dims, max_slices, max_length)
        stats.update(dim_stats)
        profiles.update(dim_profiles)
    stats = {n: v if n in ("rows", "cols") else torch.where(defined, v, nan) for n, v in stats.items()}
    return QuantTensors(stats, profiles, defined)


def quant_stats(m: torch.Tensor, ks: Iterable[int], *, energies: tuple[torch.Tensor, torch.Tensor] | None = None,
                profile_dims: Iterable[int] = PROFILE_DIMS, max_slices: int = MAX_SLICES,
                max_length: int = MAX_LENGTH) -> dict:
    """``quant_tensors`` read back: name -> float, and the profiles as lists (left out where
    undefined)."""
    return quant_tensors(m, ks, energies=energies, profile_dims=profile_dims, max_slices=max_slices,
                         max_length=max_length).read()
