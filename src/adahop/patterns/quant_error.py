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
"""

from __future__ import annotations

import math
from collections.abc import Iterable

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


def _dim_stats(v: torch.Tensor, energy: torch.Tensor, order: torch.Tensor, index_energy: torch.Tensor,
               ks: list[int], d: int, profile: bool, max_slices: int, max_length: int) -> dict:
    """The NSRs of ``v`` [outer, L] quantized along L (its dim ``d`` in the caller's tensor).
    ``energy``: exact squared norms of the outer slices, ``order``: their ranking (OE's);
    ``index_energy``: the squared norms along L. The sample: slices (OE's candidates, then every
    n-th) times aligned groups of 32 along L (the most energetic quarter, then every n-th; all of
    them for a ``profile``), each cell weighted by how many it stands for; the NSRs are the
    weighted error over the weighted energy (exact when nothing is sampled)."""
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
    weight = (w_rows[:, None] * w_groups[None, :]).repeat_interleave(BLOCK, dim=1)  # per element
    signal = (cells.square() * weight).sum().item()
    out = {}
    for mode in ("mxfp4", "iht"):
        err = _quant_error(cells, iht=mode == "iht") * weight
        out[f"nsr_{mode}_d{d}"] = err.sum().item() / signal
        if mode == "iht":
            removed = torch.cumsum(err[:k_max].sum(1), 0)  # OE: the top slices' error, exact in BF16
            for k in ks:
                out[f"nsr_oe_d{d}@{k}"] = max(err.sum().item() - removed[min(k, k_max) - 1].item(), 0.0) / signal
            if profile:  # per block of 32: the Hadamard spreads the error evenly within a block
                per_block = err.reshape(err.shape[0], -1, BLOCK).sum(2)
                out[f"prof_iht_d{d}"] = (per_block.sum(0) / signal).tolist()
                removed = torch.cumsum(per_block[:k_max], 0)
                for k in ks:
                    out[f"prof_oe_d{d}@{k}"] = ((per_block.sum(0) - removed[min(k, k_max) - 1]).clamp(min=0)
                                                / signal).tolist()
        elif profile:
            # naive MXFP4's error lands where the operand's outliers are: per index of L, beside
            # the energy there (the policy weighs it with the other operand's energy profile)
            out[f"prof_mxfp4_d{d}"] = (err.sum(0)[:length] / signal).tolist()
            out[f"prof_energy_d{d}"] = (index_energy / index_energy.sum()).tolist()
    return out


def quant_stats(m: torch.Tensor, ks: Iterable[int], *, energies: tuple[torch.Tensor, torch.Tensor] | None = None,
                profile_dims: Iterable[int] = PROFILE_DIMS, max_slices: int = MAX_SLICES,
                max_length: int = MAX_LENGTH) -> dict:
    """The statistics of the module doc for finite 2-D ``m``, already ``unit_scaled``; NaN
    where undefined (an all-zero or empty tensor has no NSR). ``energies``: its rows' and
    columns' squared norms (``detect.slice_energies``), if the caller has them. ``profile_dims``:
    the dims whose profiles are kept (lists; see the module doc)."""
    profile_dims = check_profile_dims(profile_dims)
    ks = sorted(set(ks))
    rows, cols = m.shape
    out = dict.fromkeys(stat_names(ks), math.nan)
    out["rows"], out["cols"] = float(rows), float(cols)
    if m.numel() == 0:
        return out
    row_e, col_e = energies if energies is not None else slice_energies(m)
    energies = {1: row_e, 0: col_e}  # of the outer slices: rows for d = 1, columns for d = 0
    total = energies[1].sum().item()
    if total == 0:
        return out
    for d in QUANT_DIMS:
        e = energies[d]
        # OE's ranking: the largest norms first, ties to the lower index (ops/outliers.py)
        order = torch.sort(e, descending=True, stable=True).indices
        share = torch.cumsum(e[order], 0) / total
        for k in ks:
            out[f"share_{'rows' if d == 1 else 'cols'}@{k}"] = min(share[min(k, e.numel()) - 1].item(), 1.0)
        out.update(_dim_stats(m if d == 1 else m.t(), e, order, energies[1 - d], ks, d, d in profile_dims,
                              max_slices, max_length))
    return out
