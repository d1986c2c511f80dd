"""The chunked gated delta rule in pure torch: the fast path on CPUs and GPUs.

Each sequence is cut into chunks of ``C`` tokens. With ``gamma`` the cumulative sum of
``g`` restarting at every chunk and ``Gamma[r, s] = exp(gamma_r - gamma_s)`` for
``r >= s`` (0 above the diagonal, masked before the exp so it cannot overflow)::

    A  = strictly_lower(diag(beta) K K^T * Gamma)
    U  = (I + A)^-1 (beta * V)          W = (I + A)^-1 (beta * exp(gamma) * K)
    V' = U - W S                        S: the state entering the chunk
    O  = (exp(gamma) * Q) S + (Q K^T * Gamma) V'
    S <- exp(gamma_C) S + (exp(gamma_C - gamma) * K)^T V'

The call is processed a *segment* of ``G`` chunks at a time (all sequences and heads of
those chunks at once, chunk-major ``[G, N * HV, C, D]``, see
:mod:`torch_gdr.ref.chunk_layout`): temporaries stay O(segment) whatever T is, and every
parallel step is one batched matmul over the ``G * N * HV`` chunk matrices of the
segment. Within a segment the query and key of a chunk are stacked ``[Q; K]`` so that
``Q K^T`` and ``K K^T`` are one matmul, ``U | W`` are one matmul against ``T``, and
``(I + A)^-1`` is a blocked inverse (:mod:`torch_gdr.ref.triangular`). Only the state
recurrence loops over chunks, writing into preallocated buffers (no per-chunk copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from torch_gdr.ref.chunk_layout import ChunkLayout
from torch_gdr.ref.triangular import unit_lower_inverse
from torch_gdr.ref.utils import L2NORM_EPS

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


def pairwise_decay(gamma: Tensor) -> Tensor:
    """``Gamma [.., C, C]``: ``exp(gamma_r - gamma_s)`` on and below the diagonal, 0 above
    (masked before the exp, so that large positive differences cannot overflow)."""
    c = gamma.shape[-1]
    upper = torch.ones(c, c, dtype=torch.bool, device=gamma.device).triu(1)
    diff = gamma[..., :, None] - gamma[..., None, :]
    return diff.masked_fill_(upper, float("-inf")).exp_()


@dataclass
class Segment:
    """The parallel part of chunks ``[c0, c1)``: everything but the state recurrence.

    Shapes are chunk-major ``[G, NH, ...]``; ``C`` tokens per chunk.
    """

    qk: Tensor  # [G, NH, 2C, K]: rows :C the query y_q, rows C: the key (both l2-normalised if asked)
    rnorm: Optional[Tensor]  # [G, NH, 2C, 1]: 1 / |x| of the l2norm, or None
    v: Tensor  # [G, NH, C, V]
    beta: Tensor  # [G, NH, C]
    gamma: Tensor  # [G, NH, C]: cumsum of g within the chunk
    gamma_exp: Tensor  # exp(gamma)
    decay: Tensor  # [G, NH, C, C]: Gamma
    sim: Tensor  # [G, NH, 2C, C]: rows :C P = scale (y_q K^T) * Gamma, rows C: G = strictly_lower(K K^T * Gamma)
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


def load_segment(layout: ChunkLayout, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                 use_qk_l2norm_in_kernel: bool, c0: int, c1: int, states_only: bool = False) -> Segment:
    """Gather chunks ``[c0, c1)`` of the call and compute their parallel part. With
    ``states_only`` the query side (rows ``:C`` of ``qk`` and ``sim``) is left unset: enough
    for :func:`state_scan`, not for outputs."""
    num, c = c1 - c0, layout.chunk_size
    nh, head_k_dim, head_v_dim = layout.num_matrices, q.shape[-1], v.shape[-1]
    qk = torch.empty(num, nh, 2 * c, head_k_dim, dtype=layout.dtype, device=layout.device)
    rows = slice(c, 2 * c) if states_only else slice(0, 2 * c)
    if not states_only:
        layout.load(q, c0, c1, out=qk[:, :, :c])
    layout.load(k, c0, c1, out=qk[:, :, c:])
    rnorm = None
    if use_qk_l2norm_in_kernel:
        rnorm = qk[:, :, rows].pow(2).sum(-1, keepdim=True).add_(L2NORM_EPS).rsqrt_()
        qk[:, :, rows].mul_(rnorm)
    gamma = layout.load(g, c0, c1).cumsum_(-1)
    beta_c = layout.load(beta, c0, c1)
    gamma_exp = gamma.exp()
    decay = pairwise_decay(gamma)

    sim = torch.empty(num, nh, 2 * c, c, dtype=layout.dtype, device=layout.device)
    bmm(qk[:, :, rows], qk[:, :, c:].mT, out=sim[:, :, rows])  # [Q; K] K^T
    if not states_only:
        sim[:, :, :c].mul_(decay).mul_(scale)
    gram = sim[:, :, c:].mul_(decay).tril_(-1)
    inverse = unit_lower_inverse(gram * beta_c[..., :, None])

    v_c = layout.load(v, c0, c1)
    # Separate contiguous U and W: the scan's in-place matmuls on a strided view would fall
    # back to one matmul per matrix.
    u = bmm(inverse, v_c * beta_c[..., None])
    w = bmm(inverse, qk[:, :, c:] * (beta_c * gamma_exp)[..., None])
    k_scale = (gamma[..., -1:] - gamma).exp_()
    k_decayed = qk[:, :, c:] * k_scale[..., None]
    return Segment(qk, rnorm, v_c, beta_c, gamma, gamma_exp, decay, sim, inverse, u, w, k_scale, k_decayed)


def state_scan(seg: Segment, states: Tensor) -> None:
    """The recurrence across the chunks of a segment: for c = 0 .. G-1::

        V'_c     = U_c - W_c S_c                   (written over U_c in ``seg.u``)
        S_{c+1}  = exp(gamma_C) S_c + K_decayed_c^T V'_c

    ``states [G + 1, NH, K, V]`` holds ``S_0`` on entry and every ``S_c`` on return.
    """
    u, w, k_decayed, chunk_decay = seg.u, seg.w, seg.k_decayed, seg.chunk_decay
    for c in range(u.shape[0]):
        u[c].baddbmm_(w[c], states[c], alpha=-1)
        torch.mul(states[c], chunk_decay[c], out=states[c + 1])
        states[c + 1].baddbmm_(k_decayed[c].mT, u[c])


def initial_states(layout: ChunkLayout, initial_state: Optional[Tensor], head_k_dim: int, head_v_dim: int,
                   slots: int) -> Tensor:
    """A buffer ``[slots, NH, K, V]`` whose first slot holds the initial state (zeros when None)."""
    states = torch.empty(slots, layout.num_matrices, head_k_dim, head_v_dim, dtype=layout.dtype,
                         device=layout.device)
    if initial_state is None:
        states[0].zero_()
    else:
        states[0].copy_(initial_state.reshape(states.shape[1:]))
    return states


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                  initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor],
                  chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunked forward without autograd: ``(o [B, T, HV, V] in v's dtype, final state)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    layout = ChunkLayout(v, cu_seqlens, chunk_size)
    head_k_dim, head_v_dim = q.shape[-1], v.shape[-1]
    final_shape = (layout.num_seqs, layout.num_v_heads, head_k_dim, head_v_dim)
    states = initial_states(layout, initial_state, head_k_dim, head_v_dim, layout.segment + 1)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for c0, c1 in layout.segments():
        seg = load_segment(layout, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, c0, c1)
        num = c1 - c0
        state_scan(seg, states[: num + 1])
        q_decayed = seg.query * (seg.gamma_exp * scale)[..., None]
        out = bmm(q_decayed, states[:num])
        batched(out).baddbmm_(batched(seg.attn), batched(seg.u))
        layout.store(o, out, c0, c1)
        states[0].copy_(states[num])
    return o, states[0].clone().view(final_shape)


def chunk_gated_delta_rule_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Optional[Tensor]]:
    """Gated delta rule by the chunked algorithm.

    Differentiable: under autograd (grad mode on and an input requiring grad) the call goes
    through ``torch.ops.gdr.chunked_gated_delta_rule``, whose backward is the hand-written
    one of :mod:`torch_gdr.ref.chunk_backward`.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``, ``HV % H == 0``.
        g: ``[B, T, HV]`` raw per-token log decay; beta: ``[B, T, HV]``.
        scale: multiplies q (after the l2norm); ``K ** -0.5`` when None.
        initial_state: key-first ``[N, HV, K, V]``, any float dtype; zeros when None.
        cu_seqlens: ``[N + 1]`` int64 offsets of packed sequences (B == 1) on the inputs'
            device, or None.
        chunk_size: C, the number of tokens per chunk (a power of two).

    Returns:
        ``o [B, T, HV, V]`` in the dtype of v, and the final state ``[N, HV, K, V]`` in
        float32 (float64 for float64 inputs), or None when ``output_final_state`` is False.
    """
    tensors = (q, k, v, g, beta) + ((initial_state,) if initial_state is not None else ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        from torch_gdr.ops.registration import chunked_gated_delta_rule

        o, final_state = chunked_gated_delta_rule(q, k, v, g, beta, scale, initial_state, True,
                                                  use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, False)
    else:
        o, final_state = _forward_impl(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                       cu_seqlens, chunk_size)
    return o, (final_state if output_final_state else None)
