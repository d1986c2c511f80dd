"""The ops of the pure-torch chunked algorithm, their fakes and their autograd.

``torch.ops.gdr.chunked_gated_delta_rule`` is the public op: the chunked forward, with a
registered autograd whose backward is an op of its own
(``gdr::chunked_gated_delta_rule_backward``, the hand-written chunked backward of
:mod:`torch_gdr.ref.chunk_backward`), so that ``torch.compile`` traces both as opaque
nodes. A registered autograd can save only the op's inputs and outputs, so that backward
recomputes the state entering every chunk in an extra pass.

Training through :func:`torch_gdr.chunk_gated_delta_rule` (backend ``"torch"``), eager or
compiled, calls the private op ``gdr::_chunked_forward_with_states`` instead
(:func:`chunked_pure_torch`). It returns those states as a third output, and so its
registered autograd can keep them and hand them to the backward op's ``chunk_states``,
which then skips the recompute pass. Their number follows the chunks of the call: for
``cu_seqlens`` calls that depends on its values, so the fake gives it as an unbacked
(data-dependent) size. The states stay an output of an op, not an intermediate of an
``autograd.Function``: ``torch.compile`` cannot trace a function whose forward makes an
unbacked size that none of its outputs carries.

Schema notes: ``torch.library`` does not allow keyword-only tensor arguments, nor an
optional tensor in the outputs, so the ops take every argument positionally or by name
(same names and order as :func:`torch_gdr.chunk_gated_delta_rule`) and return an empty
tensor as ``final_state`` when ``output_final_state`` is False.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from torch_gdr._layout import run_backward_in_canonical_layout, run_in_canonical_layout
from torch_gdr._validate import check_cu_seqlens_values, check_inputs
from torch_gdr.ref.chunk import _forward_impl
from torch_gdr.ref.chunk_backward import chunk_gated_delta_rule_bwd
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


def _chunked_forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                     initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                     cu_seqlens: Optional[Tensor], chunk_size: int, save_states: bool = False) -> tuple[Tensor, ...]:
    del output_final_state  # the layout wrapper always wants the final state
    return _forward_impl(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                         save_states=save_states)


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
        _chunked_forward, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
        cu_seqlens, chunk_size, state_v_first)
    return o, (final_state if output_final_state else final_state.new_empty(0))


@chunked_gated_delta_rule.register_fake
def _fake_forward(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False):
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    state_dtype = compute_dtype_for(v.dtype)
    shape = _final_state_shape(q, v, cu_seqlens, state_v_first) if output_final_state else [0]
    return v.new_empty(v.shape), v.new_empty(shape, dtype=state_dtype)


def _chunk_states_rows(v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int) -> Any:
    """The rows of the states tensor of ``gdr::_chunked_forward_with_states``, in a fake:
    ``B * ceil(T / C) * HV`` for batched calls; with ``cu_seqlens`` a size known only once
    the op has run (it follows the sequences' lengths, and the segments: a segment stores the
    states of every sequence active at its first chunk)."""
    if cu_seqlens is not None:
        return torch.library.get_ctx().new_dynamic_size()
    batch_size, seq_len = (1, v.shape[0]) if v.dim() == 3 else (v.shape[0], v.shape[1])
    return batch_size * (-(-seq_len // chunk_size)) * v.shape[-2]


@torch.library.custom_op("gdr::_chunked_forward_with_states", mutates_args=())
def _chunked_forward_with_states(
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
) -> tuple[Tensor, Tensor, Tensor]:
    """The public op's ``(o, final_state)`` and ``chunk_states``, the state entering every
    chunk (``[rows, K, V]`` in the compute dtype, the storage of a
    :class:`~torch_gdr.ref.chunk_states.ChunkStates`), which its backward hands to the
    backward op. Private: the training path of :func:`chunked_pure_torch`."""
    _check_real(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    o, final_state, chunk_states = run_in_canonical_layout(
        functools.partial(_chunked_forward, save_states=True), q, k, v, g, beta, scale, initial_state,
        use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)
    return o, (final_state if output_final_state else final_state.new_empty(0)), chunk_states


@_chunked_forward_with_states.register_fake
def _(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
      cu_seqlens=None, chunk_size=64, state_v_first=False):
    o, final_state = _fake_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)
    rows = _chunk_states_rows(v, cu_seqlens, chunk_size)
    return o, final_state, v.new_empty((rows, q.shape[-1], v.shape[-1]), dtype=final_state.dtype)


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
    chunk_states: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the op: ``(dq, dk, dv, dg, dbeta, d_initial_state)``, each in the
    dtype and layout of its input (``d_initial_state`` empty when there is none).
    ``chunk_states``: the states tensor of ``gdr::_chunked_forward_with_states`` for the
    same call, or None to recompute the states (the public op's autograd)."""
    return _hand_written_backward(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state,
                                  use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first, chunk_states)


@chunked_gated_delta_rule_backward.register_fake
def _(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
      chunk_size, state_v_first, chunk_states=None):
    d_initial = initial_state.new_empty(initial_state.shape) if initial_state is not None else q.new_empty(0)
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta)) + (d_initial,)


def _hand_written_backward(grad_o: Tensor, grad_final_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                           g: Tensor, beta: Tensor, scale: Optional[float], initial_state: Optional[Tensor],
                           use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], chunk_size: int,
                           state_v_first: bool, chunk_states: Optional[Tensor]) -> tuple[Tensor, ...]:
    """The chunked backward of :mod:`torch_gdr.ref.chunk_backward` in the call's layout."""
    if grad_final_state is not None and grad_final_state.numel() == 0:
        grad_final_state = None
    *grads, d_initial = run_backward_in_canonical_layout(
        functools.partial(chunk_gated_delta_rule_bwd, chunk_states=chunk_states), grad_o, grad_final_state,
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)
    return tuple(grads) + (q.new_empty(0) if d_initial is None else d_initial,)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    """For both forward ops: they take the same arguments; the private one returns the
    chunk states as a third output, the public one has none to save."""
    (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
     state_v_first) = inputs
    chunk_states = output[2] if len(output) == 3 else None
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_states)
    ctx.options = (scale, use_qk_l2norm_in_kernel, chunk_size, state_v_first)
    if chunk_states is not None:
        ctx.mark_non_differentiable(chunk_states)
    # Gradients of unused outputs come as None rather than zeros: a non-differentiable output
    # would otherwise get a zero "gradient" of its own size (as large as the states).
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_o: Optional[Tensor], grad_final_state: Optional[Tensor], *_: Any) -> tuple:
    """The backward op on what ``ctx`` saved; with no chunk states saved, it recomputes them."""
    q, k, v, g, beta, initial_state, cu_seqlens, chunk_states = ctx.saved_tensors
    scale, use_qk_l2norm_in_kernel, chunk_size, state_v_first = ctx.options
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    if grad_final_state is not None and grad_final_state.numel() == 0:
        grad_final_state = None
    dq, dk, dv, dg, dbeta, d_initial = torch.ops.gdr.chunked_gated_delta_rule_backward(
        grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
        chunk_size, state_v_first, chunk_states)
    return (dq, dk, dv, dg, dbeta, None, d_initial if initial_state is not None else None,
            None, None, None, None, None)


chunked_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)
_chunked_forward_with_states.register_autograd(_backward, setup_context=_setup_context)


def chunked_pure_torch(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                       initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                       cu_seqlens: Optional[Tensor], chunk_size: int, state_v_first: bool) -> tuple[Tensor, Tensor]:
    """The pure-torch chunked algorithm as the public call runs it: a call that records
    autograd (eager or compiled) goes through ``gdr::_chunked_forward_with_states``, whose
    backward reads the chunk states it kept; any other call runs the public op."""
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            chunk_size, state_v_first)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
        o, final_state, _ = torch.ops.gdr._chunked_forward_with_states(*args)
        return o, final_state
    return torch.ops.gdr.chunked_gated_delta_rule(*args)
