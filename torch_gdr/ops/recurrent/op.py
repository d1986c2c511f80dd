"""``gdr::_recurrent_fwd`` / ``gdr::_recurrent_bwd``: the per-token recurrence (the
definition, :mod:`torch_gdr.ref.naive`) and its reverse recurrence, as a backend's ops;
fla's gate and beta activations applied in torch before them and their chain rule after
(:mod:`torch_gdr._gating`, through :mod:`torch_gdr.ops._define`)."""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import GdrCall
from torch_gdr.ops._define import define_backend, define_backward_op
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule_bwd

Tensor = torch.Tensor


def _host_offsets(call: GdrCall) -> Optional[Tensor]:
    """The call's offsets as a CPU tensor: the recurrence reads them without another sync."""
    return None if call.offsets is None else torch.tensor(call.offsets)


def _forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, None]:
    o, final_state = naive_recurrent_gated_delta_rule(call.q, call.k, call.v, call.g, call.beta, call.scale,
                                                      call.initial_state, True, call.use_qk_l2norm,
                                                      _host_offsets(call))
    return o, final_state, None


def _backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor], chunk_states: Optional[Tensor],
              strict: bool) -> tuple[Optional[Tensor], ...]:
    return naive_recurrent_gated_delta_rule_bwd(grad_o, grad_final_state, call.q, call.k, call.v, call.g, call.beta,
                                                call.scale, call.initial_state, call.use_qk_l2norm,
                                                _host_offsets(call))


recurrent_bwd = define_backward_op("gdr::_recurrent_bwd", _backward)
recurrent_fwd = define_backend("recurrent", _forward, recurrent_bwd)


def recurrent_step(call: GdrCall) -> tuple[Tensor, Tensor]:
    """The step entry: the forward op itself (differentiable through its registered autograd),
    on the canonical layout."""
    o, final_state, _ = recurrent_fwd(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                                      True, call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, False)
    return o, final_state
