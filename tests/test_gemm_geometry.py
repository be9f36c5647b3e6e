"""The table of the layer's GEMM geometry (adahop.gemm_geometry) against the GEMMs themselves."""

import pytest
import torch

from adahop.gemm_geometry import GEMMS, GEOMETRY, GemmGeometry, Operand, oe_outer_size
from adahop.policy import GEMM_OPERANDS

T, N, K = 5, 3, 4
DIMS = {"T": T, "N": N, "K": K}


def test_each_gemm_computes_its_output_from_its_operands():
    """Feeding A and B as the table says (a tensor transposed where the table says so) gives the
    layer's y = x w^T, dx = g w and dw = g^T x; contraction and outer dims are the tensors' sizes."""
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((T, K), (N, K), (T, N)))
    tensors = {"x": x, "w": w, "g": g}
    want = {"y": x @ w.t(), "dx": g @ w, "dw": g.t() @ x}
    assert GEMMS == ("fprop", "dgrad", "wgrad")
    for name, gm in GEOMETRY.items():
        a = tensors[gm.a.role].t() if gm.a_transposed else tensors[gm.a.role]
        b = tensors[gm.b.role].t() if gm.b_transposed else tensors[gm.b.role]
        torch.testing.assert_close(a @ b, want[gm.output], rtol=0, atol=1e-12)
        assert a.shape[1] == b.shape[0] == DIMS[gm.contraction], name
        # the dim an operand is quantized along is its tensor's contracted dim
        assert tensors[gm.a.role].shape[gm.a.dim] == tensors[gm.b.role].shape[gm.b.dim] == DIMS[gm.contraction]
        # OE-left selects rows of A, OE-right columns of B
        assert oe_outer_size(name, "iht+oe_left", DIMS) == a.shape[0]
        assert oe_outer_size(name, "iht+oe_right", DIMS) == b.shape[1]
        for mode in ("bf16", "mxfp4", "iht"):
            assert oe_outer_size(name, mode, DIMS) is None


def test_policy_reads_the_table():
    assert GEMM_OPERANDS == {"fprop": (("x", 1), ("w", 1)), "dgrad": (("g", 1), ("w", 0)),
                             "wgrad": (("g", 0), ("x", 0))}


def test_operands_must_share_the_contraction():
    with pytest.raises(ValueError, match="contracted along K and T"):
        GemmGeometry("bad", "y", a=Operand("x", 1), b=Operand("x", 0))
