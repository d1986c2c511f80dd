"""The one canonical layout every backend computes in, and the way back to the caller's.

Public layouts: batched ``[B, T, ...]`` or token-major ``[T, ...]`` (TND); state key-first
``[N, HV, K, V]`` or value-first ``[N, HV, V, K]`` (``state_v_first``). An op's
implementation turns its arguments into one :class:`GdrCall` (batched tensors, a key-first
state, int64 ``cu_seqlens`` on the inputs' device with its offsets read once on the host,
the scale resolved) and hands that object to the backend's raw functions; the results go
back through :meth:`GdrCall.public_outputs` and :meth:`GdrCall.public_grads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from torch_gdr._validate import read_cu_seqlens

Tensor = torch.Tensor


#: The epsilon of the in-kernel l2norm of q and k: ``x / sqrt(sum(x**2) + eps)`` (fla's).
L2NORM_EPS = 1e-6


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Accumulation and state dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_scale(head_k_dim: int) -> float:
    """The scale ``None`` stands for: ``K ** -0.5``."""
    return head_k_dim ** -0.5


@dataclass(frozen=True)
class GdrCall:
    """A checked call of the gated delta rule in the canonical layout.

    Attributes:
        q, k: ``[B, T, H, K]``.
        v: ``[B, T, HV, V]``.
        g, beta: ``[B, T, HV]``.
        initial_state: key-first ``[N, HV, K, V]`` in any float dtype, or None (zeros).
        cu_seqlens: ``[N + 1]`` int64 on the inputs' device, or None (B sequences of T).
        offsets: the values of ``cu_seqlens`` on the host (read once per call), or None.
        scale: the factor on q after the l2norm (resolved: never None).
        use_qk_l2norm: l2-normalise q and k first.
        chunk_size: tokens per chunk of the chunked algorithm.
        token_major: the caller passed ``[T, ...]`` tensors (no batch dim).
        state_v_first: the caller's states are value-first.
        use_gate_in_kernel: g holds the raw gate ``a``; the decay is
            ``-exp(A_log) * softplus(a + dt_bias)`` (:mod:`torch_gdr._gating`).
        A_log, dt_bias: ``[HV]`` float, with ``use_gate_in_kernel`` (dt_bias may be None).
        use_beta_sigmoid_in_kernel: beta holds logits; the op uses ``s * sigmoid(beta)``,
            ``s = 2`` with ``allow_neg_eigval``, else 1.
        allow_neg_eigval: see above.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    initial_state: Optional[Tensor]
    cu_seqlens: Optional[Tensor]
    offsets: Optional[tuple[int, ...]]
    scale: float
    use_qk_l2norm: bool
    chunk_size: int
    token_major: bool = False
    state_v_first: bool = False
    use_gate_in_kernel: bool = False
    A_log: Optional[Tensor] = None
    dt_bias: Optional[Tensor] = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False

    @property
    def gated(self) -> bool:
        """g or beta are raw: an activation is to be applied to one of them."""
        return self.use_gate_in_kernel or self.use_beta_sigmoid_in_kernel

    @property
    def num_seqs(self) -> int:
        """N: B, or the number of packed sequences."""
        return self.q.shape[0] if self.offsets is None else len(self.offsets) - 1

    @property
    def seq_lens(self) -> list[int]:
        """The length of every sequence."""
        if self.offsets is None:
            return [self.q.shape[1]] * self.q.shape[0]
        return [b - a for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """Key-first ``(N, HV, K, V)``."""
        return (self.num_seqs, self.v.shape[2], self.q.shape[-1], self.v.shape[-1])

    def public_outputs(self, o: Tensor, final_state: Tensor, *, may_alias: bool = True) -> tuple[Tensor, Tensor]:
        """``o`` and the final state from the canonical layout into the caller's: contiguous,
        and never the caller's own initial state tensor (a call in which no token ran).
        ``may_alias=False``: the final state is known to be a new tensor (an op's output),
        which skips the storage check (``torch.compile`` cannot trace it)."""
        if self.token_major:
            o = o.squeeze(0)
        if may_alias and self.initial_state is not None and _shares_storage(final_state, self.initial_state):
            final_state = final_state.clone()
        return o.contiguous(), self.public_state(final_state).contiguous()

    def public_state(self, state: Tensor) -> Tensor:
        """A key-first state in the caller's orientation (a view)."""
        return state.transpose(-1, -2) if self.state_v_first else state

    def canonical_state(self, state: Optional[Tensor]) -> Optional[Tensor]:
        """A state in the caller's orientation as a key-first one (a view); None stays None."""
        if state is None:
            return None
        return state.transpose(-1, -2) if self.state_v_first else state

    def canonical_tokens(self, x: Tensor) -> Tensor:
        """A per-token tensor of the caller (e.g. ``grad_o``) in the batched layout."""
        return x.unsqueeze(0) if self.token_major else x

    def public_grads(self, dq: Tensor, dk: Tensor, dv: Tensor, dg: Tensor, dbeta: Tensor,
                     d_initial_state: Optional[Tensor], d_A_log: Optional[Tensor] = None,
                     d_dt_bias: Optional[Tensor] = None) -> tuple[Tensor, ...]:
        """Gradients from the canonical layout into the layouts of their inputs, ``(dq, dk,
        dv, dg, dbeta, d_initial_state, dA_log, ddt_bias)``; an absent one (no initial
        state, no ``A_log``, no ``dt_bias``) becomes an empty tensor (an op cannot return None)."""
        grads = [dq, dk, dv, dg, dbeta]
        if self.token_major:
            grads = [t.squeeze(0) for t in grads]
        if d_initial_state is None:
            d_initial = dq.new_empty(0)
        else:
            d_initial = self.public_state(d_initial_state).contiguous()
        heads = tuple(dq.new_empty(0) if d is None else d.contiguous() for d in (d_A_log, d_dt_bias))
        return tuple(t.contiguous() for t in grads) + (d_initial,) + heads


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def canonical_call(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                   initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor],
                   chunk_size: int, state_v_first: bool, use_gate_in_kernel: bool = False,
                   A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                   use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False) -> GdrCall:
    """The :class:`GdrCall` of an op's arguments (already checked by
    :func:`torch_gdr._validate.check_inputs` and :func:`torch_gdr._gating.check_gating`).
    Reads ``cu_seqlens`` once, checking its values."""
    token_major = q.dim() == 3
    if token_major:
        q, k, v, g, beta = (t.unsqueeze(0) for t in (q, k, v, g, beta))
    offsets = None
    if cu_seqlens is not None:
        offsets = read_cu_seqlens(cu_seqlens, q.shape[1])
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int64)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    return GdrCall(q, k, v, g, beta, initial_state, cu_seqlens, offsets,
                   default_scale(q.shape[-1]) if scale is None else float(scale), bool(use_qk_l2norm_in_kernel),
                   int(chunk_size), token_major, bool(state_v_first), bool(use_gate_in_kernel), A_log, dt_bias,
                   bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval))
