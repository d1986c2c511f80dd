"""The chunk-parallel primitives of the chunked algorithm, shared by its forward and backward.

A *segment* is ``G`` consecutive chunks of the sequences still running (chunk-major
``[G, NH, C, ...]``, see :mod:`torch_gdr.ops.torch.chunk_layout`). :func:`load_segment` gathers a
segment and computes everything in it that does not depend on the state entering a chunk
(:class:`Segment`); :func:`state_scan` is the recurrence across its chunks. The large
temporaries live in a :class:`Workspace` reused by every segment of a call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from torch_gdr.ops.torch.chunk_layout import ChunkLayout, Span
from torch_gdr.ops.torch.triangular import unit_lower_inverse
from torch_gdr.ops.torch.utils import lower_mask

Tensor = torch.Tensor


def batched(x: Tensor) -> Tensor:
    """``[G, NH, a, b]`` -> ``[G * NH, a, b]`` for one bmm over all chunk matrices."""
    return x.flatten(0, 1)


def bmm(a: Tensor, b: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``a @ b`` for chunk-major ``[G, NH, m, k] @ [G, NH, k, n]`` as one bmm."""
    shape = a.shape[:2] + (a.shape[2], b.shape[3])
    if out is None:
        return torch.bmm(batched(a), batched(b)).view(shape)
    torch.bmm(batched(a), batched(b), out=batched(out))
    return out


def pairwise_decay(g: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``Gamma [.., C, C]`` of the per-token log decays ``g [.., C]`` of a chunk:
    ``exp(sum of g over (s, r])`` on and below the diagonal, 0 above.

    The exponents are partial sums of ``g`` taken directly (a cumsum down each column of the
    strictly lower part), never the difference of two cumulative sums: with a token of
    ``g = -1e6`` in the chunk those would cancel (float32 keeps no digits of the small decays
    beside it), and with ``g = -inf`` (a reset) give ``-inf - (-inf) = nan``. Above the
    diagonal the exponent is 0 and the exp's ones are masked by a multiply afterwards."""
    c = g.shape[-1]
    strict = lower_mask(c, g.device, torch.bool, strict=True)  # [t, s]: t > s
    exponent = torch.where(strict, g[..., :, None], 0.0)  # [.., t, s]: g_t where t > s
    if out is not None:
        out.copy_(exponent)
        exponent = out
    exponent.cumsum_(-2)  # [.., r, s]: the sum of g_t over s < t <= r
    return exponent.exp_().mul_(lower_mask(c, g.device, g.dtype))


def decay_to_chunk_end(g: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """``exp(gamma_C - gamma_r) [.., C]``: the decay from token r to the chunk's end, from the
    sum of ``g`` over the tokens after r (a reverse cumsum), not a difference of cumsums."""
    after = torch.zeros_like(g) if out is None else out.zero_()
    after[..., :-1] = g[..., 1:].flip(-1).cumsum(-1).flip(-1)
    return after.exp_()


@dataclass
class Segment:
    """The parallel part of a span's chunks: everything but the state recurrence.

    Shapes are chunk-major ``[G, NH, ...]``; ``C`` tokens per chunk.
    """

    qk: Tensor  # [G, NH, 2C, K]: rows :C the query y_q, rows C: the key (both l2-normalised if asked)
    rnorm: Optional[Tensor]  # [G, NH, 2C, 1]: 1 / |x| of the l2norm, or None
    v: Tensor  # [G, NH, C, V]
    beta: Tensor  # [G, NH, C]
    gamma: Tensor  # [G, NH, C]: cumsum of g within the chunk
    gamma_exp: Tensor  # exp(gamma)
    decay: Tensor  # [G, NH, C, C]: Gamma
    sim: Tensor  # [G, NH, 2C, C]: rows :C P = scale (y_q K^T) * Gamma (without scale if not scale_attn), rows C: G = strictly_lower(K K^T * Gamma)
    inverse: Tensor  # [G, NH, C, C]: T = (I + diag(beta) G)^-1
    u: Tensor  # [G, NH, C, V]: U (the scan turns it into V' in place)
    w: Tensor  # [G, NH, C, K]: W
    k_scale: Tensor  # [G, NH, C]: exp(gamma_C - gamma)
    k_decayed: Tensor  # [G, NH, C, K]: exp(gamma_C - gamma) * K

    @property
    def size(self) -> int:
        return self.qk.shape[2] // 2

    @property
    def query(self) -> Tensor:
        return self.qk[:, :, : self.size]

    @property
    def key(self) -> Tensor:
        return self.qk[:, :, self.size:]

    @property
    def attn(self) -> Tensor:
        return self.sim[:, :, : self.size]

    @property
    def gram(self) -> Tensor:
        return self.sim[:, :, self.size:]

    @property
    def chunk_decay(self) -> Tensor:
        """``exp(gamma_C) [G, NH, 1, 1]``, the decay of the state over a whole chunk."""
        return self.gamma_exp[..., -1:, None]


class Workspace:
    """Named scratch buffers ``[num, nh, ...]`` reused by every segment of a call.

    A fresh buffer costs a page fault per 4 KiB on first touch, which on small machines
    (and VMs) costs as much as the arithmetic done on it. Each name owns one flat buffer
    sized for a full segment; a request gets a contiguous view of its prefix, for ``num``
    chunks of the ``nh`` active matrices set by :meth:`activate`.
    """

    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout
        self.nh = layout.num_matrices
        self.buffers: dict[str, Tensor] = {}

    def activate(self, span: Span) -> int:
        """Size the next requests for ``span``; returns its number of matrices, nh."""
        self.nh = (span.n1 - span.n0) * self.layout.num_v_heads
        return self.nh

    def __call__(self, name: str, num: int, *inner: int) -> Tensor:
        shape = (num, self.nh) + tuple(inner)
        need = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < need:
            full = max(need, self.layout.segment_capacity * math.prod(inner))
            buf = torch.empty(full, dtype=self.layout.dtype, device=self.layout.device)
            self.buffers[name] = buf
        return buf[:need].view(shape)

    def unit_lower(self, name: str, num: int, c: int) -> Tensor:
        """Like ``self(name, num, c, c)``, for :func:`unit_lower_inverse` outputs only (its
        ``out_is_unit``): the buffer is zeroed once when allocated, and the inverse writes
        only on and below the diagonal of each ``C x C`` slot, so zeros stay above it."""
        buf = self.buffers.get(name)
        out = self(name, num, c, c)
        if self.buffers[name] is not buf:
            self.buffers[name].zero_()
        return out


def load_segment(layout: ChunkLayout, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 use_qk_l2norm_in_kernel: bool, span: Span, ws: Workspace,
                 states_only: bool = False, scale_attn: bool = True) -> Segment:
    """Gather the chunks and sequences of ``span`` and compute their parallel part (in buffers of
    ``ws``, valid until the next segment). With ``states_only`` the query side (rows ``:C``
    of ``qk`` and ``sim``) is left unset: enough for :func:`state_scan`, not for outputs.
    Without ``scale_attn`` the attention rows hold ``(y_q K^T) * Gamma`` without the
    ``scale`` (the caller applies it, e.g. as a matmul's alpha)."""
    num, c = span.num, layout.chunk_size
    head_k_dim, head_v_dim = q.shape[-1], v.shape[-1]
    ws.activate(span)
    qk = ws("qk", num, 2 * c, head_k_dim)
    rnorm = ws("rnorm", num, 2 * c, 1) if use_qk_l2norm_in_kernel else None
    if not states_only:
        layout.load(q, span, out=qk[:, :, :c], rnorm_out=None if rnorm is None else rnorm[:, :, :c])
    key = layout.load(k, span, out=qk[:, :, c:], rnorm_out=None if rnorm is None else rnorm[:, :, c:])
    rows = slice(c, 2 * c) if states_only else slice(0, 2 * c)
    g_c = layout.load(g, span, out=ws("g", num, c))
    gamma = torch.cumsum(g_c, -1, out=ws("gamma", num, c))
    beta_c = layout.load(beta, span, out=ws("beta", num, c))
    gamma_exp = torch.exp(gamma, out=ws("gamma_exp", num, c))
    decay = pairwise_decay(g_c, out=ws("decay", num, c, c))

    sim = ws("sim", num, 2 * c, c)
    bmm(qk[:, :, rows], key.mT, out=sim[:, :, rows])  # [Q; K] K^T
    if states_only:
        sim[:, :, c:].mul_(decay)
    else:  # both halves by Gamma in one pass
        sim.unflatten(2, (2, c)).mul_(decay.unsqueeze(2))
        if scale_attn:
            sim[:, :, :c].mul_(scale)
    gram = sim[:, :, c:]  # Gamma is 0 above the diagonal: zeroing the diagonal is enough
    gram.diagonal(dim1=-2, dim2=-1).zero_()
    scratch = ws("scratch_cc", num, c, c)
    neg_beta = torch.neg(beta_c, out=ws("neg_beta", num, c))
    inverse = unit_lower_inverse(torch.mul(gram, neg_beta[..., :, None], out=scratch),
                                 out=ws.unit_lower("inverse", num, c), negated=True, out_is_unit=True)

    v_c = layout.load(v, span, out=ws("v", num, c, head_v_dim))
    # Separate contiguous U and W: the scan's in-place matmuls on a strided view would fall
    # back to one matmul per matrix. The per-token factors scale the columns of T (C x C)
    # rather than the rows of V and K (C x D): U = (T diag(beta)) V, W = (T diag(beta e^gamma)) K.
    t_scaled = torch.mul(inverse, beta_c[..., None, :], out=scratch)  # scratch (-beta G) is spent
    u = bmm(t_scaled, v_c, out=ws("u", num, c, head_v_dim))
    w = bmm(t_scaled.mul_(gamma_exp[..., None, :]), key, out=ws("w", num, c, head_k_dim))
    k_scale = decay_to_chunk_end(g_c, out=ws("k_scale", num, c))
    k_decayed = torch.mul(key, k_scale[..., None], out=ws("k_decayed", num, c, head_k_dim))
    return Segment(qk, rnorm, v_c, beta_c, gamma, gamma_exp, decay, sim, inverse, u, w, k_scale, k_decayed)


def state_scan(seg: Segment, slots: Sequence[Tensor]) -> None:
    """The recurrence across the chunks of a segment: for c = 0 .. G-1::

        V'_c     = U_c - W_c S_c                   (written over U_c in ``seg.u``)
        S_{c+1}  = exp(gamma_C) S_c + K_decayed_c^T V'_c

    ``slots``: ``G + 1`` contiguous ``[nh, K, V]`` states; ``slots[0]`` holds ``S_0`` on
    entry, every ``slots[c]`` holds ``S_c`` on return (see
    :meth:`torch_gdr.ops.torch.chunk_states.ChunkStates.scan_slots`).
    """
    # Per-chunk views made once (unbind): indexing in the loop costs Python time per op.
    u, w, k_decayed_t, chunk_decay = (x.unbind(0) for x in (seg.u, seg.w, seg.k_decayed.mT, seg.chunk_decay))
    s = slots  # S_c
    for c in range(len(u)):
        u[c].baddbmm_(w[c], s[c], alpha=-1)
        torch.mul(s[c], chunk_decay[c], out=s[c + 1])
        s[c + 1].baddbmm_(k_decayed_t[c], u[c])
