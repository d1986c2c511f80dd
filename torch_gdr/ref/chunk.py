"""The chunked gated delta rule in pure torch: the fast path on CPUs and GPUs.

Each sequence is cut into chunks of ``C`` tokens. With ``gamma`` the cumulative sum of
``g`` restarting at every chunk and ``Gamma[r, s] = exp(gamma_r - gamma_s)`` for
``r >= s`` (0 above the diagonal, masked before the exp so it cannot overflow)::

    A  = strictly_lower(diag(beta) K K^T * Gamma)
    U  = (I + A)^-1 (beta * V)          W = (I + A)^-1 (beta * exp(gamma) * K)
    V' = U - W S                        S: the state entering the chunk
    O  = (exp(gamma) * Q) S + (Q K^T * Gamma) V'
    S <- exp(gamma_C) S + (exp(gamma_C - gamma) * K)^T V'

Layout: every per-token tensor is kept chunk-major, ``[NC, N * HV, C, D]`` (NC chunks,
N sequences, HV value heads). The parallel parts (decays, the UT transform, the intra-chunk
attention, the output) are single batched matmuls over all ``NC * N * HV`` chunks; the
state recurrence loops over the chunk index only, and each step works on the contiguous
slice ``[c]`` of preallocated buffers (``out=``, no per-chunk copies or zero fills).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from torch_gdr.ref.triangular import unit_lower_inverse
from torch_gdr.ref.utils import SequencePadding, compute_dtype_for, l2norm

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------
# Layout: [B, T, H, ...] tokens <-> chunk-major [NC, N * HV, C, ...]
# --------------------------------------------------------------------------------------

@dataclass
class ChunkLayout:
    """How tokens of a call map onto chunk-major tensors ``[NC, N * HV, C, ...]``.

    Value head ``h`` reads q/k head ``h // group``; every sequence starts a fresh chunk and
    is zero-padded to NC chunks (zero padding leaves outputs and final states exact).
    """

    padding: SequencePadding
    batch_size: int
    seq_len: int
    num_v_heads: int
    chunk_size: int
    dtype: torch.dtype

    @property
    def num_seqs(self) -> int:
        return self.padding.num_seqs

    @property
    def num_chunks(self) -> int:
        return self.padding.num_chunks

    def to_chunks(self, x: Tensor, scale: Optional[Tensor] = None) -> Tensor:
        """``x [B, T, Hx, *D]`` (``Hx`` divides HV) -> a new tensor ``[NC, N * HV, C, *D]`` in
        the compute dtype; q/k heads are repeated over their group of value heads."""
        n, nc, c, hv = self.num_seqs, self.num_chunks, self.chunk_size, self.num_v_heads
        rest = tuple(x.shape[3:])
        heads = x.shape[2]
        group = hv // heads
        out = torch.empty((nc, n, heads, group, c) + rest, dtype=self.dtype, device=x.device)
        if out.numel() == 0:
            return out.view((nc, n * hv, c) + rest)
        view = out.view((nc, n, heads, group, c) + rest)
        tokens = self._token_view(x)  # [N, NC, C, H, *D] (padded where needed)
        src = tokens.movedim(1, 0).movedim(2, 3).unsqueeze(3)  # [NC, N, H, 1, C, *D]
        view.copy_(src.expand_as(view))
        return out.view((nc, n * hv, c) + rest)

    def _token_view(self, x: Tensor) -> Tensor:
        """``x [B, T, ...]`` as ``[N, NC, C, ...]``, zero padded (a view when no padding is needed)."""
        n, nc, c = self.num_seqs, self.num_chunks, self.chunk_size
        rest = tuple(x.shape[2:])
        if self.padding.cu_seqlens is None and nc * c == self.seq_len:
            return x.reshape((n, nc, c) + rest)
        return self.padding.pad(x).reshape((n, nc, c) + rest)

    def from_chunks(self, x: Tensor, num_heads: Optional[int] = None) -> Tensor:
        """``x [NC, N * HV, C, *D]`` -> ``[B, T, HV, *D]``; with ``num_heads`` H < HV, the
        values of each group of value heads are summed onto its q/k head (``[B, T, H, *D]``)."""
        n, nc, c, hv = self.num_seqs, self.num_chunks, self.chunk_size, self.num_v_heads
        rest = tuple(x.shape[3:])
        heads = hv if num_heads is None else num_heads
        x = x.view((nc, n, heads, hv // heads, c) + rest)
        x = x.sum(3) if hv != heads else x.squeeze(3)
        tokens = x.permute((1, 0, 3, 2) + tuple(range(4, x.dim()))).reshape((n, nc * c, heads) + rest)
        return self.padding.unpad(tokens)


def make_layout(v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int) -> ChunkLayout:
    batch_size, seq_len, num_v_heads = v.shape[:3]
    padding = SequencePadding(batch_size, seq_len, cu_seqlens, chunk_size, v.device)
    return ChunkLayout(padding, batch_size, seq_len, num_v_heads, chunk_size, compute_dtype_for(v.dtype))


@dataclass
class ChunkInputs:
    """Inputs of a call in the chunk-major layout and the compute dtype."""

    q: Tensor  # [NC, NH, C, K], l2-normalised (if asked) and scaled
    k: Tensor  # [NC, NH, C, K], l2-normalised (if asked)
    v: Tensor  # [NC, NH, C, V]
    g: Tensor  # [NC, NH, C]
    beta: Tensor  # [NC, NH, C]
    h0: Tensor  # [NH, K, V]


def prepare_inputs(layout: ChunkLayout, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool) -> ChunkInputs:
    dtype = layout.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.to(dtype)), l2norm(k.to(dtype))
    qc, kc, vc = layout.to_chunks(q), layout.to_chunks(k), layout.to_chunks(v)
    qc.mul_(scale)
    gc, bc = layout.to_chunks(g), layout.to_chunks(beta)
    nh, head_k_dim, head_v_dim = layout.num_seqs * layout.num_v_heads, q.shape[-1], v.shape[-1]
    if initial_state is None:
        h0 = torch.zeros(nh, head_k_dim, head_v_dim, dtype=dtype, device=v.device)
    else:
        h0 = initial_state.to(dtype).reshape(nh, head_k_dim, head_v_dim)
    return ChunkInputs(qc, kc, vc, gc, bc, h0)


# --------------------------------------------------------------------------------------
# The parallel part and the state recurrence
# --------------------------------------------------------------------------------------

def batched(x: Tensor) -> Tensor:
    """``[NC, NH, a, b]`` -> ``[NC * NH, a, b]`` (a view) for one bmm over all chunks."""
    return x.view((-1,) + tuple(x.shape[2:]))


def pairwise_decay(gamma: Tensor) -> Tensor:
    """``Gamma [.., C, C]``: ``exp(gamma_r - gamma_s)`` on and below the diagonal, 0 above
    (masked before the exp, so that large positive differences cannot overflow)."""
    c = gamma.shape[-1]
    upper = torch.ones(c, c, dtype=torch.bool, device=gamma.device).triu(1)
    diff = gamma[..., :, None] - gamma[..., None, :]
    return diff.masked_fill_(upper, float("-inf")).exp_()


def ut_transform(k: Tensor, beta: Tensor, decay: Tensor) -> tuple[Tensor, Tensor]:
    """``G = strictly_lower(K K^T * Gamma)`` and ``T = (I + diag(beta) G)^-1``, both ``[.., C, C]``."""
    gram = torch.bmm(batched(k), batched(k).mT).view(decay.shape)
    gram.mul_(decay).tril_(-1)
    inverse = unit_lower_inverse(gram * beta[..., :, None])
    return gram, inverse


def state_scan(u: Tensor, w: Tensor, k_decayed: Tensor, chunk_decay: Tensor,
               h0: Tensor) -> tuple[Tensor, Tensor]:
    """The recurrence across chunks: for c = 0 .. NC-1 with ``S_0 = h0``::

        V'_c     = U_c - W_c S_c
        S_{c+1}  = chunk_decay_c S_c + K_decayed_c^T V'_c

    Args: u ``[NC, NH, C, V]``, w and k_decayed ``[NC, NH, C, K]``, chunk_decay
    ``[NC, NH, 1, 1]``, h0 ``[NH, K, V]``. Returns ``states [NC + 1, NH, K, V]`` (``S_c``;
    the last is the final state) and ``v_new [NC, NH, C, V]``.
    """
    num_chunks = u.shape[0]
    states = torch.empty((num_chunks + 1,) + tuple(h0.shape), dtype=h0.dtype, device=h0.device)
    states[0].copy_(h0)
    v_new = torch.empty_like(u)
    for c in range(num_chunks):
        torch.baddbmm(u[c], w[c], states[c], alpha=-1, out=v_new[c])
        torch.mul(states[c], chunk_decay[c], out=states[c + 1])
        states[c + 1].baddbmm_(k_decayed[c].mT, v_new[c])
    return states, v_new


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                  initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor],
                  chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunked forward without autograd: ``(o [B, T, HV, V] in v's dtype, final state)``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    layout = make_layout(v, cu_seqlens, chunk_size)
    x = prepare_inputs(layout, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    final_shape = (layout.num_seqs, layout.num_v_heads) + tuple(x.h0.shape[1:])
    if layout.num_chunks == 0:
        return v.new_zeros(v.shape), x.h0.clone().view(final_shape)

    gamma = x.g.cumsum_(-1)  # [NC, NH, C]
    decay = pairwise_decay(gamma)
    _, inverse = ut_transform(x.k, x.beta, decay)
    gamma_exp = gamma.exp()
    x.v.mul_(x.beta[..., None])  # beta * V
    u = torch.bmm(batched(inverse), batched(x.v)).view(x.v.shape)
    del x.v
    w = torch.bmm(batched(inverse), batched(x.k * (x.beta * gamma_exp)[..., None])).view(x.k.shape)
    del inverse
    attn = torch.bmm(batched(x.q), batched(x.k).mT).view(decay.shape).mul_(decay)
    del decay
    k_decayed = x.k.mul_((gamma[..., -1:] - gamma).exp_()[..., None])
    q_decayed = x.q.mul_(gamma_exp[..., None])
    chunk_decay = gamma_exp[..., -1:, None]  # [NC, NH, 1, 1]

    states, v_new = state_scan(u, w, k_decayed, chunk_decay, x.h0)
    del u, w, k_decayed
    o = torch.bmm(batched(q_decayed), batched(states[:-1])).view(v_new.shape)
    o.view(-1, *o.shape[2:]).baddbmm_(batched(attn), batched(v_new))
    final_state = states[-1].clone().view(final_shape)
    return layout.from_chunks(o).to(v.dtype), final_state


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
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1), or None.
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
