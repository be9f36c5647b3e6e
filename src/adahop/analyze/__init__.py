"""The outlier study as a tool: which of X, W, G carry row-wise, column-wise or no outliers, per
layer and step, and what each strategy does to each GEMM's error (docs/analyze.md).

    study = adahop.analyze.run_study(model, batches, steps=4, out="runs/analyze")

Files, bottom to top: ``collect`` (hooks: each linear's X, W, G for one forward + backward),
``observe`` (per-tensor detector statistics), ``strategies`` (one GEMM's SQNR under every
strategy), ``study`` (``run_study``), ``findings`` (the summary numbers), ``schema`` (study.json's
JSON Schema and a validator), ``figures`` and ``report`` (the report folder), ``inputs`` (what
``adahop analyze`` loads: a model spec and batches of text).
"""

from adahop.analyze.collect import find_linears, lm_loss
from adahop.analyze.report import REPORT_FILES, write_report
from adahop.analyze.schema import SCHEMA, validate
from adahop.analyze.strategies import gemm_errors, layer_gemms, strategy_names
from adahop.analyze.study import default_policies, run_study

__all__ = [
    "REPORT_FILES",
    "SCHEMA",
    "default_policies",
    "find_linears",
    "gemm_errors",
    "layer_gemms",
    "lm_loss",
    "run_study",
    "strategy_names",
    "validate",
    "write_report",
]
