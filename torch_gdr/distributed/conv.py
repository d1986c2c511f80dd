"""Halo exchange for the short causal convolution under context parallelism.

A rank's first sequence, when it began on an earlier rank, needs the ``kernel_size - 1``
conv inputs before the rank's first token: the last inputs of the earlier ranks. Every rank
contributes its last ``kernel_size - 1`` inputs to one differentiable all-gather (zeros in
front when its slice is shorter), so the halo may come from several earlier ranks, and
the gradient of the halo flows back to the ranks that sent it.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.distributed.chunk import _zero_edge, check_context
from torch_gdr.distributed.collectives import all_gather_pieces
from torch_gdr.distributed.context import CPContext, _owner


def conv_halo_state(x: torch.Tensor, kernel_size: int, cp_context: CPContext) -> Optional[torch.Tensor]:
    """The conv initial state of this rank's local sequences, with the halo from earlier ranks.

    Args:
        x: ``[1, T_local, C]``, this rank's conv input (before the conv).
        kernel_size: the conv's kernel size K.
        cp_context: this rank's context.

    Returns:
        ``[N_local, C, K - 1]`` in x's dtype (oldest input first, the layout of
        :func:`torch_gdr.nn.causal_depthwise_conv1d`'s ``initial_state``): for a first
        sequence that began on an earlier rank, its ``K - 1`` inputs before this slice (zeros
        before the sequence's start); zeros for the other rows. None when no sequence crosses
        a rank boundary or ``K == 1`` (no collective is made then, on any rank).

    Communication: one all-gather of ``[K - 1, C]`` per rank: ``(R - 1) * (K - 1) * C``
    elements sent by each rank, the same back in the backward.
    """
    ctx = check_context(cp_context)
    hist = kernel_size - 1
    if not ctx.any_crossing or hist == 0:
        return None
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != ctx.num_tokens:
        raise ValueError(f"x: expected this rank's conv input [1, {ctx.num_tokens}, C], got shape {list(x.shape)}")
    channels = x.shape[-1]
    last = x[0, -hist:]
    if last.shape[0] < hist:
        last = torch.cat([last.new_zeros(hist - last.shape[0], channels), last])
    gathered = all_gather_pieces(last, ctx)  # [R, K - 1, C]
    rest = x.new_zeros(ctx.num_sequences - 1, channels, hist)
    if not ctx.head_continues:
        return torch.cat([_zero_edge(gathered, x.new_empty(1, channels, hist)), rest])
    bounds = ctx.slice_bounds
    start = bounds[ctx.rank]
    head_start = start - ctx.head_tokens_before
    table = torch.cat([gathered.reshape(-1, channels), x.new_zeros(1, channels)])
    zero_row = table.shape[0] - 1
    rows = []
    for position in range(start - hist, start):
        if position < head_start:
            rows.append(zero_row)
        else:
            source = _owner(position, bounds)
            rows.append(source * hist + hist - (bounds[source + 1] - position))
    head = table[torch.tensor(rows, device=x.device)].transpose(0, 1)  # [C, K - 1]
    return torch.cat([head.unsqueeze(0), rest])
