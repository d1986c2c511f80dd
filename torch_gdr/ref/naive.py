"""The gated delta rule as a per-token recurrence: the definition, written for clarity.

Per sequence and value head, with a key-first state ``S [K, V]``::

    S   <- exp(g_t) * S
    u    = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u^T
    o_t  = S^T (scale * q_t)

Tests use it as the truth every other backend is checked against. It loops over tokens
in Python and is slow by design.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.ref.utils import compute_dtype_for, l2norm, repeat_kv_heads


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of equal-length sequences: q, k ``[N, T, HV, K]``, v ``[N, T, HV, V]``,
    g, beta ``[N, T, HV]``, state ``[N, HV, K, V]``; returns o ``[N, T, HV, V]`` and the state."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("nhkv,nhk->nhv", state, k[:, t])
        update = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + torch.einsum("nhk,nhv->nhkv", k[:, t], update)
        outputs.append(torch.einsum("nhkv,nhk->nhv", state, q[:, t]))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, state


def naive_recurrent_gated_delta_rule(
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
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gated delta rule by the per-token recurrence.

    Args:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``, ``HV % H == 0``.
        g: ``[B, T, HV]`` raw per-token log decay; beta: ``[B, T, HV]``.
        scale: multiplies q (after the l2norm); ``K ** -0.5`` when None.
        initial_state: key-first ``[N, HV, K, V]``; zeros when None.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1), or None.

    Returns:
        ``o [B, T, HV, V]`` in the dtype of v, and the final state ``[N, HV, K, V]`` in
        float32 (float64 for float64 inputs), or None when ``output_final_state`` is False.
    """
    out_dtype, dtype = v.dtype, compute_dtype_for(v.dtype)
    num_v_heads = v.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = repeat_kv_heads(q * scale, num_v_heads)
    k = repeat_kv_heads(k, num_v_heads)

    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_shape = (num_seqs, num_v_heads, q.shape[-1], v.shape[-1])
    state = (torch.zeros(state_shape, dtype=dtype, device=v.device) if initial_state is None
             else initial_state.to(dtype))

    if cu_seqlens is None:
        o, final_state = _recurrence(q, k, v, g, beta, state)
    else:
        bounds = cu_seqlens.tolist()
        pieces, finals = [], []
        for n in range(num_seqs):
            span = slice(bounds[n], bounds[n + 1])
            o_n, s_n = _recurrence(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], state[n : n + 1])
            pieces.append(o_n)
            finals.append(s_n)
        o, final_state = torch.cat(pieces, dim=1), torch.cat(finals, dim=0)
    return o.to(out_dtype), (final_state if output_final_state else None)
