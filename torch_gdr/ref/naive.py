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

from einops import repeat

from torch_gdr._layout import L2NORM_EPS, compute_dtype_for, default_scale


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` along the last dim."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)


def repeat_kv_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """q/k heads ``[..., H, D]`` as ``[..., HV, D]``: value head h reads head ``h // (HV // H)``."""
    return repeat(x, "... h d -> ... (h group) d", group=num_v_heads // x.shape[-2])


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
    scale = default_scale(q.shape[-1]) if scale is None else scale
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


def _l2norm_backward(x: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """The gradient through ``y = x r``, ``r = (|x|^2 + eps)^-1/2``: ``r (dy - y (y . dy))``."""
    r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (grad_y - y * (y * grad_y).sum(-1, keepdim=True))


def _recurrence_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, grad_o: torch.Tensor,
                         grad_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Reverse of :func:`_recurrence` for one batch of equal-length sequences (q scaled, heads
    expanded): returns ``(dq, dk, dv, dg, dbeta, d_state_in)``. Per token, with
    ``P = exp(g_t) S_{t-1}``, ``u = beta_t (v_t - P^T k_t)``, ``S_t = P + k_t u^T``,
    ``o_t = S_t^T q_t``, walked backwards carrying ``dS``."""
    states = [state]
    for t in range(q.shape[1]):  # S_0 .. S_T
        decayed = states[-1] * g[:, t].exp()[..., None, None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhkv,nhk->nhv", decayed, k[:, t]))
        states.append(decayed + torch.einsum("nhk,nhv->nhkv", k[:, t], u))
    grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]
    dq, dk, dv, dg, dbeta = grads
    d_state = grad_state.clone()
    for t in range(q.shape[1] - 1, -1, -1):
        s_prev, s_t, k_t = states[t], states[t + 1], k[:, t]
        d_state += torch.einsum("nhk,nhv->nhkv", q[:, t], grad_o[:, t])
        dq[:, t] = torch.einsum("nhkv,nhv->nhk", s_t, grad_o[:, t])
        decayed = s_prev * g[:, t].exp()[..., None, None]
        residual = v[:, t] - torch.einsum("nhkv,nhk->nhv", decayed, k_t)
        u = beta[:, t, :, None] * residual
        du = torch.einsum("nhkv,nhk->nhv", d_state, k_t)
        dv[:, t] = beta[:, t, :, None] * du
        dbeta[:, t] = (du * residual).sum(-1)
        d_pred = -beta[:, t, :, None] * du  # gradient of P^T k
        dk[:, t] = torch.einsum("nhkv,nhv->nhk", d_state, u) + torch.einsum("nhkv,nhv->nhk", decayed, d_pred)
        d_decayed = d_state + torch.einsum("nhk,nhv->nhkv", k_t, d_pred)
        dg[:, t] = (d_decayed * decayed).sum((-2, -1))
        d_state = d_decayed * g[:, t].exp()[..., None, None]
    return dq, dk, dv, dg, dbeta, d_state


def naive_recurrent_gated_delta_rule_bwd(
    grad_o: torch.Tensor,
    grad_final_state: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients of :func:`naive_recurrent_gated_delta_rule` by the reverse recurrence,
    written out per token (no autograd, so it runs inside ops). Arguments as the forward's,
    plus ``grad_o [B, T, HV, V]`` and ``grad_final_state [N, HV, K, V]`` (or None). Returns
    ``(dq, dk, dv, dg, dbeta, d_initial_state or None)`` in the dtypes of the inputs."""
    dtype = compute_dtype_for(v.dtype)
    num_v_heads, head_k_dim = v.shape[2], q.shape[-1]
    scale = default_scale(head_k_dim) if scale is None else scale
    raw_q, raw_k = q.to(dtype), k.to(dtype)
    q_n, k_n = (l2norm(raw_q), l2norm(raw_k)) if use_qk_l2norm_in_kernel else (raw_q, raw_k)
    q_e, k_e = repeat_kv_heads(q_n * scale, num_v_heads), repeat_kv_heads(k_n, num_v_heads)
    v_c, g_c, beta_c, grad_o_c = (t.to(dtype) for t in (v, g, beta, grad_o))
    num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state_shape = (num_seqs, num_v_heads, head_k_dim, v.shape[-1])
    state = torch.zeros(state_shape, dtype=dtype, device=v.device) if initial_state is None else initial_state.to(dtype)
    grad_state = (torch.zeros(state_shape, dtype=dtype, device=v.device) if grad_final_state is None
                  else grad_final_state.to(dtype))
    if cu_seqlens is None:
        dq, dk, dv, dg, dbeta, d_state = _recurrence_backward(q_e, k_e, v_c, g_c, beta_c, state, grad_o_c, grad_state)
    else:
        bounds = cu_seqlens.tolist()
        pieces, d_states = [], []
        for n in range(num_seqs):
            span = slice(bounds[n], bounds[n + 1])
            *grads_n, d_state_n = _recurrence_backward(
                q_e[:, span], k_e[:, span], v_c[:, span], g_c[:, span], beta_c[:, span], state[n:n + 1],
                grad_o_c[:, span], grad_state[n:n + 1])
            pieces.append(grads_n)
            d_states.append(d_state_n)
        dq, dk, dv, dg, dbeta = (torch.cat(parts, dim=1) for parts in zip(*pieces))
        d_state = torch.cat(d_states, dim=0)
    group = num_v_heads // q.shape[-2]
    dq, dk = (x.unflatten(2, (q.shape[-2], group)).sum(3) for x in (dq, dk))  # onto the shared q/k heads
    dq = dq * scale
    if use_qk_l2norm_in_kernel:
        dq, dk = _l2norm_backward(raw_q, dq), _l2norm_backward(raw_k, dk)
    d_initial = None if initial_state is None else d_state.to(initial_state.dtype)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), d_initial)
