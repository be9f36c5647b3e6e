"""The top-k selection kernel of outlier extraction (kernels.topk) against the reference rule
(ops.outliers.largest_k): the same indices, ties and special values included. On the CPU through
TRITON_INTERPRET=1 (conftest.py)."""

import pytest
import torch

pytest.importorskip("triton")

import adahop.kernels.topk as topk_module  # noqa: E402
from adahop.kernels.topk import topk_indices  # noqa: E402
from adahop.ops.outliers import largest_k, topk_outer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k", [(1, 1), (5, 3), (100, 7), (1000, 64), (4096, 64), (3000, 3000), (50, 80),
                                 (20000, 16), (40000, 16)])
def test_equals_reference_on_random_values(n, k):
    v = torch.randn(n, generator=torch.Generator().manual_seed(n + k)).to(DEVICE)
    got = topk_indices(v, k)
    assert got.dtype == torch.int64 and got.shape == (min(n, k),)
    assert torch.equal(got, largest_k(v, k))
    assert torch.equal(got.sort().values, got)  # sorted


def test_ties_and_special_values():
    """NaN ranks above +inf; ties at the k-th value go to the lower index; -0 and 0 tie."""
    v = torch.tensor([1.0, 3.0, 3.0, float("nan"), -2.0, 3.0, float("inf"), 0.0, -0.0, 3.0, float("-inf")],
                     device=DEVICE)
    for k in range(0, v.numel() + 2):
        assert torch.equal(topk_indices(v, k), largest_k(v, k)), k
    assert topk_indices(v, 2).tolist() == [3, 6]
    assert topk_indices(v, 4).tolist() == [1, 2, 3, 6]  # of the four 3.0s, the first two


def test_many_ties_across_chunks(monkeypatch):
    """Inputs longer than one block (re-read per pass): the same rule across block boundaries."""
    monkeypatch.setattr(topk_module, "MAX_BLOCK", 128)
    v = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    v[::7] = 0.5  # 143 equal values spread over all 8 blocks
    v = v.to(DEVICE)
    for k in (1, 64, 200, 1000):
        assert torch.equal(topk_indices(v, k), largest_k(v, k)), k


def test_empty_and_bad_input():
    assert topk_indices(torch.empty(0, device=DEVICE), 4).numel() == 0
    assert topk_indices(torch.ones(5, device=DEVICE), 0).numel() == 0
    with pytest.raises(ValueError, match="1-D float32"):
        topk_indices(torch.ones(5, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="1-D float32"):
        topk_indices(torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match="non-negative int"):
        topk_indices(torch.ones(5), -1)


def test_backend_selection_equals_reference():
    """The Triton backends' ``select_outer`` picks the reference's slices (same norms)."""
    from adahop.ops.backends.triton import TritonBackend

    t = torch.randn(300, 70, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    t[17] *= 50
    t[:, 5] *= 40
    for dim in (0, 1):
        got = TritonBackend.select_outer(t, dim, 8)
        assert torch.equal(got, topk_outer(t, dim, 8))
    assert 17 in TritonBackend.select_outer(t, 0, 8).tolist()
    assert 5 in TritonBackend.select_outer(t, 1, 8).tolist()
