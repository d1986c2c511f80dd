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
padded to the longest, and in groups of sequences (a :class:`Span`) where one chunk of all
of them would exceed the segment's size. States are handed over in that order (``sort_states``,
``unsort_states``).
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections import OrderedDict
from typing import NamedTuple, Optional, Sequence

import torch

from torch_gdr.ops.torch.utils import L2NORM_EPS, compute_dtype_for

Tensor = torch.Tensor

# Matrices per batched matmul a segment aims at: large enough for efficient bmm, small
# enough that a segment's temporaries stay a few MiB (in cache) on a CPU. Forward and
# backward must segment a call alike (the backward reads the forward's state blocks). The
# backward's workspace is ~0.6 MiB a matrix, so the smallest size that times as well as
# larger ones keeps its peak memory lowest (bench/RESULTS.md has the timings).
SEGMENT_MATRICES = 24
# On accelerators the bound is memory, not cache, and every segment costs dozens of kernel
# launches: a segment of this many matrices keeps temporaries at a few hundred MiB at
# C = 64, D = 128 while amortising the launches (bench/RESULTS.md, GPU section).
ACCELERATOR_SEGMENT_MATRICES = 2048


class Span(NamedTuple):
    """A segment: chunks ``[c0, c1)`` of the sequences ``[n0, n1)`` (layout order), all
    their value heads: ``(c1 - c0) x (n1 - n0) * HV`` chunk matrices."""

    c0: int
    c1: int
    n0: int
    n1: int

    @property
    def num(self) -> int:
        """The number of chunks, G."""
        return self.c1 - self.c0

    def matrices(self, num_v_heads: int) -> slice:
        """The span's matrices among the ``N * HV`` of the call (a state's rows)."""
        return slice(self.n0 * num_v_heads, self.n1 * num_v_heads)


def default_segment_matrices(device: torch.device) -> int:
    """Matrices per segment for ``device``: cache-sized on CPUs, memory-sized elsewhere."""
    return SEGMENT_MATRICES if device.type == "cpu" else ACCELERATOR_SEGMENT_MATRICES


class ChunkLayout:
    """How the tokens of one call map onto chunk-major segments.

    Args:
        v: the values ``[B, T, HV, V]`` (shape, device and dtype are read).
        offsets: the ``N + 1`` offsets of packed sequences (host ints), or None.
        chunk_size: C.
        segment_matrices: the number of (chunk, sequence, head) matrices a segment aims at;
            :func:`default_segment_matrices` of v's device when None.
    """

    def __init__(self, v: Tensor, offsets: Optional[Sequence[int]], chunk_size: int,
                 segment_matrices: Optional[int] = None) -> None:
        self.batch_size, self.seq_len, self.num_v_heads = v.shape[:3]
        self.chunk_size = chunk_size
        self.dtype = compute_dtype_for(v.dtype)
        self.device = v.device
        self.varlen = offsets is not None
        if not self.varlen:
            self.num_seqs = self.batch_size
            self.num_chunks = -(-self.seq_len // chunk_size)
            self.seq_chunks = [self.num_chunks] * self.num_seqs
        else:
            lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
            order = sorted(range(len(lengths)), key=lambda n: -lengths[n])  # stable: ties keep their order
            self.num_seqs = len(lengths)
            self.seq_chunks = [-(-lengths[n] // chunk_size) for n in order]
            self.num_chunks = self.seq_chunks[0] if self.num_seqs else 0

            def on_device(values: list[int]) -> Tensor:
                return torch.tensor(values, dtype=torch.int64, device=self.device)

            self.order = on_device(order)
            # sorted order
            self.lengths, self.starts = on_device([lengths[n] for n in order]), on_device([offsets[n] for n in order])
            self._gather_cache: dict[Span, tuple] = {}  # every span's gather indices, built once
            self._store_cache: dict[tuple[Span, int], tuple] = {}  # (span, heads) -> store indices
        self._cache_lock = threading.Lock()  # a layout is shared by calls on several threads
        self.num_matrices = self.num_seqs * self.num_v_heads  # NH
        if segment_matrices is None:
            segment_matrices = default_segment_matrices(self.device)
        # Segments: as many chunks as keep (chunks x active matrices) near segment_matrices.
        # With varlen the active sequences thin out along the chunks, and so segments
        # lengthen; where one chunk of every active sequence is more than twice that, the
        # chunk is split into groups of sequences, so that scratch memory never follows N.
        hv = self.num_v_heads
        self._segments: list[Span] = []
        c0 = 0
        while c0 < self.num_chunks:
            active = self.active(c0)
            if active * hv <= 2 * segment_matrices:
                c1 = min(self.num_chunks, c0 + max(1, segment_matrices // (active * hv)))
                self._segments.append(Span(c0, c1, 0, active))
            else:
                c1, group = c0 + 1, max(1, segment_matrices // hv)
                self._segments += [Span(c0, c1, n0, min(active, n0 + group)) for n0 in range(0, active, group)]
            c0 = c1
        self.segment_capacity = max((span.num * (span.n1 - span.n0) * hv for span in self._segments),
                                    default=1)  # matrices, at most

    def active(self, c0: int) -> int:
        """The number of sequences that still have tokens in chunk ``c0`` (a prefix: the
        chunk counts are in decreasing order)."""
        return bisect.bisect_left(self.seq_chunks, -c0, key=operator.neg)

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

    def segments(self) -> list[Span]:
        """The spans covering every chunk of every sequence, in chunk order (spans of the
        same chunks, different sequences, are independent)."""
        return list(self._segments)

    def _gather_index(self, span: Span) -> tuple[Tensor, Tensor]:
        """Varlen, the ``n = n1 - n0`` sequences of ``span``, ``L = (c1 - c0) * C`` positions
        each:

        - ``index [n * L]``: the token at every position; past a sequence's end, the
          sequence's own last token (so that what is gathered there, zeroed by ``keep``,
          can never carry another sequence's NaN or inf into this one);
        - ``keep [n, L, 1]``: 1 at real tokens, 0 past the end, in the compute dtype.

        Built once per span and kept with the layout (O(tokens) in all, however long the
        longest sequence), for the loads of every segment, the backward's and other layers'
        (see :func:`layout_for_call`)."""
        with self._cache_lock:
            cached = self._gather_cache.get(span)
        if cached is not None:
            return cached
        c = self.chunk_size
        positions = torch.arange(span.c0 * c, span.c1 * c, device=self.device)
        lengths, starts = self.lengths[span.n0:span.n1, None], self.starts[span.n0:span.n1, None]
        valid = positions[None, :] < lengths
        index = (starts + torch.minimum(positions[None, :], lengths - 1)).flatten()
        result = (index, valid.unsqueeze(-1).to(self.dtype))
        with self._cache_lock:
            return self._gather_cache.setdefault(span, result)

    def _store_index(self, span: Span, heads: int) -> tuple[Tensor, Tensor]:
        """Varlen stores of ``span`` into a tensor of ``heads`` heads: ``(src_rows, dst_rows)``,
        the rows of the real tokens in ``[G, n, heads, C]`` order (the flattened source) and
        their rows ``token * heads + head`` in the flattened destination ``[T * heads]``."""
        with self._cache_lock:
            cached = self._store_cache.get((span, heads))
        if cached is not None:
            return cached
        g, n, c = span.num, span.n1 - span.n0, self.chunk_size
        positions = torch.arange(span.c0 * c, span.c1 * c, device=self.device).view(g, 1, 1, c)
        lengths, starts = self.lengths[span.n0:span.n1].view(1, n, 1, 1), self.starts[span.n0:span.n1].view(1, n, 1, 1)
        head = torch.arange(heads, device=self.device).view(1, 1, heads, 1)
        rows = ((starts + positions) * heads + head).flatten()  # [G * n * heads * C]
        src_rows = (positions < lengths).expand(g, n, heads, c).flatten().nonzero().squeeze(1)
        result = (src_rows, rows[src_rows])
        with self._cache_lock:
            return self._store_cache.setdefault((span, heads), result)

    def _token_span(self, c0: int, c1: int) -> tuple[int, int]:
        c = self.chunk_size
        return c0 * c, min(c1 * c, self.seq_len)

    def load(self, x: Tensor, span: Span, out: Optional[Tensor] = None,
             rnorm_out: Optional[Tensor] = None) -> Tensor:
        """The chunks and sequences of ``span`` from ``x [B, T, Hx, *D]`` (``Hx`` divides
        HV) as a new (or the given) tensor ``[G, n * HV, C, *D]`` (``G = c1 - c0``, ``n =
        n1 - n0``) in the compute dtype, zeros in the padding.

        With ``rnorm_out [G, n * HV, C, 1]``, the rows (last dim) are
        l2-normalised on the way in, ``x / sqrt(|x|^2 + eps)``, in the same single pass over
        the destination, and their factors ``1 / sqrt(|x|^2 + eps)`` are written to
        ``rnorm_out``."""
        g, n, c, hv = span.num, span.n1 - span.n0, self.chunk_size, self.num_v_heads
        if out is None:
            out = torch.empty((g, n * hv, c) + tuple(x.shape[3:]), dtype=self.dtype, device=x.device)
        keep = None  # varlen: [N, L, 1], zeros past each sequence's end
        if self.varlen:
            index, keep = self._gather_index(span)
            tokens = torch.index_select(x[0], 0, index).view((n, g * c) + tuple(x.shape[2:]))  # [N, G*C, Hx, *D]
            if tokens.dim() == 3:  # per-token scalars (g, beta): zero the padding in place
                tokens = tokens.mul_(keep)
                keep = None
            else:
                keep = keep.unsqueeze(-1)  # [N, L, 1, 1]
        else:
            t0, t1 = self._token_span(span.c0, span.c1)
            tokens = x[span.n0:span.n1, t0:t1]
        factor = keep
        if rnorm_out is not None:
            factor = torch.linalg.vector_norm(tokens, dim=-1, keepdim=True, dtype=self.dtype)
            factor = factor.square_().add_(L2NORM_EPS).rsqrt_()  # [N, L, Hx, 1]
            if keep is not None:
                factor.mul_(keep)
            self._place(factor, g, n, rnorm_out)
        self._place(tokens, g, n, out, factor)
        return out

    def _place(self, tokens: Tensor, g: int, n: int, out: Tensor, factor: Optional[Tensor] = None) -> None:
        """Write ``tokens [N, L, Hx, *D]`` (``L <= G * C`` tokens from the start of chunk
        ``c0``; times ``factor [N, L, Hx, 1]`` when given) into ``out [G, N * HV, C, *D]``,
        repeating each q/k head over its value heads and zeroing the padding."""
        c, hv = self.chunk_size, self.num_v_heads
        heads = tokens.shape[2]
        dst = out.unflatten(1, (n, heads, hv // heads))
        length = tokens.shape[1]
        if length < g * c:  # the tail chunk: zero its padding
            dst[-1].zero_()

        def put(dst_part: Tensor, src_of) -> None:
            src = src_of(tokens)
            if factor is None:
                dst_part.copy_(src.expand(dst_part.shape))
            else:
                torch.mul(src.expand(dst_part.shape), src_of(factor), out=dst_part)

        full = (length // c) * c
        if full:  # whole chunks: [N, F*C, Hx, *D] -> [F, N, Hx, 1, C, *D]
            put(dst[: full // c],
                lambda x: x[:, :full].unflatten(1, (-1, c)).movedim(1, 0).movedim(2, 3).unsqueeze(3))
        if full < length:  # a partial tail chunk (batched, no cu_seqlens)
            put(dst[-1, :, :, :, : length - full], lambda x: x[:, full:].movedim(1, 2).unsqueeze(2))

    def store(self, dst: Tensor, src: Tensor, span: Span) -> None:
        """Write ``src [G, n * HV, C, *D]`` into the chunks and sequences of ``span`` in
        ``dst [B, T, Hx, *D]``; with ``Hx < HV`` the value heads of a group are summed onto
        their q/k head."""
        g, n, c, hv = span.num, span.n1 - span.n0, self.chunk_size, self.num_v_heads
        heads, rest = dst.shape[2], tuple(src.shape[3:])
        src = src.unflatten(1, (n, heads, hv // heads))
        src = src.sum(3) if hv != heads else src.squeeze(3)  # [G, N, Hx, C, *D]
        if self.varlen:  # the real rows of src, gathered once, into their rows of dst
            src_rows, dst_rows = self._store_index(span, heads)
            rows = src.reshape((-1,) + rest).index_select(0, src_rows)
            dst.view((-1,) + rest).index_copy_(0, dst_rows, rows.to(dst.dtype))
            return
        chunked = src.permute((1, 0, 3, 2) + tuple(range(4, src.dim())))  # [N, G, C, Hx, *D], a view
        t0, t1 = self._token_span(span.c0, span.c1)
        full = (t1 - t0) // c  # whole chunks: one strided copy, no intermediate
        rows = dst[span.n0:span.n1]
        if full:
            rows[:, t0:t0 + full * c].unflatten(1, (full, c)).copy_(chunked[:, :full])
        if t0 + full * c < t1:
            rows[:, t0 + full * c:t1].copy_(chunked[:, full, : t1 - t0 - full * c])


# Varlen layouts kept for the most recent packings: a call's backward, and every layer of a
# model, see the same cu_seqlens, and would otherwise sort the sequences, plan the segments
# and build every segment's gather indices again. Calls on several threads share it.
SHARED_LAYOUTS = 8
_SHARED: "OrderedDict[tuple, ChunkLayout]" = OrderedDict()
_SHARED_LOCK = threading.Lock()


def layout_for_call(v: Tensor, offsets: Optional[Sequence[int]], chunk_size: int) -> ChunkLayout:
    """The :class:`ChunkLayout` of a call (segments of :func:`default_segment_matrices`).
    With varlen ``offsets`` (the host values of ``cu_seqlens``) it is shared with earlier
    calls of the same packing, shapes, chunk size, device and compute dtype (the last
    :data:`SHARED_LAYOUTS` packings)."""
    if offsets is None:
        return ChunkLayout(v, None, chunk_size)
    segment_matrices = default_segment_matrices(v.device)
    key = (tuple(offsets), tuple(v.shape[:3]), chunk_size, v.device, compute_dtype_for(v.dtype), segment_matrices)
    with _SHARED_LOCK:
        layout = _SHARED.get(key)
        if layout is not None:
            _SHARED.move_to_end(key)
            return layout
    layout = ChunkLayout(v, offsets, chunk_size, segment_matrices)  # outside the lock: it allocates
    with _SHARED_LOCK:
        layout = _SHARED.setdefault(key, layout)
        _SHARED.move_to_end(key)
        while len(_SHARED) > SHARED_LAYOUTS:
            _SHARED.popitem(last=False)
    return layout
