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

The computation in the canonical layout: :func:`fused_recurrent_fwd`, the ``"torch"``
backend's step (``torch_gdr.fused_recurrent_gated_delta_rule`` checks the arguments).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torch_gdr.ops.torch.utils import L2NORM_EPS

Tensor = torch.Tensor


def compute_dtype(q: Tensor, v: Tensor) -> torch.dtype:
    """float64 when q/k or v is float64, else float32 (the state's dtype too)."""
    return torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32


class _Padding:
    """Packed sequences ``[1, T, ...]`` as a batch ``[N, L, ...]``, L the longest length.

    ``valid [N, L]`` marks real tokens; it is None when every sequence has length L, and
    then :meth:`pad` returns views (the common decode batch ``cu_seqlens = [0, 1, ..., N]``).
    """

    def __init__(self, offsets: Sequence[int], num_tokens: int, device: torch.device) -> None:
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
    # v as [N, HV, V] (a view for any strides: packed q/k/v slices are not copied), predicted
    # split to match; the difference is this call's contiguous tensor
    rows = v.squeeze(1)
    update = torch.sub(rows.to(state.dtype), predicted.unflatten(0, rows.shape[:2])).view(nh, -1)
    update.mul_(beta.reshape(nh, 1))
    o = torch.addcmul(queried, torch.linalg.vecdot(key, query).unsqueeze_(-1), update)
    state.addcmul_(key.unsqueeze(-1), update.unsqueeze(1))
    return o, state


def fused_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                        initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool = False,
                        offsets: Optional[Sequence[int]] = None) -> tuple[Tensor, Tensor]:
    """The recurrence in the canonical layout, on a checked call.

    Args:
        q, k: ``[B, T, H, K]``, one float dtype.
        v: ``[B, T, HV, V]``, any float dtype.
        g, beta: ``[B, T, HV]``, any float dtype (g the raw per-token log decay).
        scale: multiplies q after the l2norm.
        initial_state: key-first ``[N, HV, K, V]`` (any strides, any float dtype) or None.
        use_qk_l2norm_in_kernel: replace q, k by ``x / sqrt(sum(x**2) + 1e-6)``.
        offsets: the ``N + 1`` offsets of packed sequences (B == 1) on the host, or None.

    Returns:
        ``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` in the compute
        dtype (float32, or float64). Never the caller's ``initial_state`` object itself.
    """
    dtype, out_dtype = compute_dtype(q, v), v.dtype
    head_k_dim, num_v_heads, head_v_dim = q.shape[-1], v.shape[2], v.shape[-1]
    group = num_v_heads // q.shape[2]
    kq = torch.stack([k, q], dim=-2)  # [N, L, H, 2, K]: rows key, query
    padding = None if offsets is None else _Padding(offsets, q.shape[1], q.device)
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
