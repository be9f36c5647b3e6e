"""Session 10: what the OE norms cost inside quantize_both vs torch.linalg.vector_norm apart."""
import json, sys, torch
from triton.testing import do_bench
from adahop.kernels.quantize_both import quantize_both
from adahop.ops.outliers import outer_norms
out = sys.argv[1]
res = []
for T, N in ((16384, 14336), (16384, 4096)):
    g = torch.randn(T, N, device="cuda").to(torch.bfloat16)
    sr = dict(hadamard_size=32, rounding="sr", sr_seed=3); sr2 = dict(sr, sr_seed=4); h = dict(hadamard_size=32)
    row = {"shape": [T, N]}
    a, b = quantize_both(g, sr, sr2, row_norms=True)
    row["row_norm_max_rel_diff"] = ((a["norms"] - outer_norms(g, 0)).abs() / outer_norms(g, 0)).max().item()
    a, b = quantize_both(g, h, h, rows_form="packed", col_norms=True)
    row["col_norm_max_rel_diff"] = ((b["norms"] - outer_norms(g, 1)).abs() / outer_norms(g, 1)).max().item()
    for name, fn in [
        ("g_both_sr", lambda: quantize_both(g, sr, sr2)),
        ("g_both_sr_row_norms", lambda: quantize_both(g, sr, sr2, row_norms=True)),
        ("vector_norm_rows", lambda: outer_norms(g, 0)),
        ("x_both_packed", lambda: quantize_both(g, h, h, rows_form="packed")),
        ("x_both_packed_col_norms", lambda: quantize_both(g, h, h, rows_form="packed", col_norms=True)),
        ("vector_norm_cols", lambda: outer_norms(g, 1)),
    ]:
        row[name + "_ms"] = do_bench(fn, warmup=25, rep=100)
    print(row, flush=True)
    res.append(row)
json.dump(res, open(f"{out}/norms.json", "w"), indent=1)
