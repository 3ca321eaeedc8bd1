"""The exact k-th largest |x| per row (the TIES threshold), against ``torch.kthvalue``."""

import pytest
import torch

from pipeline.merge.selection import kth_largest_abs


def reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """torch's own selection: the (n − k + 1)-th smallest |x| is the k-th largest."""
    return x.abs().kthvalue(x.shape[1] - k + 1, dim=1).values


@pytest.mark.parametrize("n", [1, 17, 4096])
def test_small_rows_select_like_torch(n):
    x = torch.randn(4, n, generator=torch.Generator().manual_seed(n))
    for k in {1, (n + 1) // 2, n}:
        assert torch.equal(kth_largest_abs(x, k), reference(x, k))


def test_column_blocks_give_the_value_of_the_whole():
    """A block too large to hold is read column block by column block (the radix select)."""
    x = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(5))
    blocks = lambda: x.split(7_000, dim=1)
    for k in (1, 2_500, 49_999):
        assert torch.equal(kth_largest_abs(blocks, k, x.shape[1]), reference(x, k))


def test_other_dtypes_are_refused():
    with pytest.raises(TypeError, match="float32"):
        kth_largest_abs(lambda: [torch.ones(2, 8, dtype=torch.float64)], 1, 8)


@pytest.mark.parametrize("n", [300_000, 1_500_000])  # a 3B model's k_proj has 2^19 entries
def test_kth_largest_abs_is_exact_on_large_tensors(n):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(1))
    x[0, :1000] = 0.0
    x[1, : n // 2] = 0.25  # many equal values
    for k in (1, 7, n * 2 // 5, n - 1_000, n):
        assert torch.equal(kth_largest_abs(x, k), reference(x, k))


def test_kth_largest_abs_is_exact_when_the_sample_misleads():
    """The threshold is bracketed from a strided sample; a sample unlike the rest (here every
    sampled entry is huge) misses the bracket, and the radix select still finds the exact value."""
    x = torch.rand(2, 1_500_000, generator=torch.Generator().manual_seed(3))
    x[:, :: 1_500_000 // (1 << 16)] = 1e6
    for k in (10, 300_000):
        assert torch.equal(kth_largest_abs(x, k), reference(x, k))
    frozen = torch.zeros(2, 1_500_000)  # one value throughout: the radix select, not a copy of the block
    assert torch.equal(kth_largest_abs(frozen, 300_000), torch.zeros(2))
