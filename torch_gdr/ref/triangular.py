"""``(I + A)^-1`` for a batch of strictly lower triangular ``A`` by blocked matmuls.

The inverse ``T`` of a unit lower triangular matrix is built bottom-up: once the diagonal
blocks of size ``b`` are inverted, each pair of neighbours merges into an inverted block of
size ``2b`` by the 2x2 block formula::

    [[L11, 0], [L21, L22]]^-1 = [[T11, 0], [-T22 L21 T11, T22]]

(``L21 = A21``, the off-diagonal block is the same in ``L = I + A`` and ``A``). Every level
is two batched matmuls over all diagonal blocks of all matrices at once, so a ``C x C``
inverse takes ``log2(C)`` levels and no row-by-row loop, and costs about ``C^3 / 3`` flops.
The merges write the new blocks in place into ``T``; no right-hand side is copied.
"""

from __future__ import annotations

import torch


def _diagonal_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """View ``x [M, C, C]`` as its ``C / (2 block)`` diagonal blocks of size ``2 block``, each
    split 2x2: ``[M, P, 2, block, 2, block]`` (a view: writes go into ``x``)."""
    m, c, _ = x.shape
    pairs = c // (2 * block)
    grid = x.view(m, pairs, 2, block, pairs, 2, block)
    return torch.diagonal(grid, dim1=1, dim2=4).movedim(-1, 1)


def unit_lower_inverse(a: torch.Tensor, out: torch.Tensor | None = None, *, negated: bool = False,
                       out_is_unit: bool = False) -> torch.Tensor:
    """``(I + a)^-1`` for ``a [..., C, C]`` strictly lower triangular (entries on and above
    the diagonal are ignored), ``C`` a power of two. Returns a contiguous tensor (``out``
    when given, contiguous and of a's shape), unit lower triangular, zeros above the diagonal.

    ``negated``: ``a`` holds ``-A`` (the result is ``(I - a)^-1``); the merges then need no
    negation pass. ``out_is_unit``: ``out`` already holds ones on its diagonal and zeros
    above it (e.g. a buffer reused from an earlier call: the merges write every strictly
    lower entry and nothing else), so it is not re-initialised."""
    *batch, c, c2 = a.shape
    if c != c2 or c & (c - 1):
        raise ValueError(f"unit_lower_inverse: expected square blocks with a power-of-two size, got {c}x{c2}")
    a3 = a.reshape(-1, c, c)
    if out is None:
        inv = torch.zeros_like(a3)
        out_is_unit = False
    else:
        inv = out.view(-1, c, c)
    if not out_is_unit:
        inv.zero_().diagonal(dim1=-2, dim2=-1).fill_(1)
    if c > 1:
        # Level 1: blocks of size 1 are 1, so T21 = -A21 for the pairs (2p+1, 2p).
        t21 = _diagonal_blocks(inv, 1)[:, :, 1, :, 0, :].copy_(_diagonal_blocks(a3, 1)[:, :, 1, :, 0, :])
        if not negated:
            t21.neg_()
    block = 2
    while block < c:
        t_blocks = _diagonal_blocks(inv, block)
        a21 = _diagonal_blocks(a3, block)[:, :, 1, :, 0, :]
        t11, t22 = t_blocks[:, :, 0, :, 0, :], t_blocks[:, :, 1, :, 1, :]
        t21 = torch.matmul(torch.matmul(t22, a21), t11)
        t_blocks[:, :, 1, :, 0, :].copy_(t21)
        if not negated:
            t_blocks[:, :, 1, :, 0, :].neg_()
        block *= 2
    return inv.view(*batch, c, c)
