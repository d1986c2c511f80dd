"""The ``"torch"`` backend's ops.

``gdr::_torch_fwd`` runs :func:`~torch_gdr.ops.torch.chunk.chunk_gated_delta_rule_fwd`; with
``save_chunk_states`` it also returns the state entering every chunk, which
``gdr::_torch_bwd`` then reads instead of recomputing (what the public call does in
training, eager or compiled). Their number follows the chunks of the call: for
``cu_seqlens`` calls that depends on its values, so the fake gives a data-dependent size.
fla's gate and beta activations: the forward op applies them in torch and the backward op
their chain rule (:mod:`torch_gdr._gating`, through :mod:`torch_gdr.ops._define`); the step
gets the activated values as differentiable torch (:func:`torch_gdr.dispatch.run.run_step`).
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import GdrCall
from torch_gdr.ops._define import define_backend, define_backward_op
from torch_gdr.ops.torch.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ops.torch.chunk_backward import chunk_gated_delta_rule_bwd
from torch_gdr.ops.torch.fused_recurrent import fused_recurrent_fwd

Tensor = torch.Tensor


def _states_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int,
                  use_qk_l2norm: bool) -> list[Optional[int]]:
    """The chunk states, ``[rows, K, V]``: ``rows = B * ceil(T / C) * HV`` for batched calls;
    with ``cu_seqlens`` a size known only once the op has run (it follows the lengths, and
    the segments: a segment stores the states of every sequence active at its first chunk)."""
    rows = None
    if cu_seqlens is None:
        batch_size, seq_len = (1, v.shape[0]) if v.dim() == 3 else (v.shape[0], v.shape[1])
        rows = batch_size * (-(-seq_len // chunk_size)) * v.shape[-2]
    return [rows, q.shape[-1], v.shape[-1]]


def _backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor], chunk_states: Optional[Tensor],
              strict: bool) -> tuple[Optional[Tensor], ...]:
    return chunk_gated_delta_rule_bwd(call, grad_o, grad_final_state, chunk_states)


def torch_step(call: GdrCall) -> tuple[Tensor, Tensor]:
    """The token-by-token call in plain (differentiable) torch, canonical layout."""
    return fused_recurrent_fwd(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                               call.use_qk_l2norm, call.offsets)


torch_bwd = define_backward_op("gdr::_torch_bwd", _backward)
torch_fwd = define_backend("torch", chunk_gated_delta_rule_fwd, torch_bwd, _states_shape)
