"""The public op ``torch.ops.gdr.chunked_gated_delta_rule`` and its backward op.

Its body checks its arguments and runs the backend :func:`~torch_gdr.dispatch.registry.select`
picks, as the public function does; its autograd saves only the inputs, and its backward op
``gdr::chunked_gated_delta_rule_backward`` picks the backward op of the backend serving the
same call with gradients, which recomputes the chunk states (leaner and slower than the
public function, whose forward keeps them).

Schema notes: ``torch.library`` allows neither keyword-only tensor arguments nor an optional
tensor among the outputs, so the op takes every argument positionally or by name (the names
and order of :func:`torch_gdr.chunk_gated_delta_rule`) and returns an empty tensor where
there is no final state.
"""

from __future__ import annotations

import torch

from torch_gdr._fallback import strict_mode
from torch_gdr._gating import check_gating
from torch_gdr._validate import check_inputs
from torch_gdr.dispatch.registry import select
from torch_gdr.dispatch.run import run_chunk
from torch_gdr.ops._backend import CallSpec, OpArgs
from torch_gdr.ops._define import BACKWARD_SCHEMA, PUBLIC_SCHEMA, fake_backward, fake_outputs, register_autograd

Tensor = torch.Tensor


def _public_op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False,
               use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
               allow_neg_eigval=False):
    """Chunked gated delta rule; see :func:`torch_gdr.chunk_gated_delta_rule` for the
    arguments (fla's activation arguments last). Returns ``o`` (layout of v, dtype of v) and
    the final state (float32, or float64 for float64 inputs), or an empty tensor when
    ``output_final_state`` is False."""
    _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first, use_gate_in_kernel, A_log,
           dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    args = OpArgs(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                  chunk_size, state_v_first, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                  allow_neg_eigval)
    return run_chunk(args, False)


def _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first, use_gate_in_kernel, A_log,
           dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval) -> None:
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    check_gating(v.shape[-2], q.device, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)


def _public_fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False,
                 use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False):
    _check(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first, use_gate_in_kernel, A_log,
           dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return fake_outputs(q, v, output_final_state, cu_seqlens, state_v_first)


def _public_backward(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                     cu_seqlens, chunk_size, state_v_first, chunk_states=None, strict=False, use_gate_in_kernel=False,
                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    """The backward op of the backend serving the forward's call with gradients."""
    selection = select(CallSpec.of("chunk", q, v, chunk_size, True))
    return selection.backend.backward_op(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state,
                                         use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first, None,
                                         selection.named or strict_mode(), use_gate_in_kernel, A_log, dt_bias,
                                         use_beta_sigmoid_in_kernel, allow_neg_eigval)


chunked_gated_delta_rule = torch.library.custom_op("gdr::chunked_gated_delta_rule", _public_op, mutates_args=(),
                                                   schema=PUBLIC_SCHEMA)
chunked_gated_delta_rule.register_fake(_public_fake)
chunked_gated_delta_rule_backward = torch.library.custom_op(
    "gdr::chunked_gated_delta_rule_backward", _public_backward, mutates_args=(), schema=BACKWARD_SCHEMA)
chunked_gated_delta_rule_backward.register_fake(fake_backward)
register_autograd(chunked_gated_delta_rule, chunked_gated_delta_rule_backward)
