"""Moving tokens between the call's ``[B, T, H, ...]`` tensors and chunk-major segments.

The chunked algorithm works on ``[G, N * HV, C, ...]`` tensors: ``G`` consecutive chunks
(a *segment*) of all ``N`` sequences and ``HV`` value heads. Working a segment at a time
keeps every temporary O(segment) instead of O(T) and keeps the batched matmuls large
(``G * N * HV`` matrices each). Every sequence starts a fresh chunk and is zero-padded to
``NC`` chunks (zero padding, k = v = beta = g = 0, leaves outputs and states exact).
Query/key heads are repeated over their group of value heads on the way in; gradients of
a group are summed onto its query/key head on the way out.

Varlen: the sequences are ordered by decreasing length, so that the sequences still
running at chunk ``c`` are a prefix; a segment computes on that prefix only
(``active(c0)`` sequences, ``active(c0) * HV`` matrices) instead of on every sequence
padded to the longest. States are handed over in that order (``sort_states``,
``unsort_states``).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from torch_gdr.ref.utils import compute_dtype_for

Tensor = torch.Tensor

# Matrices per batched matmul a segment aims at: large enough for efficient bmm, small
# enough that a segment's temporaries stay a few MiB (in cache) on a CPU.
SEGMENT_MATRICES = 24
# On accelerators the bound is memory, not cache, and every segment costs dozens of kernel
# launches: a segment of this many matrices keeps temporaries at a few hundred MiB at
# C = 64, D = 128 (measured on an H200: 24 matrices a segment spent ~2 ms a chunk in
# launches at 32 heads).
ACCELERATOR_SEGMENT_MATRICES = 2048


def default_segment_matrices(device: torch.device) -> int:
    """Matrices per segment for ``device``: cache-sized on CPUs, memory-sized elsewhere."""
    return SEGMENT_MATRICES if device.type == "cpu" else ACCELERATOR_SEGMENT_MATRICES


class ChunkLayout:
    """How the tokens of one call map onto chunk-major segments.

    Args:
        v: the values ``[B, T, HV, V]`` (shape, device and dtype are read).
        cu_seqlens: ``[N + 1]`` int64 offsets on v's device, or None.
        chunk_size: C.
        segment_matrices: the number of (chunk, sequence, head) matrices a segment aims at;
            :func:`default_segment_matrices` of v's device when None.
    """

    def __init__(self, v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int,
                 segment_matrices: Optional[int] = None) -> None:
        self.batch_size, self.seq_len, self.num_v_heads = v.shape[:3]
        self.chunk_size = chunk_size
        self.dtype = compute_dtype_for(v.dtype)
        self.device = v.device
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.num_seqs = self.batch_size
            self.num_chunks = -(-self.seq_len // chunk_size)
            self.seq_chunks = [self.num_chunks] * self.num_seqs
        else:
            offsets = cu_seqlens.to(device=v.device, dtype=torch.int64)
            lengths = offsets[1:] - offsets[:-1]
            self.num_seqs = lengths.shape[0]
            self.order = torch.argsort(lengths, descending=True, stable=True)
            lengths, starts = lengths[self.order], offsets[:-1][self.order]
            self.seq_chunks = ((lengths + chunk_size - 1) // chunk_size).tolist()
            self.num_chunks = self.seq_chunks[0] if self.num_seqs else 0
            positions = torch.arange(self.num_chunks * chunk_size, device=v.device)
            self.valid = positions[None, :] < lengths[:, None]  # [N, NC * C], sorted order
            self.token_index = torch.where(self.valid, starts[:, None] + positions[None, :], 0)
        self.num_matrices = self.num_seqs * self.num_v_heads  # NH
        if segment_matrices is None:
            segment_matrices = default_segment_matrices(self.device)
        self.segment = max(1, segment_matrices // max(1, self.num_matrices))

    def active(self, c0: int) -> int:
        """The number of sequences that still have tokens in chunk ``c0`` (a prefix)."""
        return sum(1 for n in self.seq_chunks if n > c0)

    def sort_states(self, x: Tensor) -> Tensor:
        """``[N, ...]`` per-sequence tensor in the layout's order of sequences."""
        return x[self.order] if self.varlen else x

    def unsort_states(self, x: Tensor) -> Tensor:
        """Inverse of :meth:`sort_states`."""
        if not self.varlen:
            return x
        out = torch.empty_like(x)
        out[self.order] = x
        return out

    def segments(self, reverse: bool = False) -> Iterator[tuple[int, int]]:
        """Chunk ranges ``[c0, c1)`` covering ``[0, NC)``."""
        starts = list(range(0, self.num_chunks, self.segment))
        for c0 in (reversed(starts) if reverse else starts):
            yield c0, min(c0 + self.segment, self.num_chunks)

    def _token_span(self, c0: int, c1: int) -> tuple[int, int]:
        c = self.chunk_size
        return c0 * c, min(c1 * c, self.seq_len)

    def load(self, x: Tensor, c0: int, c1: int, out: Optional[Tensor] = None) -> Tensor:
        """Chunks ``[c0, c1)`` of ``x [B, T, Hx, *D]`` (``Hx`` divides HV) of the active
        sequences as a new (or the given) tensor ``[c1 - c0, active(c0) * HV, C, *D]`` in the
        compute dtype, zeros in the padding."""
        g, n, c, hv = c1 - c0, self.active(c0), self.chunk_size, self.num_v_heads
        heads, rest = x.shape[2], tuple(x.shape[3:])
        group = hv // heads
        if out is None:
            out = torch.empty((g, n * hv, c) + rest, dtype=self.dtype, device=x.device)
        dst = out.unflatten(1, (n, heads, group))
        if self.varlen:
            index = self.token_index[:n, c0 * c:c1 * c]
            valid = self.valid[:n, c0 * c:c1 * c]
            tokens = x[0][index]  # [N, G*C, Hx, *D]
            tokens = tokens.masked_fill_(~valid.view(valid.shape + (1,) * (tokens.dim() - 2)), 0)
        else:
            t0, t1 = self._token_span(c0, c1)
            tokens = x[:, t0:t1]
            if t1 - t0 < g * c:  # the tail chunk: zero its padding
                dst[-1].zero_()
        length = tokens.shape[1]
        src = tokens.unflatten(1, (-1, c)) if length == g * c else None
        if src is not None:
            dst.copy_(src.movedim(1, 0).movedim(2, 3).unsqueeze(3).expand(dst.shape))
        else:  # partial tail chunk (batched, no cu_seqlens)
            full = (length // c) * c
            if full:
                head = tokens[:, :full].unflatten(1, (-1, c)).movedim(1, 0).movedim(2, 3).unsqueeze(3)
                dst[: full // c].copy_(head.expand(dst[: full // c].shape))
            tail = tokens[:, full:].movedim(1, 2).unsqueeze(2)  # [N, Hx, 1, L, *D]
            dst[-1, :, :, :, : length - full].copy_(tail.expand(dst[-1, :, :, :, : length - full].shape))
        return out

    def store(self, dst: Tensor, src: Tensor, c0: int, c1: int) -> None:
        """Write ``src [c1 - c0, active(c0) * HV, C, *D]`` into chunks ``[c0, c1)`` of
        ``dst [B, T, Hx, *D]``; with ``Hx < HV`` the value heads of a group are summed onto
        their q/k head."""
        g, n, c, hv = c1 - c0, self.active(c0), self.chunk_size, self.num_v_heads
        heads, rest = dst.shape[2], tuple(src.shape[3:])
        src = src.unflatten(1, (n, heads, hv // heads))
        src = src.sum(3) if hv != heads else src.squeeze(3)  # [G, N, Hx, C, *D]
        chunked = src.permute((1, 0, 3, 2) + tuple(range(4, src.dim())))  # [N, G, C, Hx, *D], a view
        if self.varlen:
            index = self.token_index[:n, c0 * c:c1 * c]
            valid = self.valid[:n, c0 * c:c1 * c]
            tokens = chunked.reshape((n, g * c, heads) + rest)
            dst[0].index_copy_(0, index[valid], tokens[valid].to(dst.dtype))
            return
        t0, t1 = self._token_span(c0, c1)
        full = (t1 - t0) // c  # whole chunks: one strided copy, no intermediate
        if full:
            dst[:, t0:t0 + full * c].unflatten(1, (full, c)).copy_(chunked[:, :full])
        if t0 + full * c < t1:
            dst[:, t0 + full * c:t1].copy_(chunked[:, full, : t1 - t0 - full * c])
