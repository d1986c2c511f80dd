"""``(I + A)^-1`` for a batch of strictly lower triangular ``A`` by blocked matmuls.

With ``N = -A`` and ``T = (I - N)^-1``, the matrix is cut into ``b x b`` blocks
(``b = 16``, or ``C`` when smaller):

1. The diagonal blocks are inverted all at once, as one batch of ``b x b`` matrices. ``N_ii``
   is nilpotent (``N_ii^b = 0``), so ``T_ii = sum_j N_ii^j``, which is the product
   ``(I + X)(I + X^2)(I + X^4) ... (I + X^(b/2))`` with ``X = N_ii``: ``log2(b) - 1``
   squarings and as many products, each one batched matmul.
2. The block rows below are filled top-down by block forward substitution: from
   ``(I - N) T = I``::

       T[i, :i] = T_ii (N[i, :i] T[:i, :i])

   two batched matmuls per block row, on strided views of the full matrices (no copy of
   any right-hand side).

A ``C x C`` inverse thus takes ``2 (log2(b) - 1) + 2 (C / b - 1)`` batched matmuls (12 at
``C = 64``), no row-by-row loop, and about ``C^3 / 3`` flops.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.ops.torch.utils import lower_mask

BLOCK = 16


def _diagonal_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """The diagonal ``block x block`` blocks of ``x [M, C, C]`` as a view ``[M, C / block,
    block, block]`` (writes go into ``x``)."""
    m, c, _ = x.shape
    nb = c // block
    return torch.diagonal(x.view(m, nb, block, nb, block), dim1=1, dim2=3).permute(0, 3, 1, 2)


def unit_lower_inverse(a: torch.Tensor, out: Optional[torch.Tensor] = None, *, negated: bool = False,
                       out_is_unit: bool = False) -> torch.Tensor:
    """``(I + a)^-1`` for ``a [..., C, C]`` strictly lower triangular (entries on and above
    the diagonal are ignored), ``C`` a power of two. Returns a contiguous tensor (``out``
    when given, contiguous and of a's shape), unit lower triangular, zeros above the diagonal.

    ``negated``: ``a`` holds ``-A`` (the result is ``(I - a)^-1``), which saves a negation.
    ``out_is_unit``: ``out`` already holds zeros above the diagonal (e.g. a buffer reused
    from an earlier call: every entry on and below the diagonal is written, nothing above),
    so it is not cleared first."""
    *batch, c, c2 = a.shape
    if c != c2 or c & (c - 1):
        raise ValueError(f"unit_lower_inverse: expected square blocks with a power-of-two size, got {c}x{c2}")
    a3 = a.reshape(-1, c, c)
    m = a3.shape[0]
    block = min(BLOCK, c)
    if out is None:
        inv = torch.zeros_like(a3)
    else:
        inv = out.view(-1, c, c)
        if not out_is_unit:
            inv.zero_()

    # 1. T_ii = (I + X)(I + X^2)(I + X^4)...,  X = N_ii (strictly lower), all blocks at once.
    strictly_lower = lower_mask(block, a3.device, a3.dtype, strict=True)
    if not negated:
        strictly_lower = -strictly_lower
    x = torch.mul(_diagonal_blocks(a3, block), strictly_lower).reshape(-1, block, block)  # a contiguous copy
    t_diag = x.clone()
    t_diag.diagonal(dim1=-2, dim2=-1).fill_(1)
    power, reach = x, 2  # reach: the number of terms of sum_j X^j that t_diag holds
    while reach < block:
        power = torch.bmm(power, power)
        t_diag = torch.baddbmm(t_diag, t_diag, power)
        reach *= 2
    _diagonal_blocks(inv, block).copy_(t_diag.view(m, c // block, block, block))

    # 2. T[i, :i] = T_ii (N[i, :i] T[:i, :i]), block row by block row.
    for i in range(1, c // block):
        rows, left = slice(i * block, (i + 1) * block), slice(0, i * block)
        partial = torch.bmm(a3[:, rows, left], inv[:, left, left])
        product = torch.bmm(inv[:, rows, rows], partial)
        inv[:, rows, left].copy_(product if negated else product.neg_())
    return inv.view(*batch, c, c)
