"""The schema of ``study.json`` (JSON Schema, draft 2020-12), and a small validator for it.

``SCHEMA`` documents every field (``description``); the report folder gets a copy as
``schema.json``. Numbers that are not finite (an SQNR of a GEMM without error, a score of a
constant tensor) are written as ``null``. ``validate`` checks an instance against the subset of
JSON Schema that ``SCHEMA`` uses (``type``, ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``minItems``, ``maxItems``, ``minimum``, ``$ref`` into
``$defs``), so the tests need no ``jsonschema`` package; any other keyword in a schema is an error
rather than silently ignored.
"""

from __future__ import annotations

from adahop.patterns.detect import PATTERNS
from adahop.policy import GEMM_MODES

NUM = {"type": ["number", "null"]}


def _obj(props: dict, required=None, extra=False, description: str | None = None) -> dict:
    d = {"type": "object", "properties": props, "required": list(props) if required is None else required,
         "additionalProperties": extra}
    if description:
        d["description"] = description
    return d


def _map(values: dict, description: str) -> dict:
    return {"type": "object", "additionalProperties": values, "description": description}


def _num(description: str) -> dict:
    return {**NUM, "description": description}


def _int(description: str, minimum: int = 0) -> dict:
    return {"type": "integer", "minimum": minimum, "description": description}


def _str(description: str) -> dict:
    return {"type": "string", "description": description}


def _list(items: dict, description: str) -> dict:
    return {"type": "array", "items": items, "description": description}


STATS = _obj({
    "pattern": {"$ref": "#/$defs/pattern", "description": "the detector's label (what calibration votes on)"},
    "cv_row": _num("detector score of the rows (about 1 for i.i.d. Gaussian)"),
    "cv_col": _num("detector score of the columns"),
    "row_energy_topk": _num("share of the squared norm in the policy_oe_k largest rows"),
    "col_energy_topk": _num("share of the squared norm in the policy_oe_k largest columns"),
    "rms": _num("root mean square of the tensor"),
    "absmax": _num("largest absolute value"),
}, description="one tensor at one step")

TENSOR = _obj({
    "pattern": {"$ref": "#/$defs/pattern", "description": "majority vote over the steps (a tie: none)"},
    "votes": _obj({p: _int(f"steps labelled {p}") for p in PATTERNS}),
    "mean": _obj({k: _num(f"mean {k} over the steps") for k in
                  ("cv_row", "cv_col", "row_energy_topk", "col_energy_topk")}, extra=NUM,
                 description="what a policy sees (patterns.calibration.LayerCalibration.summary): the mean "
                             "detector statistics and the quantization statistics of patterns.quant_error "
                             "(nsr_mxfp4_d{d}, nsr_iht_d{d}, nsr_oe_d{d}@{k}: noise-to-signal ratio quantized "
                             "along dim d, naive, IHT, IHT with the k outer slices exact; share_rows@{k}, "
                             "share_cols@{k}: energy share of the k largest rows, columns; rows, cols)"),
    "steps": _list({"$ref": "#/$defs/stats"}, "per step, in order"),
})

GEMM = _obj({
    "pair": {"$ref": "#/$defs/pair", "description": "(A, B) patterns from the voted patterns, with policy.py's flips"},
    "pairs": _list({"$ref": "#/$defs/pair"}, "the pair of each step's labels"),
    "M": _int("rows of A (outer)", 1), "Kc": _int("contraction dim", 1), "Nc": _int("columns of B (outer)", 1),
    "flops": _int("2 M Kc Nc", 1),
    "hp_share": _map(NUM, "strategy -> share of the GEMM's FLOPs run in BF16"),
    "sqnr_db": _map(_list(NUM, "one per measured step"), "strategy -> output SQNR (dB) vs the float64 product"),
    "oe_energy_share": _map(_list(NUM, "one per measured step"),
                            "OE strategy -> share of ||C||^2 in the slices it computes in BF16"),
    "mean_sqnr_db": _map(NUM, "strategy -> mean SQNR over the measured steps"),
    "best": _list({"type": "string"}, "per measured step, the best runnable 4-bit strategy (the ceiling)"),
    "best_sqnr_db": _list(NUM, "its SQNR"),
}, required=["pair", "pairs"], description="one GEMM of a layer; the measured fields exist when sqnr_steps > 0")

PICK = _obj({"mode": {"enum": list(GEMM_MODES), "description": "the policy's mode"},
             "oe_k": {"type": ["integer", "null"], "minimum": 1,
                      "description": "OE k of an OE mode (the policy's own, else policy_oe_k); null otherwise"},
             "strategy": _str("the strategy that runs it")})

LAYER = _obj({
    "name": _str("qualified module name"),
    "block": {"type": ["integer", "null"], "description": "the first integer in the name (the block), if any"},
    "kind": _str("the name after the block index (e.g. attention.wq)"),
    "in_features": _int("K", 1), "out_features": _int("N", 1),
    "tokens": _int("T of the first step", 1),
    "tensors": _obj({"x": {"$ref": "#/$defs/tensor"}, "w": {"$ref": "#/$defs/tensor"}, "g": {"$ref": "#/$defs/tensor"}},
                    description="x [T, K] activation, w [N, K] weight, g [T, N] output gradient"),
    "gemms": _obj({g: {"$ref": "#/$defs/gemm"} for g in ("fprop", "dgrad", "wgrad")}),
    "policies": _map(_obj({g: {"$ref": "#/$defs/pick"} for g in ("fprop", "dgrad", "wgrad")}),
                     "policy name -> its pick per GEMM"),
})

POLICY_SUMMARY = _obj({
    "oe_k": _map(_int("picks"), "OE k -> its OE picks (layer x GEMM)"),
    "modes": _map(_map(_int("layers"), "mode -> layers"), "GEMM -> mode counts"),
    "measured_gemms": _int("(layer, GEMM, step) with SQNRs"),
    "mean_sqnr_db": _num("mean SQNR of its picks"),
    "ceiling_mean_sqnr_db": _num("mean SQNR of the best runnable 4-bit strategy"),
    "gap_to_ceiling_db": _num("ceiling minus its mean"),
    "mxfp4_mean_sqnr_db": _num("mean SQNR of naive MXFP4 on the same GEMMs"),
    "fp4_gemms": _int("measured GEMMs where its pick is a 4-bit mode"),
    "fp4_mean_sqnr_db": _num("mean SQNR of its 4-bit picks"),
    "fp4_ceiling_mean_sqnr_db": _num("mean ceiling of the same GEMMs"),
    "best_share": _num("share of measured GEMMs where its pick reaches the ceiling"),
    "worse_than_mxfp4": _int("measured GEMMs where its pick is below naive MXFP4"),
    "max_shortfall_vs_mxfp4_db": _num("the largest such shortfall"),
    "hp_flop_share": _num("share of the studied GEMM FLOPs its picks run in BF16"),
})

OBSERVATION = _obj({
    "id": _str("short key"), "claim": _str("the paper's observation"),
    "holds": {"type": ["boolean", "null"], "description": "null: the study cannot tell"},
    "evidence": _str("the numbers behind it"),
    "share": _num("the share the verdict rests on"),
    "mean_gain_db": _num("IHT minus naive MXFP4 (iht_helps only)"),
}, required=["id", "claim", "holds", "evidence", "share"])

STABILITY = _obj({
    "tensors": _int("layers"), "stable": _int("layers whose label is the same on every step"),
    "stable_share": _num("stable / tensors"),
    "differ_from_vote_per_step": _list(_int("layers"), "per step, layers whose label differs from the vote"),
})

SUMMARY = _obj({
    "layers": _int("layers studied"), "skipped": _int("layers left out"),
    "measured_gemms": _int("(layer, GEMM, step) with SQNRs"),
    "patterns": _obj({
        "voted": _obj({r: _obj({p: _int("layers") for p in PATTERNS}) for r in ("x", "w", "g")}),
        "by_kind": _map(_obj({r: _obj({p: _int("layers") for p in PATTERNS}) for r in ("x", "w", "g")}),
                        "layer kind -> voted pattern counts"),
        "pairs": _obj({g: _map(_int("layers"), "pair -> layers") for g in ("fprop", "dgrad", "wgrad")}),
    }),
    "stability": _obj({r: STABILITY for r in ("x", "w", "g")}),
    "policies": _map(POLICY_SUMMARY, "policy name -> how its picks fare"),
    "ceiling": _obj({"candidates": _map(_list({"type": "string"}, "strategies"), "GEMM -> the ceiling's candidates"),
                     "hp_flop_share": _num("BF16 FLOP share of the ceiling's picks (first measured step)")}),
    "by_pair": _map(_obj({"gemms": _int("measured GEMMs with this pair"),
                          "mean_sqnr_db": _map(NUM, "strategy -> mean SQNR")}), "pair -> strategies' SQNR"),
    "iht_where_table_uses_it": {"type": ["object", "null"],
                                "description": "IHT vs naive MXFP4 where the lv2 policy picks an IHT mode",
                                "properties": {"policy": _str("policy"), "gemms": _int("measured GEMMs"),
                                               "mean_gain_db": _num("IHT minus naive MXFP4"),
                                               "helped_share": _num("share with a positive gain")},
                                "required": ["policy", "gemms", "mean_gain_db", "helped_share"],
                                "additionalProperties": False},
    "observations": _list({"$ref": "#/$defs/observation"}, "the paper's observations, checked"),
})

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://github.com/adahop/adahop/analyze/study.schema.json",
    "title": "adahop outlier study (study.json)",
    "description": "Written by adahop.analyze.run_study / adahop analyze; see docs/analyze.md.",
    "type": "object",
    "$defs": {
        "pattern": {"enum": list(PATTERNS)},
        "pair": {"type": "array", "items": {"$ref": "#/$defs/pattern"}, "minItems": 2, "maxItems": 2},
        "stats": STATS, "tensor": TENSOR, "gemm": GEMM, "pick": PICK, "layer": LAYER, "observation": OBSERVATION,
    },
    "properties": {
        "format": {"const": "adahop-outlier-study"},
        "format_version": {"const": 2},
        "created": _str("local time the study ended, ISO 8601"),
        "versions": _map({"type": "string"}, "package -> version"),
        "model": {"type": "object", "description": "what was studied (free-form)"},
        "data": {"type": "object", "description": "the batches (free-form: sources, documents, tokens)"},
        "settings": _obj({
            "steps": _int("forward + backward passes", 1),
            "sqnr_steps": _int("first steps whose GEMMs were multiplied under every strategy"),
            "tau": _num("the detector's threshold"),
            "oe_ks": _list(_int("k", 1), "OE k values measured"),
            "policy_oe_k": _int("the OE k of the policies' picks", 1),
            "signs_seed": _int("config seed of the random signs (iht_rs)"),
            "block_size": _int("MXFP4 block", 1), "hadamard_size": _int("IHT block", 1),
            "scale_mode": _str("MXFP4 scale mode"), "rounding": _str("element rounding, both operands"),
            "high_precision": _str("what bf16 and OE slices compute"), "reference": _str("the exact product"),
            "backend": _str("adahop backend of the MXFP4 GEMMs"), "torch_threads": _int("CPU threads", 1),
        }),
        "strategies": _list({"type": "string"}, "every strategy measured (docs/analyze.md)"),
        "policies": _list({"type": "string"}, "policy names"),
        "losses": _list(NUM, "the loss of each step"),
        "timing": _obj({k: _num(f"seconds: {k[:-2]}") for k in ("capture_s", "statistics_s", "gemms_s", "total_s")}),
        "layers": _list({"$ref": "#/$defs/layer"}, "the studied layers, in the model's order"),
        "skipped": _list(_obj({"name": _str("layer"), "reason": _str("why it was left out")}), "layers left out"),
        "summary": SUMMARY,
    },
    "required": ["format", "format_version", "created", "versions", "model", "data", "settings", "strategies",
                 "policies", "losses", "timing", "layers", "skipped", "summary"],
    "additionalProperties": False,
}

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_ANNOTATIONS = {"$schema", "$id", "$defs", "title", "description"}
_KEYWORDS = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
             "maxItems", "minimum", "$ref"}


def validate(instance, schema: dict = SCHEMA) -> list[str]:
    """Errors of ``instance`` against ``schema`` (empty: valid), each ``path: what``."""
    errors: list[str] = []
    _check(instance, schema, schema, "$", errors)
    return errors


def _resolve(ref: str, root: dict) -> dict:
    if not ref.startswith("#/"):
        raise ValueError(f"only local $ref are supported, got {ref!r}")
    node = root
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def _check(v, schema: dict, root: dict, path: str, errors: list[str]) -> None:
    unknown = set(schema) - _KEYWORDS - _ANNOTATIONS
    if unknown:
        raise ValueError(f"schema at {path} uses keywords this validator does not implement: {sorted(unknown)}")
    if "$ref" in schema:
        _check(v, _resolve(schema["$ref"], root), root, path, errors)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_TYPES[t](v) for t in types):
            errors.append(f"{path}: expected {' or '.join(types)}, got {type(v).__name__}")
            return
    if "const" in schema and v != schema["const"]:
        errors.append(f"{path}: expected {schema['const']!r}, got {v!r}")
    if "enum" in schema and v not in schema["enum"]:
        errors.append(f"{path}: {v!r} is not one of {schema['enum']}")
    if "minimum" in schema and _TYPES["number"](v) and v < schema["minimum"]:
        errors.append(f"{path}: {v} < minimum {schema['minimum']}")
    if isinstance(v, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in v:
                errors.append(f"{path}: missing {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, item in v.items():
            if key in props:
                _check(item, props[key], root, f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(item, extra, root, f"{path}.{key}", errors)
    if isinstance(v, list):
        if "minItems" in schema and len(v) < schema["minItems"]:
            errors.append(f"{path}: {len(v)} items < minItems {schema['minItems']}")
        if "maxItems" in schema and len(v) > schema["maxItems"]:
            errors.append(f"{path}: {len(v)} items > maxItems {schema['maxItems']}")
        if "items" in schema:
            for i, item in enumerate(v):
                _check(item, schema["items"], root, f"{path}[{i}]", errors)
