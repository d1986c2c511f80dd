"""The state entering every chunk, stored segment by segment.

Segment ``i`` of a :class:`~torch_gdr.ref.chunk_layout.ChunkLayout` covers chunks
``[c0, c1)`` of its ``nh_i = active(c0) * HV`` active matrices; its *block* holds the states
entering those chunks, ``[c1 - c0, nh_i, K, V]``, contiguous. Blocks are what the state scan
writes and what the backward reads, so that no state is ever gathered or scattered, and
they hold only the matrices their segment computes: with varlen the states of sequences
that have ended are not stored, so memory follows the tokens of the call, not
``number of sequences x longest sequence`` (a dense ``[NC + 1, N * HV, K, V]`` buffer would
be gigabytes for one long document packed with many short ones).

The state leaving a segment goes through a scratch slot: the part of it that the next
segment continues becomes slot 0 of the next block, the rest (the sequences that ended)
is their final state.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.ref.chunk_layout import ChunkLayout

Tensor = torch.Tensor


class ChunkStates:
    """The chunk states of one call, in the layout's order of sequences.

    Args:
        layout: the call's layout; forward and backward must use equal layouts.
        initial_state: ``[N, HV, K, V]`` key-first in any float dtype, or None (zeros).
        head_k_dim, head_v_dim: K and V.
        keep: store every block (for a backward) in one buffer; otherwise every segment
            reuses one block-sized buffer, enough for a forward that only wants outputs.
        storage: the buffer of a ``keep`` instance from an earlier pass over the same
            layout (as saved by the forward): its blocks are used as they are.
    """

    def __init__(self, layout: ChunkLayout, initial_state: Optional[Tensor], head_k_dim: int, head_v_dim: int,
                 keep: bool, storage: Optional[Tensor] = None) -> None:
        self.layout = layout
        self.segments = layout.segments()
        hv = layout.num_v_heads
        self.widths = [layout.active(c0) * hv for c0, _ in self.segments]  # nh of each segment
        sizes = [(c1 - c0) * nh for (c0, c1), nh in zip(self.segments, self.widths)]
        if keep:
            self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            total = sum(sizes)
        else:
            self.offsets = [0] * len(sizes)
            total = max(sizes, default=0)
        shape = (head_k_dim, head_v_dim)
        options = dict(dtype=layout.dtype, device=layout.device)
        if storage is not None:
            expected = (total,) + shape
            if tuple(storage.shape) != expected:
                raise ValueError(f"chunk_states: expected shape {list(expected)} for this call's layout, "
                                 f"got {list(storage.shape)}")
            self.storage = storage
        else:
            self.storage = torch.empty((total,) + shape, **options)
        self.final = torch.empty((layout.num_matrices,) + shape, **options)
        self.leaving = torch.empty((max(self.widths, default=0),) + shape, **options)
        if storage is None:
            if initial_state is None:
                start = torch.zeros((layout.num_matrices,) + shape, **options)
            else:
                start = layout.sort_states(initial_state).reshape((layout.num_matrices,) + shape)
            first = self.widths[0] if self.widths else 0
            if first:
                self.block(0)[0].copy_(start[:first])
            self.final[first:].copy_(start[first:])  # sequences with no chunk at all

    def block(self, i: int) -> Tensor:
        """``[c1 - c0, nh_i, K, V]``: the states entering the chunks of segment ``i``."""
        (c0, c1), nh, offset = self.segments[i], self.widths[i], self.offsets[i]
        return self.storage[offset:offset + (c1 - c0) * nh].view((c1 - c0, nh) + self.storage.shape[1:])

    def scan_slots(self, i: int) -> list[Tensor]:
        """The ``G + 1`` per-chunk state views the scan of segment ``i`` reads and writes:
        the block's slots, then the scratch slot for the state leaving the segment."""
        return list(self.block(i).unbind(0)) + [self.leaving[:self.widths[i]]]

    def hand_over(self, i: int) -> None:
        """After the scan of segment ``i``: move the leaving state into slot 0 of the next
        block, and the states of the sequences that ended into ``final``."""
        nh = self.widths[i]
        following = self.widths[i + 1] if i + 1 < len(self.widths) else 0
        leaving = self.leaving[:nh]
        self.final[following:nh].copy_(leaving[following:])
        if following:
            self.block(i + 1)[0].copy_(leaving[:following])
