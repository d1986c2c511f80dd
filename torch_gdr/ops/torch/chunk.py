"""The chunked gated delta rule in pure torch: the fast path on CPUs and GPUs.

Each sequence is cut into chunks of ``C`` tokens. With ``gamma`` the cumulative sum of
``g`` restarting at every chunk and ``Gamma[r, s] = exp(gamma_r - gamma_s)`` for
``r >= s`` (0 above the diagonal, masked before the exp so it cannot overflow)::

    A  = strictly_lower(diag(beta) K K^T * Gamma)
    U  = (I + A)^-1 (beta * V)          W = (I + A)^-1 (beta * exp(gamma) * K)
    V' = U - W S                        S: the state entering the chunk
    O  = (exp(gamma) * Q) S + (Q K^T * Gamma) V'
    S <- exp(gamma_C) S + (exp(gamma_C - gamma) * K)^T V'

The call is processed a *segment* of ``G`` chunks at a time (all heads of the sequences
still running at once, chunk-major ``[G, nh, C, D]``, see
:mod:`torch_gdr.ops.torch.chunk_layout` and :mod:`torch_gdr.ops.torch.segment`): temporaries stay
O(segment) whatever T is, and every parallel step is one batched matmul over the
``G * nh`` chunk matrices of the segment. Only the state recurrence loops over chunks,
writing into the segment's block of states (:mod:`torch_gdr.ops.torch.chunk_states`; no
per-chunk copies).
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import GdrCall
from torch_gdr.ops.torch.chunk_layout import layout_for_call
from torch_gdr.ops.torch.chunk_states import ChunkStates
from torch_gdr.ops.torch.nonfinite import contained
from torch_gdr.ops.torch.segment import Workspace, batched, bmm, load_segment, state_scan

Tensor = torch.Tensor


def chunk_gated_delta_rule_fwd(call: GdrCall, save_states: bool = False) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The chunked forward (no autograd) of a call in the canonical layout.

    Returns:
        ``o [B, T, HV, V]`` in the dtype of v; the final state ``[N, HV, K, V]`` key-first
        in float32 (float64 for float64 inputs); with ``save_states``, the state entering
        every chunk (the storage of a :class:`~torch_gdr.ops.torch.chunk_states.ChunkStates`,
        ``[rows, K, V]``), what :func:`torch_gdr.ops.torch.chunk_backward.chunk_gated_delta_rule_bwd`
        takes as ``chunk_states`` instead of recomputing them; else None.
    """
    # a NaN or inf in k, v, g or beta: kept where the recurrence keeps it
    return contained(_chunked_forward, call, save_states)


def _chunked_forward(call: GdrCall, save_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    q, k, v, g, beta, scale = call.q, call.k, call.v, call.g, call.beta, call.scale
    layout = layout_for_call(v, call.offsets, call.chunk_size)
    head_k_dim, head_v_dim = q.shape[-1], v.shape[-1]
    states = ChunkStates(layout, call.initial_state, head_k_dim, head_v_dim, keep=save_states)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    ws = Workspace(layout)
    for i, span in enumerate(layout.segments()):
        seg = load_segment(layout, q, k, v, g, beta, scale, call.use_qk_l2norm, span, ws, scale_attn=False)
        num = span.num
        state_scan(seg, states.scan_slots(i))
        q_decayed = seg.query.mul_((seg.gamma_exp * scale)[..., None])  # the query is spent: in place
        out = bmm(q_decayed, states.block(i), out=ws("o", num, seg.query.shape[2], head_v_dim))
        batched(out).baddbmm_(batched(seg.attn), batched(seg.u), alpha=scale)  # attn is unscaled
        layout.store(o, out, span)
        states.hand_over(i)
    final_shape = (layout.num_seqs, layout.num_v_heads, head_k_dim, head_v_dim)
    final_state = layout.unsort_states(states.final.view(final_shape))
    return o, final_state, (states.storage if save_states else None)
