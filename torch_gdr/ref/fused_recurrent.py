"""The gated delta rule one token at a time, for decoding and short inputs: no chunks.

Per sequence and value head, with a key-first state ``S [K, V]``, ``a_t = exp(g_t)`` and
``y_t = scale * q_t``, a step is::

    S   <- a_t S                                  (a fresh tensor at the first step)
    (S^T k_t, S^T y_t) = S^T [k_t, y_t]          one bmm over the N * HV matrices
    u_t  = beta_t * (v_t - S^T k_t)
    o_t  = S^T y_t + (k_t . y_t) u_t              = S_new^T y_t
    S   <- S + k_t u_t^T                          (addcmul_, in place)

so the state is read from memory once, by the decay (the matmul reads it back from cache
right after), and ``o_t`` needs no second read of the new state. Everything is plain differentiable torch
(autograd runs through it; in place only where autograd is off). The compute dtype is
float32 (float64 when q, k or v is float64), whatever the input dtypes: q/k may come in
one float dtype and v in another (as fla's fused-recurrent kernel takes them), and o comes
back in v's dtype.

Public entry: :func:`fused_recurrent_gated_delta_rule` (fla's signature). The computation
in the canonical layout: :func:`fused_recurrent_fwd`.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import default_scale
from torch_gdr._validate import CHUNK_SIZES, check_inputs, read_cu_seqlens
from torch_gdr.ref.utils import L2NORM_EPS

Tensor = torch.Tensor


def compute_dtype(q: Tensor, v: Tensor) -> torch.dtype:
    """float64 when q/k or v is float64, else float32 (the state's dtype too)."""
    return torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32


class _Padding:
    """Packed sequences ``[1, T, ...]`` as a batch ``[N, L, ...]``, L the longest length.

    ``valid [N, L]`` marks real tokens; it is None when every sequence has length L, and
    then :meth:`pad` returns views (the common decode batch ``cu_seqlens = [0, 1, ..., N]``).
    """

    def __init__(self, cu_seqlens: Tensor, num_tokens: int, device: torch.device) -> None:
        offsets = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        self.num_seqs, self.longest = len(lengths), max(lengths, default=0)
        self.valid: Optional[Tensor] = None
        if any(n != self.longest for n in lengths):
            steps = torch.arange(self.longest, device=device)
            self.valid = steps < torch.tensor(lengths, device=device)[:, None]
            starts = torch.tensor(offsets[:-1], device=device)
            self.index = (starts[:, None] + steps).clamp_(max=max(num_tokens - 1, 0))

    def pad(self, x: Tensor) -> Tensor:
        if self.valid is None:
            return x.view((self.num_seqs, self.longest) + x.shape[2:])
        return x[0][self.index]

    def unpad(self, x: Tensor) -> Tensor:
        """``[N, L, ...]`` -> packed ``[1, T, ...]``."""
        return x.flatten(0, 1).unsqueeze(0) if self.valid is None else x[self.valid].unsqueeze(0)


def _single_step(kq: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, owned: bool, scale: float,
                 use_qk_l2norm_in_kernel: bool, group: int) -> tuple[Tensor, Tensor]:
    """One token of every sequence with autograd off: the decode step in as few ops as the
    math allows, in place wherever the tensor is this call's.

    kq: ``[N, 1, H, 2, K]`` this call's stack of k and q, in the compute dtype; v
    ``[N, 1, HV, V]``; g, beta ``[N, 1, HV]``; state ``[N * HV, K, V]`` in the compute
    dtype, the caller's (``owned`` False: not written) or this call's. Returns o
    ``[N * HV, V]`` and the new state, both in the compute dtype."""
    nh, head_k_dim = state.shape[:2]
    if use_qk_l2norm_in_kernel:
        kq.mul_(torch.linalg.vecdot(kq, kq).add_(L2NORM_EPS).rsqrt_().unsqueeze_(-1))
    kq[..., 1, :].mul_(scale)
    if group > 1:
        kq = kq.repeat_interleave(group, dim=2)
    kq = kq.view(nh, 2, head_k_dim)
    key, query = kq.unbind(1)
    decay = g.reshape(nh, 1, 1).to(state.dtype).exp()
    state = state.mul_(decay) if owned else torch.mul(state, decay)
    predicted, queried = torch.bmm(kq, state).unbind(1)  # (a S)^T k, (a S)^T y
    update = torch.sub(v.reshape(nh, -1).to(state.dtype), predicted).mul_(beta.reshape(nh, 1))
    o = torch.addcmul(queried, torch.linalg.vecdot(key, query).unsqueeze_(-1), update)
    state.addcmul_(key.unsqueeze(-1), update.unsqueeze(1))
    return o, state


def fused_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                        initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool = False,
                        cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The recurrence in the canonical layout, on a checked call.

    Args:
        q, k: ``[B, T, H, K]``, one float dtype.
        v: ``[B, T, HV, V]``, any float dtype.
        g, beta: ``[B, T, HV]``, any float dtype (g the raw per-token log decay).
        scale: multiplies q after the l2norm.
        initial_state: key-first ``[N, HV, K, V]`` (any strides, any float dtype) or None.
        use_qk_l2norm_in_kernel: replace q, k by ``x / sqrt(sum(x**2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B == 1), or None.

    Returns:
        ``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` in the compute
        dtype (float32, or float64). Never the caller's ``initial_state`` object itself.
    """
    dtype, out_dtype = compute_dtype(q, v), v.dtype
    head_k_dim, num_v_heads, head_v_dim = q.shape[-1], v.shape[2], v.shape[-1]
    group = num_v_heads // q.shape[2]
    kq = torch.stack([k, q], dim=-2)  # [N, L, H, 2, K]: rows key, query
    padding = None if cu_seqlens is None else _Padding(cu_seqlens, q.shape[1], q.device)
    if padding is not None:
        kq, v, g, beta = (padding.pad(x) for x in (kq, v, g, beta))
        if padding.valid is not None:  # padding: no decay, no write, so the state stays exact
            g, beta = g * padding.valid[..., None], beta * padding.valid[..., None]
    num_seqs, seq_len = kq.shape[:2]
    nh = num_seqs * num_v_heads
    tensors = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    kq = kq.to(dtype)

    if initial_state is None:
        state = torch.zeros(nh, head_k_dim, head_v_dim, dtype=dtype, device=v.device)
        owned = True
    else:
        state = initial_state.to(dtype).reshape(nh, head_k_dim, head_v_dim)
        owned = False  # may be (a view of) the caller's tensor: never written in place
    if seq_len == 1 and not grad:
        o, state = _single_step(kq, v, g, beta, state, owned, scale, use_qk_l2norm_in_kernel, group)
        o = o.view(num_seqs, 1, num_v_heads, head_v_dim).to(out_dtype)
        return (o if padding is None else padding.unpad(o)), state.view(num_seqs, num_v_heads, head_k_dim,
                                                                        head_v_dim)

    # Per-token operands, time-major so that step t reads contiguous [N * HV, ...] rows.
    if use_qk_l2norm_in_kernel:
        kq = kq * (kq * kq).sum(-1, keepdim=True).add_(L2NORM_EPS).rsqrt_()
    kq[..., 1, :].mul_(scale)  # y = scale * q, in place: kq is this call's stack, cast or product
    if group > 1:
        kq = kq.repeat_interleave(group, dim=2)

    def time_major(x: Tensor, *inner: int) -> Tensor:
        x = x.to(dtype)
        return x.reshape(seq_len, nh, *inner) if seq_len == 1 else x.transpose(0, 1).reshape(seq_len, nh, *inner)

    kq = time_major(kq, 2, head_k_dim)
    key_dot_query = torch.linalg.vecdot(kq[:, :, 0], kq[:, :, 1]).unsqueeze_(-1)  # [L, nh, 1]: k . y
    decay = time_major(g, 1).exp()
    beta = time_major(beta, 1)
    v_tm = time_major(v, head_v_dim)

    outputs = []
    o_tm = None if grad else torch.empty(seq_len, nh, head_v_dim, dtype=dtype, device=v.device)
    for t in range(seq_len):
        a, b, d = decay[t].unsqueeze(-1), beta[t], key_dot_query[t]  # [nh, 1, 1], [nh, 1], [nh, 1]
        key = kq[t, :, 0, :, None]  # [nh, K, 1]
        if grad:
            state = state * a
        else:  # the decay first, so that the matmul reads the state while it is in cache
            state = state.mul_(a) if owned else torch.mul(state, a)
        projected = torch.bmm(kq[t], state)  # [nh, 2, V]: (a S)^T k, (a S)^T y
        predicted, queried = projected[:, 0], projected[:, 1]
        if grad:
            update = (v_tm[t] - predicted) * b
            outputs.append(torch.addcmul(queried, d, update))
            state = torch.addcmul(state, key, update[:, None])
        else:
            update = torch.sub(v_tm[t], predicted).mul_(b)
            torch.addcmul(queried, d, update, out=o_tm[t])
            state.addcmul_(key, update[:, None])
        owned = True  # from here on a tensor of this call
    if grad:
        o_tm = torch.stack(outputs) if outputs else v_tm.new_zeros(0, nh, head_v_dim)
    o = o_tm.view(seq_len, num_seqs, num_v_heads, head_v_dim).transpose(0, 1).to(out_dtype)
    if padding is not None:
        o = padding.unpad(o)
    if not owned:  # no token ran: a fresh copy, never the caller's tensor
        state = state.clone()
    return o.contiguous(), state.view(num_seqs, num_v_heads, head_k_dim, head_v_dim)


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    state_v_first: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    r"""The gated delta rule token by token, a drop-in for
    ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` (decoding, short prompts).

    Runs on every device in plain torch and is differentiable (autograd through the steps;
    fla's own kernel has no backward). Cost grows with T one step at a time: for long
    inputs use :func:`torch_gdr.chunk_gated_delta_rule`.

    Args:
        q: queries ``[B, T, H, K]`` or token-major ``[T, H, K]``; a float dtype.
        k: keys, shape and dtype of q.
        v: values ``[B, T, HV, V]`` (``[T, HV, V]``), any float dtype (may differ from q's:
            everything is computed in float32, float64 when q or v is float64).
        g: per-token log decay ``[B, T, HV]``; None means no decay (fla's default).
        beta: write strengths ``[B, T, HV]``; None means ones (fla's default).
        scale: multiplies q (after the l2norm); ``K ** -0.5`` when None.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any
            float dtype; zeros when None. Never modified.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: replace q and k by ``x / sqrt(sum(x**2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of sequences packed along T (B == 1).
        state_v_first: states are value-first ``[N, HV, V, K]``.

    Positional order is fla's ``(q, k, v, g, beta, scale, initial_state,
    output_final_state)`` as in fla < 0.6 and :func:`torch_gdr.chunk_gated_delta_rule`;
    fla 0.6 inserted ``gk, gv`` before ``beta``, so code written for it passes ``beta`` by
    name, which works here too.

    Returns:
        ``o`` in the shape and dtype of v, and the final state (float32; float64 for
        float64 inputs) in the layout of ``initial_state``, or None unless
        ``output_final_state``.

    Raises:
        TypeError: non-tensor or non-floating inputs, q and k of different dtypes,
            non-integer ``cu_seqlens``.
        ValueError: wrong shapes, ranks, devices or ``cu_seqlens`` values.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    lead = tuple(v.shape[:-1])  # [B, T, HV] or [T, HV]
    if g is None:
        g = torch.zeros(lead, dtype=torch.float32, device=v.device)
    if beta is None:
        beta = torch.ones(lead, dtype=torch.float32, device=v.device)
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, CHUNK_SIZES[0], state_v_first)
    token_major = q.dim() == 3
    if token_major:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
    if cu_seqlens is not None:
        read_cu_seqlens(cu_seqlens, q.shape[1])
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    o, final_state = fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                         cu_seqlens)
    if token_major:
        o = o.squeeze(0)
    if not output_final_state:
        return o, None
    if state_v_first:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state
