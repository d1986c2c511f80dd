"""The backward of the chunked gated delta rule, written by hand.

Notation per chunk (``C`` tokens, one sequence and value head; see :mod:`torch_gdr.ops.torch.chunk`)::

    gamma = cumsum(g)                     Gamma[r, s] = exp(gamma_r - gamma_s) (r >= s, else 0)
    G  = strictly_lower(K K^T * Gamma)    A = diag(beta) G          T = (I + A)^-1
    Vb = beta * V                         Kb = beta * exp(gamma) * K
    U  = T Vb                             W  = T Kb
    V' = U - W S                          S: state entering the chunk, S': state leaving it
    Qg = exp(gamma) * Q                   P  = (Q K^T) * Gamma       Kd = exp(gamma_C - gamma) * K
    O  = Qg S + P V'                      S' = exp(gamma_C) S + Kd^T V'

The forward saves the inputs and, where it can (the public call's training path, eager or
compiled), the chunk-boundary states ``S_c`` (:mod:`torch_gdr.ops.torch.chunk_states`); everything else is
recomputed. The backward runs in up to two passes over segments of a few chunks
(:mod:`torch_gdr.ops.torch.chunk_layout`), so that its temporaries are O(segment): pass 1,
only when the states were not saved (the public op's registered autograd saves nothing but
the inputs), recomputes them by a forward scan; pass 2 walks the segments and chunks in reverse,
recomputing each segment's parallel part and ``V' = U - W S`` (one batched matmul, the
states being known), carrying ``dS`` (the gradient of the loss w.r.t. the state leaving
the chunk, starting from the gradient on the final state)::

    dV'  = P^T dO + Kd dS'                                  (sequential: needs dS')
    dS   = exp(gamma_C) dS' + Qg^T dO - W^T dV'             (carried to the previous chunk)

Everything else is parallel over all chunks once every ``S`` and ``dS'`` is known:

    from O:   dQ  = exp(gamma) * (dO S^T) + (dP * Gamma) K      dP = dO V'^T
              dK  = (dP * Gamma)^T Q
    from S':  dK += exp(gamma_C - gamma) * (V' dS'^T)
    from V':  dU = dV', dW = -dV' S^T; through U = T Vb, W = T Kb and T = (I + A)^-1
              (dT = dU Vb^T + dW Kb^T, dA = -T^T dT T^T):
              dVb = T^T dV'
              dKb = T^T dW = -dVb S^T
              dA  = -strictly_lower(dVb U^T + dKb W^T) = -strictly_lower(dVb (U - W S)^T)
                  = -strictly_lower(dVb V'^T)
    from Vb, Kb:  dV = beta * dVb   dbeta = rowsum(dVb * V) + exp(gamma) rowsum(dKb * K)
                  dK += beta exp(gamma) * dKb
    from A:   dbeta += rowsum(dA * G)       dB = beta * dA * Gamma      dK += (dB + dB^T) K

The decays: every ``exp(gamma_r - gamma_s)`` factor ``X = Y * exp(gamma_r - gamma_s)``
gives ``dgamma_r += dX * X`` and ``dgamma_s -= dX * X``. Summed up::

    dgamma  = rowsum(dQ_g * Q)                              (dQ_g = exp(gamma) * (dO S^T))
            + rowsum(M) - colsum(M)        M = dP * P
            + rowsum(M2) - colsum(M2)      M2 = beta * dA * G
            - rowsum(dKd * Kd)             dKd = V' dS'^T
            + beta exp(gamma) rowsum(dKb * K)
    dgamma_C += sum(dKd * Kd) + exp(gamma_C) sum(dS' * S)
    dg = reverse cumsum of dgamma within each chunk.

Matmuls sharing an operand are merged: with ``X = [dO; dVb]`` (``2C x V``), ``X S^T``
gives ``dO S^T`` and ``-dKb``, ``X V'^T`` gives ``dP`` and ``-dA``; with the stacked
``[Q; K]`` of the forward, ``dK = [(dP * Gamma)^T | dB + dB^T] [Q; K] + ...`` is one matmul.

Then the chunk layout is undone (padding dropped, q/k gradients of the value heads summed
onto their shared q/k head), ``dq`` is multiplied by ``scale``, and the l2norm backward
``dx = r (dy - y (y . dy))`` (``y = x r``, ``r = (|x|^2 + eps)^-1/2``) applies when asked.
Everything runs in float32 (float64 for float64 inputs); gradients come back in the dtype of
their inputs.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._gating import activate_call, gating_backward
from torch_gdr._layout import GdrCall
from torch_gdr.ops.torch.chunk_layout import ChunkLayout, Span, layout_for_call
from torch_gdr.ops.torch.chunk_states import ChunkStates
from torch_gdr.ops.torch.segment import Segment, Workspace, batched, bmm, load_segment, state_scan
from torch_gdr.ops.torch.utils import lower_mask

Tensor = torch.Tensor


def chunk_gated_delta_rule_bwd(
    call: GdrCall,
    grad_o: Tensor,
    grad_final_state: Optional[Tensor],
    chunk_states: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Gradients of :func:`torch_gdr.ops.torch.chunk.chunk_gated_delta_rule_fwd` for ``call``.

    Args:
        call: the forward's call in the canonical layout.
        grad_o: ``[B, T, HV, V]``, the gradient on ``o``.
        grad_final_state: ``[N, HV, K, V]`` key-first, or None (no gradient on the final state).
        chunk_states: the state entering every chunk as saved by the forward
            (``chunk_gated_delta_rule_fwd(call, save_states=True)[2]``), or None to recompute
            them (pass 1).

    Returns:
        ``(dq, dk, dv, dg, dbeta, d_initial_state)``, each in the shape and dtype of its input;
        ``d_initial_state`` is None when ``call.initial_state`` is None.
    """
    q, k, v, g, beta, scale = call.q, call.k, call.v, call.g, call.beta, call.scale
    initial_state, use_qk_l2norm_in_kernel = call.initial_state, call.use_qk_l2norm
    layout = layout_for_call(v, call.offsets, call.chunk_size)
    head_k_dim, head_v_dim = q.shape[-1], v.shape[-1]

    ws = Workspace(layout)
    if chunk_states is not None:
        states = ChunkStates(layout, initial_state, head_k_dim, head_v_dim, keep=True, storage=chunk_states)
    else:  # Pass 1: the state entering every chunk.
        states = ChunkStates(layout, initial_state, head_k_dim, head_v_dim, keep=True)
        for i, span in enumerate(layout.segments()):
            seg = load_segment(layout, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, span, ws, states_only=True)
            state_scan(seg, states.scan_slots(i))
            states.hand_over(i)
            del seg

    # Pass 2: segments in reverse, carrying dS.
    grads = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v, g, beta))
    state_shape = (layout.num_matrices, head_k_dim, head_v_dim)
    carry = torch.zeros(state_shape, dtype=layout.dtype, device=layout.device) if grad_final_state is None else (
        layout.sort_states(grad_final_state.to(layout.dtype)).reshape(state_shape).clone())
    for i, span in reversed(list(enumerate(layout.segments()))):
        seg = load_segment(layout, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, span, ws)
        d_states = ws("d_states", span.num + 1, head_k_dim, head_v_dim)
        _segment_backward(layout, seg, grad_o, states.block(i), d_states,
                          carry[span.matrices(layout.num_v_heads)], scale, grads, span, ws)
        del seg
    d_initial = None
    if initial_state is not None:
        d_initial = layout.unsort_states(carry.view(initial_state.shape)).to(initial_state.dtype)
    return grads + (d_initial,)


def raw_call_backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor]
                      ) -> tuple[Optional[Tensor], ...]:
    """:func:`chunk_gated_delta_rule_bwd` for a call that may hold raw g and beta (fla's
    activation arguments, :mod:`torch_gdr._gating`): the activations in torch first, their
    chain rule after. The fallback of a backend whose kernels apply the activations.

    Returns:
        ``(dq, dk, dv, dg, dbeta, d_initial_state)``, then ``(dA_log, ddt_bias)`` (each None
        where absent) when the call is gated; dg and dbeta are the raw inputs' gradients.
    """
    grads = list(chunk_gated_delta_rule_bwd(activate_call(call), grad_o, grad_final_state, None))
    if call.gated:
        grads[3], grads[4], d_a_log, d_dt_bias = gating_backward(call, grads[3], grads[4])
        grads += [d_a_log, d_dt_bias]
    return tuple(grads)


def _segment_backward(layout: ChunkLayout, seg: Segment, grad_o: Tensor, s_in: Tensor, d_states: Tensor,
                      carry: Tensor, scale: float, grads: tuple[Tensor, ...], span: Span, ws: Workspace) -> None:
    """Backward of ``span``: ``s_in [G, nh, K, V]`` the states entering its chunks,
    ``d_states [G + 1, nh, K, V]`` scratch, ``carry [nh, K, V]`` (a view) the gradient
    w.r.t. the state leaving the span on entry and entering it on return; writes the span's
    tokens of ``grads = (dq, dk, dv, dg, dbeta)``."""
    num, c = span.num, layout.chunk_size
    head_v_dim = seg.v.shape[-1]
    query, key, gamma_exp = seg.query, seg.key, seg.gamma_exp

    # V' = U - W S over U, one batched matmul now that the states are known.
    v_new = seg.u
    batched(v_new).baddbmm_(batched(seg.w), batched(s_in), alpha=-1)

    # Reverse walk: dV' = P^T dO + Kd dS',  dS = exp(gamma_C) dS' + Qg^T dO - W^T dV'.
    head_k_dim = key.shape[-1]
    xo = ws("xo", num, 2 * c, head_v_dim)
    do, dvb = xo[:, :, :c], xo[:, :, c:]  # X = [dO; dVb]
    layout.load(grad_o, span, out=do)
    dv_new = bmm(seg.attn.mT, do, out=ws("dv_new", num, c, head_v_dim))
    d_states[num].copy_(carry)
    q_decayed = torch.mul(query, (gamma_exp * scale)[..., None], out=ws("q_decayed", num, c, head_k_dim))
    bmm(q_decayed.mT, do, out=d_states[:num])
    chunk_decay, k_decayed, w = seg.chunk_decay, seg.k_decayed, seg.w
    for i in range(num - 1, -1, -1):
        dv_new[i].baddbmm_(k_decayed[i], d_states[i + 1])
        d_states[i].addcmul_(d_states[i + 1], chunk_decay[i])
        d_states[i].baddbmm_(w[i].mT, dv_new[i], alpha=-1)
    carry.copy_(d_states[0])
    ds_out = d_states[1:]

    # dVb = T^T dV';  X S^T = [dO S^T; -dKb];  X V'^T = [dP; -dA]
    bmm(seg.inverse.mT, dv_new, out=dvb)
    xs = bmm(xo, s_in.mT, out=ws("xs", num, 2 * c, head_k_dim))
    xv = bmm(xo, v_new.mT, out=ws("xv", num, 2 * c, c))

    # O = Qg S + P V'  (gradients w.r.t. the scaled query q^ = scale y_q)
    dq_g = xs[:, :, :c].mul_(gamma_exp[..., None])
    dgamma = (dq_g * query).sum(-1).mul_(scale)
    dp = xv[:, :, :c]
    m = dp * seg.attn
    dgamma += m.sum(-1) - m.sum(-2)
    del m
    dp.mul_(seg.decay)
    # (into a contiguous buffer: an in-place baddbmm_ on the strided rows of xs would run
    # one matmul per matrix)
    dq = bmm(dp, key, out=ws("dq", num, c, key.shape[-1]))
    dq += dq_g

    # dK = [scale (dP Gamma)^T | dB + dB^T] [y_q; K] + ...
    lhs = ws("lhs", num, c, 2 * c)
    torch.mul(dp.mT, scale, out=lhs[..., :c])
    da = xv[:, :, c:].mul_(lower_mask(c, layout.device, layout.dtype, strict=True)).neg_()  # dA
    dbeta = (dvb * seg.v).sum(-1)
    dbeta += (da * seg.gram).sum(-1)
    da.mul_(seg.beta[..., None])  # dG
    m2 = da * seg.gram
    dgamma += m2.sum(-1) - m2.sum(-2)
    del m2
    da.mul_(seg.decay)  # dB, the gradient of K K^T
    torch.add(da, da.mT, out=lhs[..., c:])
    dk = bmm(lhs, seg.qk, out=ws("scratch_ck", num, c, head_k_dim))  # the U/W scratch is dead
    del lhs, xv

    # Kb = beta exp(gamma) K   (-dKb = dVb S^T)
    neg_dkb = xs[:, :, c:]
    s_kb = (neg_dkb * key).sum(-1).neg_()  # rowsum(dKb * K)
    beta_exp = seg.beta * gamma_exp
    dbeta.addcmul_(gamma_exp, s_kb)
    dgamma.addcmul_(beta_exp, s_kb)
    dk.addcmul_(neg_dkb, beta_exp[..., None], value=-1)

    # S' = exp(gamma_C) S + Kd^T V'
    dk_decayed = bmm(v_new, ds_out.mT, out=ws("q_decayed", num, c, head_k_dim))  # q_decayed is dead here
    t = (dk_decayed * k_decayed).sum(-1)
    dgamma -= t
    dgamma[..., -1] += t.sum(-1) + gamma_exp[..., -1] * (ds_out * s_in).sum((-2, -1))
    dk.addcmul_(dk_decayed, seg.k_scale[..., None])
    del dk_decayed, t

    dv = dvb.mul_(seg.beta[..., None])
    dg = dgamma.flip(-1).cumsum(-1).flip(-1)  # gamma = cumsum(g) within the chunk
    dq.mul_(scale)
    if seg.rnorm is not None:  # y = x r: dx = r (dy - y (y . dy))
        r_q, r_k = seg.rnorm[:, :, :c], seg.rnorm[:, :, c:]
        dq.sub_(query * (query * dq).sum(-1, keepdim=True)).mul_(r_q)
        dk.sub_(key * (key * dk).sum(-1, keepdim=True)).mul_(r_k)
    for grad, value in zip(grads, (dq, dk, dv, dg, dbeta)):
        layout.store(grad, value, span)
