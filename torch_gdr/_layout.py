"""Moves a call between the public layouts and the one every backend computes in.

Public layouts: batched ``[B, T, ...]`` or token-major ``[T, ...]`` (TND); state
key-first ``[N, HV, K, V]`` or value-first ``[N, HV, V, K]`` (``state_v_first``).
Backends see batched tensors, a key-first state and int64 ``cu_seqlens`` on the
inputs' device, and always return the final state.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch


class ForwardFn(Protocol):
    """A backend's forward in the canonical layout; returns ``(o, final_state)``, possibly
    followed by layout-free extras (passed through as they are)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: Optional[float], initial_state: Optional[torch.Tensor], output_final_state: bool,
                 use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[torch.Tensor],
                 chunk_size: int) -> tuple[torch.Tensor, ...]: ...


def run_in_canonical_layout(
    forward: ForwardFn,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Optional[torch.Tensor],
    chunk_size: int,
    state_v_first: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``forward`` on a checked call in any public layout; return ``(o, final_state)``
    with ``o`` in the layout of ``v`` and the final state in the layout of the call, then any
    further outputs of ``forward`` unchanged (e.g. the chunk states kept for a backward)."""
    token_major = q.dim() == 3
    if token_major:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, final_state, *extras = forward(q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel,
                                      cu_seqlens, chunk_size)
    assert final_state is not None
    if token_major:
        o = o.squeeze(0)
    if state_v_first:
        final_state = final_state.transpose(-1, -2)
    if initial_state is not None and _shares_storage(final_state, initial_state):
        # No token ran (every sequence empty): never hand the caller's tensor back as a result.
        final_state = final_state.clone()
    return (o.contiguous(), final_state.contiguous(), *extras)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def run_backward_in_canonical_layout(
    backward,
    grad_o: torch.Tensor,
    grad_final_state: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Optional[torch.Tensor],
    chunk_size: int,
    state_v_first: bool,
) -> tuple[torch.Tensor, ...]:
    """Run a backend's ``backward`` (batched layout, key-first states, returning
    ``(dq, dk, dv, dg, dbeta, d_initial_state or None)``) on a call in any public layout;
    the gradients come back in the layouts of their inputs."""
    token_major = q.dim() == 3
    if token_major:
        grad_o, q, k, v, g, beta = (t.unsqueeze(0) for t in (grad_o, q, k, v, g, beta))
    if state_v_first:
        if initial_state is not None:
            initial_state = initial_state.transpose(-1, -2)
        if grad_final_state is not None:
            grad_final_state = grad_final_state.transpose(-1, -2)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dq, dk, dv, dg, dbeta, d_initial = backward(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state,
                                                use_qk_l2norm_in_kernel, cu_seqlens, chunk_size)
    grads = [dq, dk, dv, dg, dbeta]
    if token_major:
        grads = [t.squeeze(0) for t in grads]
    if d_initial is not None and state_v_first:
        d_initial = d_initial.transpose(-1, -2)
    return tuple(t.contiguous() for t in grads) + (None if d_initial is None else d_initial.contiguous(),)
