"""A float64 per-token gated delta rule, the ground truth for the PyPTO kernel tests.

Token-major (TND) layout with cumulative sequence offsets, key-first state, exactly the
recurrence of the spec:

    S *= exp(g_t);  u = beta_t (v_t - S^T k_t);  S += k_t u^T;  o_t = S^T (scale q_t)
"""

from __future__ import annotations

import torch


def recurrent_gated_delta_rule_tnd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference in float64.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]``; any float dtype.
        cu_seqlens: ``[N + 1]`` integer cumulative offsets.
        initial_state: ``[N, HV, K, V]`` key-first, or None for zeros.

    Returns:
        o ``[T, HV, V]`` and final state ``[N, HV, K, V]``, both float64.
    """
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    num_tokens, num_qk_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    group = num_v_heads // num_qk_heads
    offsets = [int(c) for c in cu_seqlens.tolist()]
    num_seqs = len(offsets) - 1
    o = torch.zeros(num_tokens, num_v_heads, head_v_dim, dtype=torch.float64)
    final = torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float64)
    for n in range(num_seqs):
        for h in range(num_v_heads):
            hk = h // group
            state = (
                initial_state[n, h].double().clone()
                if initial_state is not None
                else torch.zeros(head_k_dim, head_v_dim, dtype=torch.float64)
            )
            for t in range(offsets[n], offsets[n + 1]):
                state = state * torch.exp(g[t, h])
                u = beta[t, h] * (v[t, h] - state.T @ k[t, hk])
                state = state + torch.outer(k[t, hk], u)
                o[t, h] = state.T @ (scale * q[t, hk])
            final[n, h] = state
    return o, final
