"""The public op and the ops of the pure-torch backends.

- ``torch.ops.gdr.chunked_gated_delta_rule``: the public op. It checks its arguments and runs
  the chunked algorithm (:mod:`torch_gdr.ref.chunk`); its autograd saves only the inputs, so
  its backward recomputes the state entering every chunk. (On Ascend NPUs its device kernel
  is the PyPTO one, registered by :mod:`torch_gdr.ops.pypto.op`.)
- ``gdr::_torch_fwd`` / ``gdr::chunked_gated_delta_rule_backward``: the ``"torch"`` backend.
  With ``save_chunk_states`` the forward also returns the state entering every chunk, which
  the backward then reads instead of recomputing (what the public call does in training,
  eager or compiled). Their number follows the chunks of the call: for ``cu_seqlens`` calls
  that depends on its values, so the fake gives it as a data-dependent size.
- ``gdr::_recurrent_fwd`` / ``gdr::_recurrent_bwd``: the ``"recurrent"`` backend, the
  per-token recurrence (the definition) and its reverse recurrence, written out per token.

Schema notes: ``torch.library`` allows neither keyword-only tensor arguments nor an optional
tensor among the outputs, so the ops take every argument positionally or by name (the names
and order of :func:`torch_gdr.chunk_gated_delta_rule`) and return an empty tensor where
there is no final state or no chunk states.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import GdrCall
from torch_gdr._validate import check_inputs
from torch_gdr.ops.cpu import kernels as cpu_kernels
from torch_gdr.ops._define import (PUBLIC_SCHEMA, define_backend, define_backward_op, fake_outputs,
                                   register_autograd, run_forward)
from torch_gdr.ref.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ref.chunk_backward import chunk_gated_delta_rule_bwd
from torch_gdr.ref.nonfinite import contained
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule, naive_recurrent_gated_delta_rule_bwd

Tensor = torch.Tensor


def _torch_states_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int,
                        use_qk_l2norm: bool) -> list[Optional[int]]:
    """The ``"torch"`` backend's chunk states, ``[rows, K, V]``: ``rows = B * ceil(T / C) * HV``
    for batched calls; with ``cu_seqlens`` a size known only once the op has run (it follows
    the lengths, and the segments: a segment stores the states of every sequence active at
    its first chunk)."""
    rows = None
    if cu_seqlens is None:
        batch_size, seq_len = (1, v.shape[0]) if v.dim() == 3 else (v.shape[0], v.shape[1])
        rows = batch_size * (-(-seq_len // chunk_size)) * v.shape[-2]
    return [rows, q.shape[-1], v.shape[-1]]


def _fused_cpu_kernels_serve(call: GdrCall) -> bool:
    """Whether the fused C++ kernels (:mod:`torch_gdr.ops.cpu`) run this call: CPU tensors of
    float32/float16/bfloat16 with q and v of one dtype, and an extension that builds here
    (otherwise the pure-torch path, with one warning when it does not build). Forward and
    backward of a call decide alike, so their chunk states always match."""
    return (call.v.device.type == "cpu" and call.v.dtype in cpu_kernels.KERNEL_DTYPES and call.q.dtype == call.v.dtype
            and cpu_kernels.available())


def _torch_forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The ``"torch"`` backend's forward: the fused CPU kernels where they serve, else the
    pure-torch chunked algorithm. The kernels' chunk states ``[chunks, HV, K, V]`` travel as
    ``[chunks * HV, K, V]``, the pure-torch path's shape."""
    if not _fused_cpu_kernels_serve(call):
        return chunk_gated_delta_rule_fwd(call, save_chunk_states)
    o, final_state, states = contained(_fused_cpu_forward, call, save_chunk_states)
    return o, final_state, None if states is None else states.flatten(0, 1)


def _fused_cpu_forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    return cpu_kernels.chunk_fwd(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                                 call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, save_chunk_states)


def _torch_backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor],
                    chunk_states: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    """The ``"torch"`` backend's backward: the fused CPU kernels' where their forward ran."""
    if not _fused_cpu_kernels_serve(call):
        return chunk_gated_delta_rule_bwd(call, grad_o, grad_final_state, chunk_states)
    if chunk_states is not None:
        chunk_states = chunk_states.unflatten(0, (-1, call.v.shape[2]))
    return cpu_kernels.chunk_bwd(grad_o, grad_final_state, call.q, call.k, call.v, call.g, call.beta, call.scale,
                                 call.initial_state, call.use_qk_l2norm, call.cu_seqlens, call.chunk_size,
                                 chunk_states)


chunked_gated_delta_rule_backward = define_backward_op("gdr::chunked_gated_delta_rule_backward", _torch_backward)
torch_chunked_fwd = define_backend("torch", _torch_forward, chunked_gated_delta_rule_backward, _torch_states_shape)


def _host_offsets(call: GdrCall) -> Optional[Tensor]:
    """The call's offsets as a CPU tensor: the recurrence reads them without another sync."""
    return None if call.offsets is None else torch.tensor(call.offsets)


def _recurrent_forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, None]:
    o, final_state = naive_recurrent_gated_delta_rule(call.q, call.k, call.v, call.g, call.beta, call.scale,
                                                      call.initial_state, True, call.use_qk_l2norm,
                                                      _host_offsets(call))
    return o, final_state, None


def _recurrent_backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor],
                        chunk_states: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    return naive_recurrent_gated_delta_rule_bwd(grad_o, grad_final_state, call.q, call.k, call.v, call.g, call.beta,
                                                call.scale, call.initial_state, call.use_qk_l2norm,
                                                _host_offsets(call))


recurrent_bwd = define_backward_op("gdr::_recurrent_bwd", _recurrent_backward)
recurrent_fwd = define_backend("recurrent", _recurrent_forward, recurrent_bwd)


def _public_op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False):
    """Chunked gated delta rule; see :func:`torch_gdr.chunk_gated_delta_rule` for the
    arguments. Returns ``o`` (layout of v, dtype of v) and the final state (float32, or
    float64 for float64 inputs), or an empty tensor when ``output_final_state`` is False."""
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    o, final_state, _ = run_forward(_torch_forward, q, k, v, g, beta, scale, initial_state,
                                    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                                    state_v_first, False)
    return o, final_state


def _public_fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False):
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    return fake_outputs(q, v, output_final_state, cu_seqlens, state_v_first)


chunked_gated_delta_rule = torch.library.custom_op("gdr::chunked_gated_delta_rule", _public_op, mutates_args=(),
                                                   schema=PUBLIC_SCHEMA)
chunked_gated_delta_rule.register_fake(_public_fake)
register_autograd(chunked_gated_delta_rule, chunked_gated_delta_rule_backward)
