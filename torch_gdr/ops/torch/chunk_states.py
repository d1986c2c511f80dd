"""The state entering every chunk, stored segment by segment.

Segment ``i`` of a :class:`~torch_gdr.ops.torch.chunk_layout.ChunkLayout` (a
:class:`~torch_gdr.ops.torch.chunk_layout.Span`: chunks ``[c0, c1)`` of sequences ``[n0, n1)``,
``nh_i = (n1 - n0) * HV`` matrices) has a *block*: the states entering its chunks,
``[c1 - c0, nh_i, K, V]``, contiguous. Blocks are what the state scan writes and what the
backward reads, so that no state is ever gathered or scattered, and they hold only the
matrices their segment computes: with varlen the states of sequences that have ended are
not stored, so memory follows the tokens of the call, not ``number of sequences x longest
sequence`` (a dense ``[NC + 1, N * HV, K, V]`` buffer would be gigabytes for one long
document packed with many short ones).

Between segments, every sequence's latest state lives in ``current [N * HV, K, V]``: a
segment starts from its sequences' rows there (slot 0 of its block) and writes the state
leaving it back. Once the last segment has run, ``current`` holds every final state (a
sequence's state does not change over the zero padding after its end).
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.ops.torch.chunk_layout import ChunkLayout

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
            layout (as saved by the forward): its blocks are read as they are, and neither
            :meth:`scan_slots` nor :meth:`hand_over` may be called.
    """

    def __init__(self, layout: ChunkLayout, initial_state: Optional[Tensor], head_k_dim: int, head_v_dim: int,
                 keep: bool, storage: Optional[Tensor] = None) -> None:
        self.segments = layout.segments()
        hv = layout.num_v_heads
        self.rows = [span.matrices(hv) for span in self.segments]
        sizes = [span.num * (span.n1 - span.n0) * hv for span in self.segments]
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
            return
        self.storage = torch.empty((total,) + shape, **options)
        if initial_state is None:
            self.current = torch.zeros((layout.num_matrices,) + shape, **options)
        else:
            self.current = layout.sort_states(initial_state).reshape((layout.num_matrices,) + shape).to(
                **options, copy=True)
        self.leaving = torch.empty((max((r.stop - r.start for r in self.rows), default=0),) + shape, **options)

    @property
    def final(self) -> Tensor:
        """``[N * HV, K, V]``: every sequence's final state, once every segment has run."""
        return self.current

    def block(self, i: int) -> Tensor:
        """``[c1 - c0, nh_i, K, V]``: the states entering the chunks of segment ``i``."""
        span, offset = self.segments[i], self.offsets[i]
        nh = self.rows[i].stop - self.rows[i].start
        return self.storage[offset:offset + span.num * nh].view((span.num, nh) + self.storage.shape[1:])

    def scan_slots(self, i: int) -> list[Tensor]:
        """The ``G + 1`` per-chunk state views the scan of segment ``i`` reads and writes:
        the block's slots (slot 0 filled from ``current``), then a scratch slot for the
        state leaving the segment."""
        block = self.block(i)
        block[0].copy_(self.current[self.rows[i]])
        return list(block.unbind(0)) + [self.leaving[:block.shape[1]]]

    def hand_over(self, i: int) -> None:
        """After the scan of segment ``i``: its sequences' latest states into ``current``."""
        rows = self.rows[i]
        self.current[rows].copy_(self.leaving[:rows.stop - rows.start])
