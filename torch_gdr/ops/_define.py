"""How a backend becomes a pair of ``torch.library`` ops sharing one autograd.

Every backend ``name`` has

- a forward op ``gdr::_{name}_fwd`` with the public op's arguments plus
  ``save_chunk_states`` and ``strict``, returning ``(o, final_state, chunk_states)``: ``final_state`` is
  empty unless ``output_final_state``, ``chunk_states`` is whatever the backend's backward
  reads instead of recomputing the state entering every chunk (empty unless
  ``save_chunk_states``);
- a backward op (``gdr::_{name}_bwd``, or a given name) taking the gradients of the outputs,
  the forward's arguments and those chunk states, returning ``(dq, dk, dv, dg, dbeta,
  d_initial_state, dA_log, ddt_bias)`` (each of the last three empty where its input is
  absent).

Both end with fla's activation arguments (``use_gate_in_kernel, A_log, dt_bias,
use_beta_sigmoid_in_kernel, allow_neg_eigval``, :mod:`torch_gdr._gating`): g and beta
arrive raw. A backend defined with ``in_kernel_gating`` computes the activations (and their
gradients) in its raw functions, reading them from the :class:`GdrCall`; for every other
backend the op applies them in torch before the raw forward (:func:`activate_call`) and
the chain rule after the raw backward (:func:`gating_backward`), so its raw functions
never see a gated call.

``strict`` is the fallback policy travelling with the call: the forward op saves it and
its backward op receives it, so a backward kernel that fails at run time raises where the
caller named the backend (or strict mode is on) and falls back to the pure-torch backward
otherwise, with one op per backend.

Both take the public layouts; their implementations turn the arguments into a
:class:`~torch_gdr._layout.GdrCall` once and call the backend's raw functions, which see the
canonical layout only. Every forward op, the public one included, registers the same
:func:`_setup_context` and :func:`_backward`: the backward calls the backward op of the
forward's backend. Ops trust their arguments (the public call checks them once); the public
op checks its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

import torch

from torch_gdr._gating import activate_call, gating_backward
from torch_gdr._layout import GdrCall, canonical_call
from torch_gdr._layout import compute_dtype_for

Tensor = torch.Tensor

#: ``forward(call, save_chunk_states) -> (o, final_state, chunk_states or None)``, canonical layout.
RawForward = Callable[[GdrCall, bool], tuple[Tensor, Tensor, Optional[Tensor]]]
#: ``backward(call, grad_o, grad_final_state or None, chunk_states or None, strict) -> (dq, dk, dv, dg,
#: dbeta, d_initial_state or None[, dA_log or None, ddt_bias or None])``, canonical layout;
#: ``strict``: a failing kernel raises. The last two only from a backend with in-kernel gating.
RawBackward = Callable[[GdrCall, Tensor, Optional[Tensor], Optional[Tensor], bool], tuple[Optional[Tensor], ...]]
#: ``shape(q, v, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel)``: the chunk states' shape in
#: a fake, None for a size that depends on the data (e.g. on the values of ``cu_seqlens``).
StatesShape = Callable[[Tensor, Tensor, Optional[Tensor], int, bool], list[Optional[int]]]

_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale=None, Tensor? initial_state=None, "
         "bool output_final_state=False, bool use_qk_l2norm_in_kernel=False, Tensor? cu_seqlens=None, "
         "int chunk_size=64, bool state_v_first=False")
#: fla's activation arguments (:mod:`torch_gdr._gating`), after every other argument of an
#: op so that positional calls of the earlier schemas keep their meaning.
_GATING_ARGS = ("bool use_gate_in_kernel=False, Tensor? A_log=None, Tensor? dt_bias=None, "
                "bool use_beta_sigmoid_in_kernel=False, bool allow_neg_eigval=False")
PUBLIC_SCHEMA = f"({_ARGS}, {_GATING_ARGS}) -> (Tensor, Tensor)"
FORWARD_SCHEMA = (f"({_ARGS}, bool save_chunk_states=False, bool strict=False, {_GATING_ARGS}) "
                  "-> (Tensor, Tensor, Tensor)")
BACKWARD_SCHEMA = ("(Tensor grad_o, Tensor? grad_final_state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
                   "float? scale, Tensor? initial_state, bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, "
                   f"int chunk_size, bool state_v_first, Tensor? chunk_states=None, bool strict=False, {_GATING_ARGS}) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
_NUM_PUBLIC_ARGS = 12  # the arguments before save_chunk_states in a forward op
_NUM_GATING_ARGS = 5


def final_state_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], state_v_first: bool) -> list[int]:
    """The final state's shape for arguments in the public layouts."""
    num_seqs = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else (1 if q.dim() == 3 else q.shape[0])
    head_k_dim, (num_v_heads, head_v_dim) = q.shape[-1], v.shape[-2:]
    inner = [head_v_dim, head_k_dim] if state_v_first else [head_k_dim, head_v_dim]
    return [num_seqs, num_v_heads] + inner


def fake_outputs(q: Tensor, v: Tensor, output_final_state: bool, cu_seqlens: Optional[Tensor],
                 state_v_first: bool) -> tuple[Tensor, Tensor]:
    """``(o, final_state)`` of a forward op in a fake (meta) call."""
    shape = final_state_shape(q, v, cu_seqlens, state_v_first) if output_final_state else [0]
    return v.new_empty(v.shape), v.new_empty(shape, dtype=compute_dtype_for(v.dtype))


def run_forward(forward: RawForward, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                scale: Optional[float], initial_state: Optional[Tensor], output_final_state: bool,
                use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], chunk_size: int, state_v_first: bool,
                save_chunk_states: bool, *gating: Any, in_kernel_gating: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A forward op's body: canonicalise once, run ``forward`` (on the activated call unless
    ``in_kernel_gating``), return the public layouts. ``gating``: the op's activation
    arguments (:data:`_GATING_ARGS`), or none."""
    call = canonical_call(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                          state_v_first, *gating)
    if not in_kernel_gating:
        call = activate_call(call)
    o, final_state, chunk_states = forward(call, save_chunk_states)
    o, final_state = call.public_outputs(o, final_state)
    if not output_final_state:
        final_state = final_state.new_empty(0)
    if chunk_states is None:
        chunk_states = final_state.new_empty(0)
    return o, final_state, chunk_states


def _run_backward(backward: RawBackward, grad_o: Tensor, grad_final_state: Optional[Tensor], q: Tensor, k: Tensor,
                  v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], initial_state: Optional[Tensor],
                  use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], chunk_size: int, state_v_first: bool,
                  chunk_states: Optional[Tensor] = None, strict: bool = False, *gating: Any,
                  in_kernel_gating: bool = False) -> tuple[Tensor, ...]:
    """A backward op's body: canonicalise once, run ``backward`` (through the activations'
    chain rule unless ``in_kernel_gating``), gradients in the public layouts."""
    call = canonical_call(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                          state_v_first, *gating)
    if grad_final_state is not None and grad_final_state.numel() == 0:
        grad_final_state = None  # the forward returned no final state
    if chunk_states is not None and chunk_states.numel() == 0:
        chunk_states = None  # none were saved
    backend_call = call if in_kernel_gating else activate_call(call)  # what the raw backward sees
    grads = list(backward(backend_call, call.canonical_tokens(grad_o), call.canonical_state(grad_final_state),
                          chunk_states, strict))
    if len(grads) == 6:
        grads += [None, None]
    if backend_call is not call:
        grads[3], grads[4], grads[6], grads[7] = gating_backward(call, grads[3], grads[4])
    inputs = [t for t in (grad_o, grad_final_state, q, k, v, g, beta, initial_state, chunk_states, *gating)
              if isinstance(t, Tensor)]
    # an op's outputs may not alias its inputs (e.g. d_initial_state = grad_final_state when no token ran)
    grads = [None if d is None else (d.clone() if any(_same_storage(d, t) for t in inputs) else d) for d in grads]
    return call.public_grads(*grads)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() > 0


def fake_backward(grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                   cu_seqlens, chunk_size, state_v_first, chunk_states=None, strict=False, use_gate_in_kernel=False,
                   A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    heads = tuple(x.new_empty(x.shape) if x is not None else q.new_empty(0)
                  for x in (initial_state, A_log, dt_bias))
    return tuple(x.new_empty(x.shape) for x in (q, k, v, g, beta)) + heads


def _setup_context(ctx: Any, inputs: tuple, output: tuple, *, backward_op: Any) -> None:
    """The one setup_context of every forward op: saves the inputs (and the chunk states a
    backend's forward op returned) for ``backward_op``, the backward of its backend."""
    (q, k, v, g, beta, scale, initial_state, _, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
     state_v_first) = inputs[:_NUM_PUBLIC_ARGS]
    chunk_states = output[2] if len(output) == 3 else None
    # the public op: its 12 arguments, then the activation arguments; a backend's forward op:
    # its 12, save_chunk_states, strict, then the activation arguments
    backend_op = len(inputs) == _NUM_PUBLIC_ARGS + 2 + _NUM_GATING_ARGS
    strict = bool(inputs[_NUM_PUBLIC_ARGS + 1]) if backend_op else False
    gating_at = _NUM_PUBLIC_ARGS + (2 if backend_op else 0)
    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval = (
        inputs[gating_at:gating_at + _NUM_GATING_ARGS])
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, chunk_states, A_log, dt_bias)
    ctx.options = (scale, use_qk_l2norm_in_kernel, chunk_size, state_v_first, strict)
    ctx.gating_flags = (use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    ctx.gating_at = gating_at
    ctx.backward_op = backward_op
    ctx.num_inputs = len(inputs)
    if chunk_states is not None:
        ctx.mark_non_differentiable(chunk_states)
    # Gradients of unused outputs come as None rather than zeros: a non-differentiable output
    # would otherwise get a zero "gradient" of its own size (as large as the states).
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_o: Optional[Tensor], grad_final_state: Optional[Tensor], *_: Any) -> tuple:
    """The one autograd backward of every forward op: its backend's backward op."""
    q, k, v, g, beta, initial_state, cu_seqlens, chunk_states, A_log, dt_bias = ctx.saved_tensors
    scale, use_qk_l2norm_in_kernel, chunk_size, state_v_first, strict = ctx.options
    use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval = ctx.gating_flags
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, d_initial, d_a_log, d_dt_bias = ctx.backward_op(
        grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
        chunk_size, state_v_first, chunk_states, strict, use_gate_in_kernel, A_log, dt_bias,
        use_beta_sigmoid_in_kernel, allow_neg_eigval)
    grads = [None] * ctx.num_inputs
    grads[:7] = (dq, dk, dv, dg, dbeta, None, d_initial if initial_state is not None else None)
    grads[ctx.gating_at + 1] = d_a_log if A_log is not None else None
    grads[ctx.gating_at + 2] = d_dt_bias if dt_bias is not None else None
    return tuple(grads)


def register_autograd(forward_op: Any, backward_op: Any) -> None:
    """Give ``forward_op`` (public or a backend's) the shared autograd, backed by ``backward_op``."""
    forward_op.register_autograd(_backward, setup_context=functools.partial(_setup_context, backward_op=backward_op))


def define_backward_op(qualname: str, backward: RawBackward, in_kernel_gating: bool = False) -> Any:
    """The backward op ``qualname`` running ``backward`` (canonical layout); with
    ``in_kernel_gating`` ``backward`` takes gated calls and returns the gradients of the raw
    g, beta, ``A_log`` and ``dt_bias`` itself."""
    op = torch.library.custom_op(qualname, functools.partial(_run_backward, backward,
                                                             in_kernel_gating=in_kernel_gating),
                                 mutates_args=(), schema=BACKWARD_SCHEMA)
    op.register_fake(fake_backward)
    return op


def define_backend(name: str, forward: RawForward, backward_op: Any,
                   states_shape: Optional[StatesShape] = None, in_kernel_gating: bool = False) -> Any:
    """The forward op ``gdr::_{name}_fwd`` running ``forward``, with the shared autograd
    backed by ``backward_op``. In a fake, its chunk states have the shape ``states_shape``
    gives (a None in it: a data-dependent size); a backend without ``states_shape`` never
    returns any (an empty tensor). ``in_kernel_gating``: ``forward`` takes gated calls (the
    activations in its kernels); else the op activates g and beta before it."""

    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False,
            save_chunk_states=False, strict=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
        return run_forward(forward, q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first, save_chunk_states,
                           use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                           in_kernel_gating=in_kernel_gating)

    def fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False,
             save_chunk_states=False, strict=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
        o, final_state = fake_outputs(q, v, output_final_state, cu_seqlens, state_v_first)
        if not save_chunk_states or states_shape is None:
            return o, final_state, final_state.new_empty(0)
        shape = states_shape(q, v, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel)
        shape = [torch.library.get_ctx().new_dynamic_size() if size is None else size for size in shape]
        return o, final_state, final_state.new_empty(shape)

    op = torch.library.custom_op(f"gdr::_{name}_fwd", run, mutates_args=(), schema=FORWARD_SCHEMA)
    op.register_fake(fake)
    register_autograd(op, backward_op)
    return op


STEP_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
               f"bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, {_GATING_ARGS}) -> (Tensor, Tensor)")


def _fake_step(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, use_gate_in_kernel=False,
               A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False):
    num_seqs = v.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(v.shape), v.new_empty((num_seqs, v.shape[2], q.shape[-1], v.shape[-1]), dtype=torch.float32)


def define_step_op(qualname: str, step: Callable[..., tuple[Tensor, Tensor]]) -> Any:
    """A backend's token-by-token step as the op ``qualname`` (inference: no autograd), on the
    canonical layout: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``, a
    key-first ``initial_state [N, HV, K, V]`` or None, int64 ``cu_seqlens`` or None, then
    the activation arguments (raw g and beta where their flags are set: ``step`` applies
    them). ``step`` returns ``o`` (v's shape and dtype) and a new key-first final state ``[N, HV, K, V]``
    float32."""
    op = torch.library.custom_op(qualname, step, mutates_args=(), schema=STEP_SCHEMA)
    op.register_fake(_fake_step)
    return op
