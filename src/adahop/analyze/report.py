"""The report folder of a study:

    study.json          every number (schema: schema.json; non-finite numbers are null)
    schema.json         the JSON Schema (draft 2020-12) of study.json, with a description per field
    summary.md          the findings in prose and tables (docs/analyze.md, 'Reading the report')
    *.png               the figures (``figures.FIGURES``)

``write_report`` writes them all (each file atomically), from the study alone, so a report can
be redrawn from a ``study.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from adahop.analyze.figures import FIGURES, write_figures
from adahop.analyze.findings import pair_label
from adahop.analyze.schema import SCHEMA
from adahop.atomic_io import atomic_write_bytes
from adahop.patterns.calibration import TENSOR_ROLES
from adahop.policy import GEMMS

REPORT_FILES = ("study.json", "schema.json", "summary.md", *FIGURES)


def check_out_dir(out) -> Path:
    """The report folder, created and checked writable before any work."""
    from adahop.atomic_io import ensure_writable_dir

    return ensure_writable_dir(out, "--out")


def json_ready(obj):
    """``obj`` with non-finite floats as None and tuples as lists (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def write_report(study: dict, out) -> Path:
    """Write the report folder ``out`` (see the module doc). Returns the folder."""
    out = check_out_dir(out)
    study = json_ready(study)
    # compact: the study of a 135M model is 1.7 MB this way, 2.5 MB indented
    atomic_write_bytes(out / "study.json", json.dumps(study, separators=(",", ":"), allow_nan=False).encode())
    atomic_write_bytes(out / "schema.json", json.dumps(SCHEMA, indent=1).encode())
    atomic_write_bytes(out / "summary.md", summary_markdown(study).encode())
    write_figures(study, out)
    return out


# ---- summary.md ------------------------------------------------------------------------------------
def _db(v, signed: bool = False) -> str:
    return "-" if v is None else (f"{v:+.2f}" if signed else f"{v:.2f}")


def _pct(v, digits: int = 1) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}%"


def _counts(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]) if v)


def _table(head: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(map(str, r)) + " |"
                                                                        for r in rows)]


def _header(study: dict) -> list[str]:
    s, m, d, t = study["settings"], study["model"], study["data"], study["timing"]
    name = m.get("name") or m.get("class", "model")
    lines = [f"# Outlier study: {name}", ""]
    if m.get("spec"):
        lines.append(f"- model: `{m['spec']}` ({m.get('description', name)}), "
                     f"{m.get('parameters', 0):,} parameters")
    else:
        lines.append(f"- model: {name}, {m.get('parameters', 0):,} parameters")
    tokens = study["layers"][0]["tokens"] if study["layers"] else 0
    lines.append(f"- data: {d.get('description', '-')}; {s['steps']} steps of {tokens:,} tokens each (forward + "
                 "backward, no optimizer step: the weights are the same at every step)")
    losses = [v for v in study["losses"] if v is not None]
    if losses:
        lines.append(f"- loss per step: {', '.join(f'{v:.3f}' for v in losses)} nats/token")
    lines.append(f"- GEMM errors on the first {s['sqnr_steps']} step(s), every studied layer's fprop, dgrad and "
                 f"wgrad at full size (no dimension sampled); MXFP4 blocks of {s['block_size']}, `{s['scale_mode']}` "
                 f"scales, {s['rounding'].upper()} on both operands, Hadamard {s['hadamard_size']}; high precision = "
                 f"{s['high_precision']}; SQNR against the {s['reference']} product")
    lines.append(f"- detector tau = {s['tau']:g}; OE k measured: {', '.join(map(str, s['oe_ks']))}; policies' OE k = "
                 f"{s['policy_oe_k']}")
    lines.append(f"- run time {t['total_s']:.0f} s on {s['torch_threads']} CPU thread(s): forward + backward "
                 f"{t['capture_s']:.0f} s, detector statistics {t['statistics_s']:.0f} s, GEMMs under every strategy "
                 f"{t['gemms_s']:.0f} s; adahop {study['versions'].get('adahop')}, torch "
                 f"{study['versions'].get('torch')}")
    if study.get("command") or m.get("command"):
        lines.append(f"- command: `{study.get('command') or m.get('command')}`")
    sm = study["summary"]
    lines.append(f"- {sm['layers']} layers studied, {sm['skipped']} left out (listed at the end)")
    return lines


def _observations(sm: dict) -> list[str]:
    verdict = {True: "yes", False: "**no**", None: "cannot tell"}
    rows = [[o["claim"], verdict[o["holds"]], o["evidence"]] for o in sm["observations"]]
    return ["## The paper's observations", "", *_table(["observation", "holds here", "numbers"], rows)]


def _policies(study: dict) -> list[str]:
    sm = study["summary"]
    if not sm["measured_gemms"]:
        return ["## Policies against the best strategy per GEMM", "", "No GEMM was multiplied (sqnr_steps = 0)."]
    k = study["settings"]["policy_oe_k"]
    rows = []
    for name, p in sm["policies"].items():
        ks = ", ".join(f"{k}: {n}" for k, n in p["oe_k"].items()) if len(p["oe_k"]) > 1 else ", ".join(p["oe_k"])
        rows.append([name, f"{p['measured_gemms'] - p['fp4_gemms']} / {p['fp4_gemms']}", _db(p["mean_sqnr_db"]),
                     _db(p["fp4_mean_sqnr_db"]), _db(p["fp4_ceiling_mean_sqnr_db"]), _pct(p["best_share"]),
                     f"{p['worse_than_mxfp4']} (worst {p['max_shortfall_vs_mxfp4_db']:.2f} dB)",
                     _pct(p["hp_flop_share"], 2), ks or "-"])
    first = next(iter(sm["policies"].values()))
    n = first["measured_gemms"]
    rows.append(["naive MXFP4 everywhere", f"0 / {n}", _db(first["mxfp4_mean_sqnr_db"]),
                 _db(first["mxfp4_mean_sqnr_db"]), _db(first["ceiling_mean_sqnr_db"]), "-", "-", _pct(0.0, 2), "-"])
    rows.append(["the ceiling (best 4-bit mode per GEMM)", f"0 / {n}", _db(first["ceiling_mean_sqnr_db"]),
                 _db(first["ceiling_mean_sqnr_db"]), _db(first["ceiling_mean_sqnr_db"]), "100.0%", "0",
                 _pct(sm["ceiling"]["hp_flop_share"], 2), str(k)])
    return [
        "## Policies against the best strategy per GEMM", "",
        f"Over {n} measured GEMMs (layer x GEMM x step). The ceiling of a GEMM is the best SQNR among the 4-bit modes "
        f"a layer can run with OE k = {k} (mxfp4, iht, iht+oe_left except in wgrad, iht+oe_right); a pick 'is the "
        "best' when it reaches it (a BF16 pick always does, so the mean over all GEMMs of a policy with BF16 picks "
        "can exceed the ceiling: compare its 4-bit picks with the ceiling of the same GEMMs). A policy that chooses "
        "its OE k per GEMM (measured) can exceed it too, where it takes more than k slices; the last column counts "
        "its OE picks per k.", "",
        *_table(["policy", "GEMMs in BF16 / 4-bit", "mean SQNR (dB)", "mean SQNR of the 4-bit picks (dB)",
                 "ceiling of those GEMMs (dB)", "pick is the best", "GEMMs worse than naive MXFP4",
                 "FLOPs in BF16", "OE k"], rows),
    ]


def _mode_table(study: dict) -> list[str]:
    sm = study["summary"]
    layers = study["layers"]
    kinds = list(dict.fromkeys(la["kind"] for la in layers))
    policies = study["policies"]
    rows = []
    for kind in kinds:
        group = [la for la in layers if la["kind"] == kind]
        pats = sm["patterns"]["by_kind"][kind]
        row = [kind, len(group), *(_counts(pats[r]) for r in TENSOR_ROLES)]
        for g in GEMMS:
            cells = []
            for p in policies:
                c: dict[str, int] = {}
                for la in group:
                    mode = la["policies"][p][g]["mode"]
                    c[mode] = c.get(mode, 0) + 1
                cells.append(f"{p}: {_counts(c)}")
            row.append("<br>".join(cells) if len(set(c.split(': ', 1)[1] for c in cells)) > 1
                       else cells[0].split(": ", 1)[1])
        rows.append(row)
    return [
        "## The mode table calibration would pick", "",
        "Per layer kind: the voted patterns (layers per label) and the modes each policy picks from them (layers per "
        "mode; one entry when every policy agrees).", "",
        *_table(["layer kind", "layers", "X", "W", "G", "fprop", "dgrad", "wgrad"], rows),
    ]


def _by_pair(study: dict) -> list[str]:
    bp = study["summary"]["by_pair"]
    if not bp:
        return []
    strategies = study["strategies"]
    rows = [[p, e["gemms"], *(_db(e["mean_sqnr_db"][s]) for s in strategies)] for p, e in bp.items()]
    return ["## SQNR of every strategy per pattern pair", "",
            "Mean output SQNR (dB) of the measured GEMMs with each (A, B) pair (the pair of that step's labels; A row "
            "= outer-dim outliers, A col = inner; B row = inner, B col = outer).", "",
            *_table(["pair", "GEMMs", *strategies], rows)]


def _stability(study: dict) -> list[str]:
    stab = study["summary"]["stability"]
    rows = [[r.upper(), f"{s['stable']} of {s['tensors']} ({_pct(s['stable_share'])})",
             ", ".join(map(str, s["differ_from_vote_per_step"]))] for r, s in stab.items()]
    return ["## Stability over steps", "", "Labels per step against each layer's vote.", "",
            *_table(["tensor", "same label on every step", "layers differing from the vote, per step"], rows)]


def _every_layer(study: dict) -> list[str]:
    policies = study["policies"]
    rows = []
    for la in study["layers"]:
        t = la["tensors"]
        rows.append([f"`{la['name']}`", *(t[r]["pattern"] for r in TENSOR_ROLES),
                     *(pair_label(la["gemms"][g]["pair"]) for g in GEMMS),
                     *(" / ".join(la["policies"][p][g]["mode"] for g in GEMMS) for p in policies)])
    return ["## Every layer", "", "Voted patterns, GEMM pairs, and each policy's modes (fprop / dgrad / wgrad).", "",
            *_table(["layer", "X", "W", "G", "fprop pair", "dgrad pair", "wgrad pair",
                     *(f"{p} modes" for p in policies)], rows)]


def summary_markdown(study: dict) -> str:
    sm = study["summary"]
    sections = [_header(study), _observations(sm), _policies(study), _mode_table(study), _by_pair(study),
                _stability(study)]
    parts = [section + [""] for section in sections if section]
    skipped = study["skipped"]
    parts.append(["## Layers left out", ""] + ([f"- `{s['name']}`: {s['reason']}" for s in skipped] or ["None."])
                 + [""])
    parts.append(_every_layer(study) + [""])
    parts.append(["## Files", "", "- `study.json`: every number; `schema.json`: its schema, a description per field",
                  *(f"- `{f}`" for f in FIGURES), ""])
    return "\n".join(line for part in parts for line in part)
