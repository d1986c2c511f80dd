"""``torch.ops.gdr.chunked_gated_delta_rule``: the op, its fake and its autograd.

The default implementation runs the pure-torch chunked algorithm on any device. The
backward is an op of its own (``gdr::chunked_gated_delta_rule_backward``), so that
``torch.compile`` traces both as opaque nodes.

Schema notes: ``torch.library`` does not allow keyword-only tensor arguments, nor an
optional tensor in the outputs, so the op takes every argument positionally or by name
(same names and order as :func:`torch_gdr.chunk_gated_delta_rule`) and returns an empty
tensor as ``final_state`` when ``output_final_state`` is False.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from torch_gdr._layout import run_in_canonical_layout
from torch_gdr._validate import check_cu_seqlens_values, check_inputs
from torch_gdr.ref.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ref.utils import compute_dtype_for

Tensor = torch.Tensor

_DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state")


def _check_real(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], chunk_size: int,
                state_v_first: bool) -> None:
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    if cu_seqlens is not None:
        check_cu_seqlens_values(cu_seqlens, q.shape[-3])


def _final_state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], state_v_first: bool) -> list[int]:
    num_seqs = (cu_seqlens.shape[0] - 1 if cu_seqlens is not None else (1 if q.dim() == 3 else q.shape[0]))
    head_k_dim, (num_v_heads, head_v_dim) = q.shape[-1], v.shape[-2:]
    inner = [head_v_dim, head_k_dim] if state_v_first else [head_k_dim, head_v_dim]
    return [num_seqs, num_v_heads] + inner


@torch.library.custom_op("gdr::chunked_gated_delta_rule", mutates_args=())
def chunked_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor]:
    """Chunked gated delta rule; see :func:`torch_gdr.chunk_gated_delta_rule` for the
    arguments. Returns ``o`` (layout of v, dtype of v) and the final state (float32, or
    float64 for float64 inputs), or an empty tensor when ``output_final_state`` is False."""
    _check_real(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    o, final_state = run_in_canonical_layout(
        chunk_gated_delta_rule_fwd, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
        cu_seqlens, chunk_size, state_v_first)
    return o, (final_state if output_final_state else final_state.new_empty(0))


@chunked_gated_delta_rule.register_fake
def _(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
      cu_seqlens=None, chunk_size=64, state_v_first=False):
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    state_dtype = compute_dtype_for(v.dtype)
    shape = _final_state_shape(q, v, cu_seqlens, state_v_first) if output_final_state else [0]
    return v.new_empty(v.shape), v.new_empty(shape, dtype=state_dtype)


@torch.library.custom_op("gdr::chunked_gated_delta_rule_backward", mutates_args=())
def chunked_gated_delta_rule_backward(
    grad_o: Tensor,
    grad_final_state: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    initial_state: Optional[Tensor],
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Optional[Tensor],
    chunk_size: int,
    state_v_first: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the op: ``(dq, dk, dv, dg, dbeta, d_initial_state)``, each in the
    dtype and layout of its input (``d_initial_state`` empty when there is none)."""
    return _recompute_backward(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)


@chunked_gated_delta_rule_backward.register_fake
def _(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
      chunk_size, state_v_first):
    d_initial = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty(0)
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta)) + (d_initial,)


def _autograd_enabled_guard() -> Any:
    """Re-enable autograd inside an op implementation, where the dispatcher switched it off."""
    excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _recompute_backward(grad_o: Tensor, grad_final_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                        g: Tensor, beta: Tensor, scale: Optional[float], initial_state: Optional[Tensor],
                        use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], chunk_size: int,
                        state_v_first: bool) -> tuple[Tensor, ...]:
    """Backward by recomputing the chunked forward under autograd."""
    inputs = [t.detach().requires_grad_() for t in (q, k, v, g, beta)]
    if initial_state is not None:
        inputs.append(initial_state.detach().requires_grad_())
    with _autograd_enabled_guard(), torch.enable_grad():
        o, final_state = run_in_canonical_layout(
            chunk_gated_delta_rule_fwd, *inputs[:5], scale, inputs[5] if initial_state is not None else None,
            use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)
        outputs, grads = [o], [grad_o]
        if grad_final_state is not None and grad_final_state.numel() > 0:
            outputs.append(final_state)
            grads.append(grad_final_state)
        found = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    result = [x.new_zeros(x.shape) if d is None else d.to(x.dtype).contiguous() for d, x in zip(found, inputs)]
    if initial_state is None:
        result.append(q.new_empty(0))
    return tuple(result)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
     state_v_first) = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.options = (scale, use_qk_l2norm_in_kernel, chunk_size, state_v_first)


def _backward(ctx: Any, grad_o: Tensor, grad_final_state: Optional[Tensor]) -> tuple:
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    scale, use_qk_l2norm_in_kernel, chunk_size, state_v_first = ctx.options
    if grad_final_state is not None and grad_final_state.numel() == 0:
        grad_final_state = None
    dq, dk, dv, dg, dbeta, d_initial = torch.ops.gdr.chunked_gated_delta_rule_backward(
        grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
        chunk_size, state_v_first)
    return (dq, dk, dv, dg, dbeta, None, d_initial if initial_state is not None else None,
            None, None, None, None, None)


chunked_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)
