"""The blocked unit-lower-triangular inverse against a dense inverse."""

from __future__ import annotations

import pytest
import torch

from torch_gdr.ops.torch.triangular import unit_lower_inverse


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("negated", [False, True], ids=["a", "minus_a"])
def test_inverse_matches_dense_inverse(size: int, negated: bool) -> None:
    generator = torch.Generator().manual_seed(size)
    a = torch.randn(3, 2, size, size, dtype=torch.float64, generator=generator) * 0.3
    expected = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + a.tril(-1))
    # Entries on and above the diagonal of the argument must be ignored.
    result = unit_lower_inverse(-a if negated else a, negated=negated)
    assert result.shape == a.shape and result.is_contiguous()
    torch.testing.assert_close(result, expected, atol=1e-10, rtol=1e-10)


def test_out_buffer_is_written_below_and_on_the_diagonal_only() -> None:
    a = torch.randn(5, 64, 64, dtype=torch.float64) * 0.3
    expected = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + a.tril(-1))
    # A reused buffer: zeros above the diagonal, garbage on and below it.
    out = torch.full_like(a, float("nan")).tril()
    result = unit_lower_inverse(a, out=out, out_is_unit=True)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(result, expected, atol=1e-10, rtol=1e-10)
    # A fresh buffer full of garbage is cleared when out_is_unit is False.
    out = torch.full_like(a, float("nan"))
    torch.testing.assert_close(unit_lower_inverse(a, out=out), expected, atol=1e-10, rtol=1e-10)


def test_rejects_sizes_that_are_not_powers_of_two() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        unit_lower_inverse(torch.zeros(2, 48, 48))
