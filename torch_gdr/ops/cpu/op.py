"""The ``"cpu"`` backend's ops: the fused C++ kernels as ``torch.library`` ops.

The schemas and fakes are defined here in Python, and the C++ functions are their
implementations, so the ops exist (and trace under ``torch.compile``) before the extension
is built, or where it cannot be: calling one then raises with the reason, and dispatch never
picks the backend there (:mod:`.backend`).

- ``gdr::_cpu_fwd`` / ``gdr::_cpu_bwd``: the chunked forward (with ``save_chunk_states``
  the state entering every chunk, ``[total_chunks, HV, K, V]`` float32) and its backward
  from those states;
- ``gdr::_cpu_step``: the token-by-token recurrence (decode), inference only.

All three take fla's activation arguments and apply them in the kernels (raw gate, beta
logits: :mod:`torch_gdr._gating`); the backward returns the raw inputs' gradients and those
of ``A_log`` and ``dt_bias``, summed in the kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._gating import Gating, gating_of
from torch_gdr._layout import GdrCall
from torch_gdr.ops._define import define_backend, define_backward_op, define_step_op
from torch_gdr.ops.cpu import kernels
from torch_gdr.ops.torch.nonfinite import contained

Tensor = torch.Tensor


def _forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The fused forward; a NaN or inf spreads as in the recurrence (:mod:`~torch_gdr.ops.torch.nonfinite`).
    The kernels say whether any input was not finite: where none was, the outputs are left
    as they are, without contained's pass over them (at two threads ~12 ms for an 8 MiB o on
    a loaded 2-core machine, the time its second thread waited for a core; 0.7 ms at one)."""
    *outputs, inputs_finite = _kernel_forward_checked(call, save_chunk_states)
    if inputs_finite:
        return tuple(outputs)
    return contained(_kernel_forward, call, save_chunk_states, first=tuple(outputs))


def _kernel_forward_checked(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor], bool]:
    return kernels.chunk_fwd_checked(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                                     call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, save_chunk_states,
                                     gating_of(call))


def _kernel_forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    return _kernel_forward_checked(call, save_chunk_states)[:3]


def _backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor], chunk_states: Optional[Tensor],
              strict: bool) -> tuple[Optional[Tensor], ...]:
    return kernels.chunk_bwd(grad_o, grad_final_state, call.q, call.k, call.v, call.g, call.beta, call.scale,
                             call.initial_state, call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, chunk_states,
                             gating_of(call))


def _states_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int,
                  use_qk_l2norm: bool) -> list[Optional[int]]:
    """``[total_chunks, HV, K, V]``: ``B * ceil(T / C)`` chunks for batched calls; with
    ``cu_seqlens`` a count that follows its values (a data-dependent size in a fake)."""
    chunks = None
    if cu_seqlens is None:
        batch_size, seq_len = (1, v.shape[0]) if v.dim() == 3 else (v.shape[0], v.shape[1])
        chunks = batch_size * (-(-seq_len // chunk_size))
    return [chunks, v.shape[-2], q.shape[-1], v.shape[-1]]


cpu_bwd = define_backward_op("gdr::_cpu_bwd", _backward, in_kernel_gating=True)
cpu_fwd = define_backend("cpu", _forward, cpu_bwd, _states_shape, in_kernel_gating=True)


def _step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Optional[Tensor],
          use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], use_gate_in_kernel: bool = False,
          A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
          allow_neg_eigval: bool = False) -> tuple[Tensor, Tensor]:
    gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, final_state = kernels.recurrent_fwd(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                           cu_seqlens, gating=gating)
    if initial_state is not None and final_state.data_ptr() == initial_state.data_ptr():
        final_state = final_state.clone()  # an op's output may not alias its input
    return o, final_state


cpu_step_op = define_step_op("gdr::_cpu_step", _step)


def cpu_step(call: GdrCall) -> tuple[Tensor, Tensor]:
    """The step entry on a checked call in the canonical layout."""
    return cpu_step_op(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                       call.use_qk_l2norm, call.cu_seqlens, *gating_of(call))
