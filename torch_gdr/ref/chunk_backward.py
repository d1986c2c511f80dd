"""The backward of the chunked gated delta rule, written by hand.

Notation per chunk (``C`` tokens, one sequence and value head; see :mod:`torch_gdr.ref.chunk`)::

    gamma = cumsum(g)                     Gamma[r, s] = exp(gamma_r - gamma_s) (r >= s, else 0)
    G  = strictly_lower(K K^T * Gamma)    A = diag(beta) G          T = (I + A)^-1
    Vb = beta * V                         Kb = beta * exp(gamma) * K
    U  = T Vb                             W  = T Kb
    V' = U - W S                          S: state entering the chunk, S': state leaving it
    Qg = exp(gamma) * Q                   P  = (Q K^T) * Gamma       Kd = exp(gamma_C - gamma) * K
    O  = Qg S + P V'                      S' = exp(gamma_C) S + Kd^T V'

Nothing but the inputs is saved by the forward. The backward recomputes the parallel part
and the chunk-boundary states ``S_c`` (one forward scan), then walks the chunks in reverse
carrying ``dS`` (the gradient of the loss w.r.t. the state leaving the chunk, starting from
the gradient on the final state)::

    dV'  = P^T dO + Kd dS'                                  (sequential: needs dS')
    dS   = exp(gamma_C) dS' + Qg^T dO - W^T dV'             (carried to the previous chunk)

Everything else is parallel over all chunks once every ``S`` and ``dS'`` is known:

    from O:   dQ  = exp(gamma) * (dO S^T) + (dP * Gamma) K      dP = dO V'^T
              dK  = (dP * Gamma)^T Q
    from S':  dK += exp(gamma_C - gamma) * (V' dS'^T)
    from V':  dVb = T^T dV'         dKb = -T^T (dV' S^T)
              dA  = -strictly_lower(dVb U^T + dKb W^T)         (d(M^-1) = -M^-T dM^-1 M^-T,
                                                                  folded through U = T Vb, W = T Kb)
    from Vb, Kb:  dV = beta * dVb   dbeta = rowsum(dVb * V) + exp(gamma) rowsum(dKb * K)
                  dK += beta exp(gamma) * dKb
    from A:   dbeta += rowsum(dA * G)       dB = beta * dA * Gamma      dK += (dB + dB^T) K

The decays: every ``exp(gamma_r - gamma_s)`` factor ``X = Y * exp(gamma_r - gamma_s)``
gives ``dgamma_r += dX * X`` and ``dgamma_s -= dX * X``. Summed up::

    dgamma  = rowsum(dQ_g * Q)                              (dQ_g: the first term of dQ)
            + rowsum(M) - colsum(M)        M = dP * P
            + rowsum(M2) - colsum(M2)      M2 = beta * dA * G
            - rowsum(dKd * Kd)             dKd = V' dS'^T
            + beta exp(gamma) rowsum(dKb * K)
    dgamma_C += sum(dKd * Kd) + exp(gamma_C) sum(dS' * S)
    dg = reverse cumsum of dgamma within each chunk.

Then the chunk layout is undone (padding dropped, q/k gradients of the value heads summed
onto their shared q/k head), ``dq`` is multiplied by ``scale``, and the l2norm backward
``dx = r (dy - y (y . dy))`` (``y = x r``, ``r = (|x|^2 + eps)^-1/2``) applies when asked.
Everything runs in float32 (float64 for float64 inputs); gradients come back in the dtype of
their inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.ref.chunk import (batched, make_layout, pairwise_decay, prepare_inputs, state_scan,
                                 ut_transform)
from torch_gdr.ref.utils import L2NORM_EPS

Tensor = torch.Tensor


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for chunk-major ``[NC, NH, m, k] @ [NC, NH, k, n]`` as one bmm."""
    return torch.bmm(batched(a), batched(b)).view(a.shape[:2] + (a.shape[2], b.shape[3]))


def _baddbmm_(acc: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0) -> Tensor:
    """``acc += alpha * a @ b`` in place, chunk-major."""
    batched(acc).baddbmm_(batched(a), batched(b), alpha=alpha)
    return acc


def _l2norm_backward(x: Tensor, dy: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """Gradient of ``y = x / sqrt(sum(x^2) + eps)`` along the last dim: ``r (dy - y (y . dy))``."""
    r = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def chunk_gated_delta_rule_bwd(
    grad_o: Tensor,
    grad_final_state: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Gradients of :func:`torch_gdr.ref.chunk.chunk_gated_delta_rule_fwd`.

    Args:
        grad_o: ``[B, T, HV, V]``, the gradient on ``o``.
        grad_final_state: ``[N, HV, K, V]`` key-first, or None (no gradient on the final state).
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
        chunk_size: the forward's arguments, in the batched layout with a key-first state.

    Returns:
        ``(dq, dk, dv, dg, dbeta, d_initial_state)``, each in the shape and dtype of its input;
        ``d_initial_state`` is None when ``initial_state`` is None.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    num_heads = q.shape[2]
    layout = make_layout(v, cu_seqlens, chunk_size)
    dtype = layout.dtype
    x = prepare_inputs(layout, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel)
    nh = x.h0.shape[0]
    d_state = torch.empty((layout.num_chunks + 1,) + tuple(x.h0.shape), dtype=dtype, device=v.device)
    if grad_final_state is None:
        d_state[-1].zero_()
    else:
        d_state[-1].copy_(grad_final_state.reshape(x.h0.shape))

    if layout.num_chunks == 0:
        dq, dk = q.new_zeros(q.shape), k.new_zeros(k.shape)
        dv, dg, dbeta = v.new_zeros(v.shape), g.new_zeros(g.shape), beta.new_zeros(beta.shape)
        d_initial = d_state[-1]
    else:
        dq, dk, dv, dg, dbeta, d_initial = _chunked_backward(layout, x, layout.to_chunks(grad_o), d_state)
        dq = layout.from_chunks(dq, num_heads).mul_(scale)
        dk = layout.from_chunks(dk, num_heads)
        dv, dg, dbeta = layout.from_chunks(dv), layout.from_chunks(dg), layout.from_chunks(dbeta)
        if use_qk_l2norm_in_kernel:
            dq = _l2norm_backward(q.to(dtype), dq)
            dk = _l2norm_backward(k.to(dtype), dk)
    d_initial = None if initial_state is None else d_initial.reshape(initial_state.shape).to(initial_state.dtype)
    del nh
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype), d_initial)


def _chunked_backward(layout, x, do: Tensor, d_state: Tensor) -> tuple[Tensor, ...]:
    """The backward in the chunk-major layout. ``do [NC, NH, C, V]``; ``d_state [NC + 1, NH,
    K, V]`` holds the gradient on the final state in its last slot and is filled with the
    gradients w.r.t. every chunk-boundary state. Returns chunk-major ``dq, dk, dv, dg,
    dbeta`` and ``d_initial [NH, K, V]``."""
    q, k, v, beta = x.q, x.k, x.v, x.beta
    num_chunks = layout.num_chunks

    # Recompute the forward: decays, the UT transform, the boundary states and V'.
    gamma = x.g.cumsum_(-1)  # [NC, NH, C]
    decay = pairwise_decay(gamma)  # Gamma
    gram, inverse = ut_transform(k, beta, decay)  # G, T
    gamma_exp = gamma.exp()
    k_scale = (gamma[..., -1:] - gamma).exp_()  # exp(gamma_C - gamma)
    chunk_decay = gamma_exp[..., -1:, None]  # [NC, NH, 1, 1]
    u = _bmm(inverse, v * beta[..., None])
    w = _bmm(inverse, k * (beta * gamma_exp)[..., None])
    k_decayed = k * k_scale[..., None]
    q_decayed = q * gamma_exp[..., None]
    states, v_new = state_scan(u, w, k_decayed, chunk_decay, x.h0)
    attn = _bmm(q, k.mT).mul_(decay)  # P

    # Reverse walk over chunks carrying dS.
    dv_new = _bmm(attn.mT, do)
    for c in range(num_chunks - 1, -1, -1):
        dv_new[c].baddbmm_(k_decayed[c], d_state[c + 1])
        torch.mul(d_state[c + 1], chunk_decay[c], out=d_state[c])
        d_state[c].baddbmm_(q_decayed[c].mT, do[c])
        d_state[c].baddbmm_(w[c].mT, dv_new[c], alpha=-1)
    del q_decayed
    s_in, ds_out = states[:-1], d_state[1:]

    # O = Qg S + P V'
    dq = _bmm(do, s_in.mT).mul_(gamma_exp[..., None])
    dgamma = (dq * q).sum(-1)
    dp = _bmm(do, v_new.mT)
    m = dp * attn
    dgamma += m.sum(-1) - m.sum(-2)
    del m, attn
    dp.mul_(decay)
    _baddbmm_(dq, dp, k)
    dk = _bmm(dp.mT, q)
    del dp

    # S' = exp(gamma_C) S + Kd^T V'
    dk_decayed = _bmm(v_new, ds_out.mT)
    t = (dk_decayed * k_decayed).sum(-1)
    del k_decayed
    dgamma -= t
    dgamma[..., -1] += t.sum(-1) + gamma_exp[..., -1] * (ds_out * s_in).sum((-2, -1))
    dk.addcmul_(dk_decayed, k_scale[..., None])
    del dk_decayed, t

    # V' = U - W S, U = T Vb, W = T Kb   (dw_neg = -dW, dkb_neg = -dKb)
    dw_neg = _bmm(dv_new, s_in.mT)
    del states, s_in, ds_out
    dvb = _bmm(inverse.mT, dv_new)
    dkb_neg = _bmm(inverse.mT, dw_neg)
    del dw_neg, dv_new, inverse
    da = _bmm(dkb_neg, w.mT)
    _baddbmm_(da, dvb, u.mT, alpha=-1)
    da.tril_(-1)
    del u, w
    dv = dvb * beta[..., None]
    dbeta = (dvb * v).sum(-1)
    del dvb
    s_kb = (dkb_neg * k).sum(-1).neg_()  # rowsum(dKb * K)
    beta_exp = beta * gamma_exp
    dbeta += gamma_exp * s_kb
    dgamma += beta_exp * s_kb
    dk.addcmul_(dkb_neg, beta_exp[..., None], value=-1)
    del dkb_neg

    # A = diag(beta) G, G = strictly_lower(K K^T * Gamma)
    dbeta += (da * gram).sum(-1)
    da.mul_(beta[..., None])  # dG
    m2 = da * gram
    dgamma += m2.sum(-1) - m2.sum(-2)
    del m2, gram
    da.mul_(decay)  # d(K K^T)
    _baddbmm_(dk, da, k)
    _baddbmm_(dk, da.mT, k)

    # gamma = cumsum(g) within the chunk
    dg = dgamma.flip(-1).cumsum(-1).flip(-1)
    return dq, dk, dv, dg, dbeta, d_state[0]
