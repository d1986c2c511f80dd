"""The chunked gated delta rule in pure torch: the fast path on CPUs and GPUs.

Each sequence is cut into chunks of ``C`` tokens. With ``gamma`` the cumulative sum of
``g`` restarting at every chunk and ``Gamma[r, s] = exp(gamma_r - gamma_s)`` for
``r >= s`` (0 above the diagonal, masked before the exp so it cannot overflow)::

    A  = strictly_lower(diag(beta) K K^T * Gamma)
    U  = (I + A)^-1 (beta * V)          W = (I + A)^-1 (beta * exp(gamma) * K)
    V' = U - W S                        S: the state entering the chunk
    O  = (exp(gamma) * Q) S + (Q K^T * Gamma) V'
    S <- exp(gamma_C) S + (exp(gamma_C - gamma) * K)^T V'

Everything but the last three lines is computed for all chunks of all sequences and
heads at once; only the state recurrence loops over the chunk index.
"""

from __future__ import annotations

from typing import Optional

import torch
from einops import rearrange

from torch_gdr.ref.utils import SequencePadding, compute_dtype_for, l2norm, repeat_kv_heads


def _causal_masks(chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower-triangular masks ``[C, C]``: with the diagonal and strictly below it."""
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    return lower, lower.tril(-1)


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule by the chunked algorithm (differentiable by autograd).

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``, ``HV % H == 0``.
        g: ``[B, T, HV]`` raw per-token log decay; beta: ``[B, T, HV]``.
        scale: multiplies q (after the l2norm); ``K ** -0.5`` when None.
        initial_state: key-first ``[N, HV, K, V]``, any float dtype; zeros when None.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1), or None.
        chunk_size: C, the number of tokens per chunk.

    Returns:
        ``o [B, T, HV, V]`` in the dtype of v, and the final state ``[N, HV, K, V]`` in
        float32 (float64 for float64 inputs), or None when ``output_final_state`` is False.
    """
    out_dtype, dtype = v.dtype, compute_dtype_for(v.dtype)
    batch_size, seq_len, num_v_heads, head_v_dim = v.shape
    head_k_dim = q.shape[-1]
    scale = head_k_dim ** -0.5 if scale is None else scale
    device = v.device

    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = repeat_kv_heads(q * scale, num_v_heads)
    k = repeat_kv_heads(k, num_v_heads)

    padding = SequencePadding(batch_size, seq_len, cu_seqlens, chunk_size, device)
    to_chunks = "n (c l) h d -> n h c l d"
    q, k, v = (rearrange(padding.pad(t), to_chunks, l=chunk_size) for t in (q, k, v))
    g, beta = (rearrange(padding.pad(t), "n (c l) h -> n h c l", l=chunk_size) for t in (g, beta))
    num_seqs, num_chunks = padding.num_seqs, padding.num_chunks

    # Parallel over every chunk: decays, the UT transform, and the intra-chunk attention.
    lower, strictly_lower = _causal_masks(chunk_size, device)
    gamma = g.cumsum(-1)  # [N, HV, NC, C]
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    a = ((k * beta[..., None]) @ k.transpose(-1, -2) * decay).masked_fill(~strictly_lower, 0)
    eye = torch.eye(chunk_size, dtype=dtype, device=device)
    rhs = torch.cat([v * beta[..., None], k * (beta * gamma.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    u, w = solved.split([head_v_dim, head_k_dim], dim=-1)  # [N, HV, NC, C, V], [.., K]
    attn = q @ k.transpose(-1, -2) * decay  # [N, HV, NC, C, C], zero above the diagonal
    q_decayed = q * gamma.exp()[..., None]
    k_decayed = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [N, HV, NC, 1, 1]

    # Sequential over chunks: the state recurrence.
    if initial_state is None:
        state = torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, dtype=dtype, device=device)
    else:
        state = initial_state.to(dtype)
    outputs = []
    for c in range(num_chunks):
        v_new = u[:, :, c] - w[:, :, c] @ state
        outputs.append(q_decayed[:, :, c] @ state + attn[:, :, c] @ v_new)
        state = chunk_decay[:, :, c] * state + k_decayed[:, :, c].transpose(-1, -2) @ v_new
    if outputs:
        o = rearrange(torch.stack(outputs, dim=2), "n h c l d -> n (c l) h d")
    else:
        o = v.new_zeros(num_seqs, 0, num_v_heads, head_v_dim)
    o = padding.unpad(o).to(out_dtype)
    return o, (state if output_final_state else None)
