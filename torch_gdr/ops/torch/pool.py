"""The ``"torch"`` backend's decode step over a state pool, in place, in pure torch (any device).

The serving rules (checks, plans) are :mod:`torch_gdr._pool`'s; this module runs the
recurrence over the rows they name. Without ``cu_seqlens`` (B sequences of T tokens) the
step runs the sequences in lockstep with no host read outside the checking op (so it
compiles once for any batch); with ``cu_seqlens`` it runs token j of every sequence that
has one at once, from the plan's host offsets.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import L2NORM_EPS
from torch_gdr._pool import _flat_tokens, check_batched_decode, check_pool_args, pool_gather, pool_scatter

Tensor = torch.Tensor


def pool_recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                        pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None,
                        cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                        state_v_first: bool = False, validate: bool = True,
                        initial_state_indices: Optional[Tensor] = None) -> Tensor:
    """The decode step over a pool, in place, by the per-token recurrence in pure torch (any
    device): gather the rows the sequences start from, run their few tokens in lockstep
    (token j of every sequence that has one at once), and write each state to its row.

    Args:
        q, k: ``[B, T, H, K]`` (or token-major ``[T, H, K]``), any float dtype.
        v: ``[B, T, HV, V]`` (``[T, HV, V]``); g, beta: ``[B, T, HV]`` (``[T, HV]``).
        scale: factor on q after the l2norm; ``K ** -0.5`` when None.
        pool: the state pool, updated in place (module docstring).
        ssm_state_indices, num_accepted_tokens: vLLM's, see the module docstring.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (B must be 1), or None (B
            sequences of T tokens).
        use_qk_l2norm_in_kernel: l2-normalise q and k first.
        state_v_first: the pool is value-first.
        validate: check index values also when they live on a device.
        initial_state_indices: ``[N]`` rows the sequences start from instead of
            ``ssm_state_indices`` at ``num_accepted_tokens - 1`` (-1: zeros), or None.

    Returns:
        ``o`` in the shape of v and dtype of v. Computed in float32 (float64 for float64
        inputs); states rounded to the pool's dtype when stored.
    """
    if cu_seqlens is None:
        return _batched_recurrent_step(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                                       use_qk_l2norm_in_kernel, state_v_first, validate, initial_state_indices)
    plan = check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                           ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                           validate=validate, start_indices=initial_state_indices)
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    num_v_heads, head_k_dim = v.shape[-2], q.shape[-1]
    scale = head_k_dim ** -0.5 if scale is None else float(scale)
    qf, kf, vf, gf, bf = (_flat_tokens(t, plan.token_major).to(compute) for t in (q, k, v, g, beta))
    qf, kf = _step_queries_keys(qf, kf, num_v_heads, scale, use_qk_l2norm_in_kernel)
    o = torch.zeros(vf.shape, dtype=compute, device=v.device)

    indices = plan.indices
    state = pool_gather(pool, plan.start_rows, state_v_first).to(compute)
    for j in range(max(plan.seq_lens, default=0)):
        active = [n for n in range(plan.num_seqs) if plan.seq_lens[n] > j]
        seqs = torch.tensor(active, dtype=torch.int64, device=v.device)
        tokens = torch.tensor([plan.bos[n] + j for n in active], dtype=torch.int64, device=v.device)
        s = state.index_select(0, seqs) * gf[tokens].exp()[..., None, None]
        k_t = kf[tokens]
        u = bf[tokens][..., None] * (vf[tokens] - torch.einsum("nhkv,nhk->nhv", s, k_t))
        s = s + k_t[..., :, None] * u[..., None, :]
        o[tokens] = torch.einsum("nhkv,nhk->nhv", s, qf[tokens])
        state.index_copy_(0, seqs, s)
        pool_scatter(pool, indices[seqs, j], s, state_v_first)
    return o.to(v.dtype).reshape(v.shape)


def _step_queries_keys(qf: Tensor, kf: Tensor, num_v_heads: int, scale: float,
                       use_qk_l2norm_in_kernel: bool) -> tuple[Tensor, Tensor]:
    """q and k ``[..., H, K]`` (compute dtype) as the step reads them: l2-normalised where
    asked, repeated to the ``num_v_heads`` value heads, q times ``scale``."""
    if use_qk_l2norm_in_kernel:
        qf = qf * torch.rsqrt(qf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
        kf = kf * torch.rsqrt(kf.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    group = num_v_heads // qf.shape[-2]
    if group > 1:
        qf, kf = qf.repeat_interleave(group, dim=-2), kf.repeat_interleave(group, dim=-2)
    return qf * scale, kf


def _batched_recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                            pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                            use_qk_l2norm_in_kernel: bool, state_v_first: bool, validate: bool,
                            initial_state_indices: Optional[Tensor]) -> Tensor:
    """:func:`pool_recurrent_step` without ``cu_seqlens``: B sequences of T tokens run in
    lockstep, with no Python loop over the batch and no host read outside the checking op
    (:func:`check_batched_decode`), so a compiled step serves any batch size."""
    indices, read_rows = check_batched_decode(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                                              state_v_first=state_v_first, validate=validate,
                                              start_indices=initial_state_indices)
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    num_v_heads, head_k_dim = v.shape[-2], q.shape[-1]
    scale = head_k_dim ** -0.5 if scale is None else float(scale)
    lead = (1, q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[1])  # [N, T]
    qf, kf, vf, gf, bf = (t.reshape(*lead, *t.shape[(1 if q.dim() == 3 else 2):]).to(compute)
                          for t in (q, k, v, g, beta))
    qf, kf = _step_queries_keys(qf, kf, num_v_heads, scale, use_qk_l2norm_in_kernel)
    state = pool_gather(pool, read_rows, state_v_first).to(compute)  # [N, HV, K, V]
    outputs = []
    for j in range(lead[1]):
        state = state * gf[:, j].exp()[..., None, None]
        k_t = kf[:, j]
        u = bf[:, j][..., None] * (vf[:, j] - torch.einsum("nhkv,nhk->nhv", state, k_t))
        state = state + k_t[..., :, None] * u[..., None, :]
        outputs.append(torch.einsum("nhkv,nhk->nhv", state, qf[:, j]))
        pool_scatter(pool, indices[:, j], state, state_v_first)
    return torch.stack(outputs, 1).to(v.dtype).reshape(v.shape)
