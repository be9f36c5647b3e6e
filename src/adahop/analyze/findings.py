"""The study's summary numbers, computed from its layers (``summarize``: a pure function of the
study, so a report can be recomputed from ``study.json``).

Definitions (docs/analyze.md, 'Reading the report'):

- a *measured GEMM* is one (layer, GEMM, step) with SQNRs (the first ``sqnr_steps`` steps);
- the *ceiling* of a measured GEMM is the best SQNR among the 4-bit modes a layer can run with
  OE k = ``policy_oe_k``: mxfp4, iht, iht+oe_left (not in wgrad), iht+oe_right;
- a policy's pick *is the best* when its SQNR reaches the ceiling (a BF16 pick always does);
- a policy's *high-precision FLOP share* is the FLOPs its picks run in BF16 (BF16 GEMMs and OE
  slices) over all the studied GEMMs' FLOPs;
- patterns are *stable* for a (layer, tensor) when every step gave the same label.
"""

from __future__ import annotations

import math
from collections import Counter

from adahop.analyze.strategies import runnable_fp4_strategies
from adahop.patterns.calibration import TENSOR_ROLES
from adahop.patterns.detect import PATTERNS
from adahop.policy import GEMMS

KV_NAMES = ("wk", "wv", "k_proj", "v_proj", "key", "value")
STABLE_SHARE = 0.9  # "stable over steps" holds when this share of (layer, tensor) never changes label


def is_kv(layer: dict) -> bool:
    """A key or value projection, by the last component of its name."""
    return layer["kind"].rsplit(".", 1)[-1] in KV_NAMES


def pair_label(pair) -> str:
    return f"({pair[0]}, {pair[1]})"


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _share(n: int, total: int) -> float | None:
    return n / total if total else None


def _counts(values) -> dict:
    c = Counter(values)
    return {p: c.get(p, 0) for p in PATTERNS}


def measured(layers: list[dict]):
    """(layer, gemm name, gemm dict) of every GEMM with SQNRs."""
    for layer in layers:
        for g in GEMMS:
            d = layer["gemms"][g]
            if "sqnr_db" in d:
                yield layer, g, d


def _patterns(layers: list[dict]) -> dict:
    out = {"voted": {r: _counts(la["tensors"][r]["pattern"] for la in layers) for r in TENSOR_ROLES}}
    kinds: dict[str, dict] = {}
    for la in layers:
        k = kinds.setdefault(la["kind"], {r: {p: 0 for p in PATTERNS} for r in TENSOR_ROLES})
        for r in TENSOR_ROLES:
            k[r][la["tensors"][r]["pattern"]] += 1
    out["by_kind"] = kinds
    pairs = {g: Counter(pair_label(la["gemms"][g]["pair"]) for la in layers) for g in GEMMS}
    out["pairs"] = {g: dict(sorted(c.items())) for g, c in pairs.items()}
    return out


def _stability(layers: list[dict], steps: int) -> dict:
    out = {}
    for r in TENSOR_ROLES:
        labels = [[s["pattern"] for s in la["tensors"][r]["steps"]] for la in layers]
        stable = sum(len(set(ls)) == 1 for ls in labels)
        differ = [sum(ls[s] != la["tensors"][r]["pattern"] for ls, la in zip(labels, layers) if s < len(ls))
                  for s in range(steps)]
        out[r] = {"tensors": len(layers), "stable": stable, "stable_share": _share(stable, len(layers)),
                  "differ_from_vote_per_step": differ}
    return out


def _policy(study: dict, name: str) -> dict:
    picked, ceiling, naive, flops_hp, flops_all = [], [], [], 0.0, 0.0
    fp4_picked, fp4_ceiling = [], []
    best_hits, worse, shortfall = 0, 0, 0.0
    modes = {g: Counter() for g in GEMMS}
    ks = Counter()
    for la in study["layers"]:
        for g in GEMMS:
            pick = la["policies"][name][g]
            modes[g][pick["mode"]] += 1
            if pick.get("oe_k") is not None:
                ks[str(pick["oe_k"])] += 1
    for la, g, d in measured(study["layers"]):
        s = la["policies"][name][g]["strategy"]
        flops_all += d["flops"]
        flops_hp += d["flops"] * d["hp_share"][s]
        for i, v in enumerate(d["sqnr_db"][s]):
            best = d["best_sqnr_db"][i]
            picked.append(v)
            ceiling.append(best)
            naive.append(d["sqnr_db"]["mxfp4"][i])
            best_hits += v >= best
            if s != "bf16":
                fp4_picked.append(v)
                fp4_ceiling.append(best)
            if v < d["sqnr_db"]["mxfp4"][i]:
                worse += 1
                shortfall = max(shortfall, d["sqnr_db"]["mxfp4"][i] - v)
    mean, top = _mean(picked), _mean(ceiling)
    return {
        "oe_k": dict(sorted(ks.items(), key=lambda kv: int(kv[0]))),
        "modes": {g: dict(sorted(c.items())) for g, c in modes.items()},
        "measured_gemms": len(picked),
        "mean_sqnr_db": mean,
        "ceiling_mean_sqnr_db": top,
        "gap_to_ceiling_db": None if mean is None or top is None else top - mean,
        "mxfp4_mean_sqnr_db": _mean(naive),
        "fp4_gemms": len(fp4_picked),
        "fp4_mean_sqnr_db": _mean(fp4_picked),
        "fp4_ceiling_mean_sqnr_db": _mean(fp4_ceiling),
        "best_share": _share(best_hits, len(picked)),
        "worse_than_mxfp4": worse,
        "max_shortfall_vs_mxfp4_db": shortfall,
        "hp_flop_share": flops_hp / flops_all if flops_all else None,
    }


def _ceiling_hp_share(study: dict) -> float | None:
    """The high-precision FLOP share of the ceiling's picks (first measured step)."""
    hp = total = 0.0
    for _, _, d in measured(study["layers"]):
        hp += d["flops"] * d["hp_share"][d["best"][0]]
        total += d["flops"]
    return hp / total if total else None


def _by_pair(study: dict) -> dict:
    acc: dict[str, dict] = {}
    for _, _, d in measured(study["layers"]):
        for i, pair in enumerate(d["pairs"][: len(d["best"])]):
            e = acc.setdefault(pair_label(pair), {"gemms": 0, "sqnr": {s: [] for s in d["sqnr_db"]}})
            e["gemms"] += 1
            for s, v in d["sqnr_db"].items():
                e["sqnr"][s].append(v[i])
    return {p: {"gemms": e["gemms"], "mean_sqnr_db": {s: _mean(v) for s, v in e["sqnr"].items()}}
            for p, e in sorted(acc.items())}


def _iht_where_table_uses_it(study: dict, policy: str = "lv2") -> dict | None:
    if policy not in study["policies"]:
        return None
    gains = []
    for la, g, d in measured(study["layers"]):
        if la["policies"][policy][g]["mode"].startswith("iht"):
            gains += [a - b for a, b in zip(d["sqnr_db"]["iht"], d["sqnr_db"]["mxfp4"])]
    return {"policy": policy, "gemms": len(gains), "mean_gain_db": _mean(gains),
            "helped_share": _share(sum(x > 0 for x in gains), len(gains))}


def _fmt(v, spec=".1%"):
    return "n/a" if v is None else format(v, spec)


def _observations(study: dict, pats: dict, stab: dict, iht: dict | None) -> list[dict]:
    layers = study["layers"]
    n = len(layers)
    obs = []

    def add(key, claim, holds, evidence, **numbers):
        obs.append({"id": key, "claim": claim, "holds": holds, "evidence": evidence, **numbers})

    g_row = pats["voted"]["g"]["row"]
    add("g_row", "gradients are mostly row-wise", g_row / n > 0.5,
        f"G is row-wise in {g_row} of {n} layers ({_fmt(g_row / n)}); col {pats['voted']['g']['col']}, "
        f"none {pats['voted']['g']['none']}", share=g_row / n)
    x_col = pats["voted"]["x"]["col"]
    add("x_col", "activations are mostly column-wise", x_col / n > 0.5,
        f"X is column-wise in {x_col} of {n} layers ({_fmt(x_col / n)}); row {pats['voted']['x']['row']}, "
        f"none {pats['voted']['x']['none']}", share=x_col / n)
    kv = [la for la in layers if is_kv(la)]
    if kv:
        kv_row = sum(la["tensors"]["g"]["pattern"] == "row" for la in kv)
        per_kind = {}
        for la in kv:
            n_row, n_all = per_kind.get(la["kind"], (0, 0))
            per_kind[la["kind"]] = (n_row + (la["tensors"]["g"]["pattern"] == "row"), n_all + 1)
        add("kv_g_row", "K/V projection gradients are row-wise", kv_row / len(kv) > 0.5,
            f"G is row-wise in {kv_row} of {len(kv)} K/V projections ({_fmt(kv_row / len(kv))}: "
            + ", ".join(f"{kind.rsplit('.', 1)[-1]} {r} of {n}" for kind, (r, n) in per_kind.items()) + ")",
            share=kv_row / len(kv))
    else:
        add("kv_g_row", "K/V projection gradients are row-wise", None, "no K/V projection among the layers",
            share=None)
    cc = [(la, g) for la in layers for g in GEMMS if tuple(la["gemms"][g]["pair"]) == ("col", "col")]
    cc_kv = sum(is_kv(la) for la, _ in cc)
    base = _share(sum(is_kv(la) for la in layers), n)
    if cc and kv:
        add("col_col_kv", "(col, col) pairs are concentrated in K/V projections", cc_kv / len(cc) > 0.5,
            f"{cc_kv} of the {len(cc)} (col, col) GEMMs are in K/V projections ({_fmt(cc_kv / len(cc))}; K/V "
            f"projections are {_fmt(base)} of the layers)", share=cc_kv / len(cc))
    else:
        add("col_col_kv", "(col, col) pairs are concentrated in K/V projections", None,
            "no (col, col) GEMM" if not cc else "no K/V projection among the layers", share=None)
    if iht and iht["gemms"]:
        helped = iht["helped_share"]
        add("iht_helps", "IHT helps where the table uses it", iht["mean_gain_db"] > 0 and helped > 0.5,
            f"on the {iht['gemms']} measured GEMMs where {iht['policy']} picks an IHT mode, IHT minus naive "
            f"MXFP4 is {iht['mean_gain_db']:+.2f} dB on average, positive in {_fmt(helped)}",
            share=helped, mean_gain_db=iht["mean_gain_db"])
    else:
        add("iht_helps", "IHT helps where the table uses it", None, "no measured GEMM with an IHT pick", share=None)
    steps = study["settings"]["steps"]
    if steps > 1:
        stable = sum(stab[r]["stable"] for r in TENSOR_ROLES)
        total = sum(stab[r]["tensors"] for r in TENSOR_ROLES)
        add("stable", f"patterns are stable over steps (at least {STABLE_SHARE:.0%} of (layer, tensor) keep "
            "their label on every step)", stable / total >= STABLE_SHARE,
            f"{stable} of {total} (layer, tensor) keep their label on all {steps} steps ({_fmt(stable / total)}); "
            + ", ".join(f"{r.upper()} {_fmt(stab[r]['stable_share'])}" for r in TENSOR_ROLES), share=stable / total)
    else:
        add("stable", "patterns are stable over steps", None, "one step only", share=None)
    return obs


def summarize(study: dict) -> dict:
    """The summary numbers of ``study`` (see the module doc)."""
    layers = study["layers"]
    pats = _patterns(layers)
    stab = _stability(layers, study["settings"]["steps"])
    iht = _iht_where_table_uses_it(study)
    k = study["settings"]["policy_oe_k"]
    return {
        "layers": len(layers),
        "skipped": len(study["skipped"]),
        "measured_gemms": sum(len(d["best"]) for _, _, d in measured(layers)),
        "patterns": pats,
        "stability": stab,
        "policies": {p: _policy(study, p) for p in study["policies"]},
        "ceiling": {"candidates": {g: list(runnable_fp4_strategies(g, k)) for g in GEMMS},
                    "hp_flop_share": _ceiling_hp_share(study)},
        "by_pair": _by_pair(study),
        "iht_where_table_uses_it": iht,
        "observations": _observations(study, pats, stab, iht),
    }
