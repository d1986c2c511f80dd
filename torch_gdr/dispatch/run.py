"""Running a selected backend: the chunked call, the step, checkpoints; failures at run time.

A backend whose kernels may fail inside the call (``Backend.may_fail``: a PyPTO build, an
fla refusal) is run under the policy: the failure raises the backend's error where the
caller named it (or strict mode is on), and otherwise warns once and runs ``"torch"``.
Every other backend's exceptions are the caller's.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._fallback import BackendError, failure_reason, refuse_or_warn, strict_mode
from torch_gdr._gating import Gating, activate_call, apply_gating
from torch_gdr._layout import GdrCall
from torch_gdr._validate import CHUNK_SIZES
from torch_gdr.dispatch.registry import BACKENDS, UNIVERSAL_BACKEND, Selection, select
from torch_gdr.ops._backend import CallSpec, OpArgs

Tensor = torch.Tensor


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a call on ``tensors``: grad mode on and one requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def run_chunk(args: OpArgs, grad: bool, backend: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """The chunked call on a checked call (``args`` in the public layouts) on the backend
    serving it. ``grad``: autograd records the call, so a backend that can keeps the states
    its backward reads. Returns ``(o, final_state)``, the latter empty unless asked for."""
    selection = select(CallSpec.of("chunk", args.q, args.v, args.chunk_size, grad), backend)
    chosen = selection.backend
    strict = selection.named or strict_mode()
    if not chosen.may_fail:
        o, final_state, _ = chosen.forward_op(*args.forward_args(grad and chosen.keeps_chunk_states, strict))
        return o, final_state
    try:
        o, final_state, _ = chosen.forward_op(*args.forward_args(grad and chosen.keeps_chunk_states, strict))
        return o, final_state
    except BackendError:
        raise
    except Exception as error:  # noqa: BLE001 - a kernel failing to build or run is a fallback reason
        reason = failure_reason("the kernel", error)
        if strict:
            raise chosen.error(f"backend {chosen.name!r} cannot serve this call: {reason}") from error
    refuse_or_warn(chosen.name, reason, named=False, instead=f"the {UNIVERSAL_BACKEND!r} backend", stacklevel=4)
    fallback = BACKENDS[UNIVERSAL_BACKEND]
    o, final_state, _ = fallback.forward_op(*args.forward_args(grad and fallback.keeps_chunk_states, False))
    return o, final_state


def run_step(call: GdrCall, grad: bool, backend: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """The token-by-token call on a checked call in the canonical layout; returns ``o`` and
    the key-first final state (canonical layout)."""
    selection = select(CallSpec.of("step", call.q, call.v, call.chunk_size, grad), backend)
    if "step" not in selection.backend.in_kernel_gating:
        call = activate_call(call)  # differentiable torch
    return selection.backend.step(call)


def run_step_inplace(call: GdrCall, state: Tensor, backend: Optional[str] = None) -> Tensor:
    """The token-by-token call (inference) writing its final state into ``state``, the
    caller's ``initial_state`` (public layout; ``call.initial_state`` is its canonical view),
    checked by :mod:`torch_gdr._inplace`; returns ``o`` (canonical layout).

    A backend with ``step_inplace`` writes it without a new state (``"cpu"``, ``"pypto"``
    through their pool kernels); any other runs its step and copies the new final state in
    (``"torch"``, ``"recurrent"``, and ``"fla"``, whose fused-recurrent forward returns a new
    state)."""
    selection = select(CallSpec.of("step", call.q, call.v, call.chunk_size, False), backend)
    chosen = selection.backend
    if "step" not in chosen.in_kernel_gating:
        call = activate_call(call)  # differentiable torch
    if chosen.step_inplace is not None:
        return chosen.step_inplace(call, state)
    o, final_state = chosen.step(call)
    state.copy_(call.public_state(final_state))
    return o


def run_pool_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
                  ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], *, cu_seqlens: Optional[Tensor],
                  use_qk_l2norm_in_kernel: bool, state_v_first: bool, validate: bool,
                  backend: Optional[str] = None, gating: Optional[Gating] = None,
                  initial_state_indices: Optional[Tensor] = None, serving: Optional[dict] = None,
                  selection: Optional[Selection] = None) -> Tensor:
    """The step over a state pool, in place, on the backend serving it (the arguments of
    :func:`torch_gdr.ops.torch.pool.pool_recurrent_step`); returns ``o``. ``gating``: the activation
    arguments of the raw ``g``/``beta`` (:mod:`torch_gdr._gating`), or None. ``serving``: the
    serving extras as keywords, for a backend whose step takes them (``Backend.pool_extras``), or
    None. ``selection``: the caller's :func:`select_pool_step` for these inputs, or None
    (selected here)."""
    if selection is None:
        selection = select_pool_step(q, v, ssm_state_indices, backend)
    extra = {} if initial_state_indices is None else {"initial_state_indices": initial_state_indices}
    if serving is not None:
        if not selection.backend.pool_extras:
            raise AssertionError(f"the {selection.backend.name!r} backend's pool step takes no serving extras")
        extra.update(serving)
    if gating is not None and gating.gated:
        if "pool_step" in selection.backend.in_kernel_gating:
            extra["gating"] = gating
        else:
            g, beta = apply_gating(g, beta, use_gate_in_kernel=gating.use_gate_in_kernel, A_log=gating.A_log,
                                   dt_bias=gating.dt_bias, use_beta_sigmoid_in_kernel=gating.use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval=gating.allow_neg_eigval)
    return selection.backend.pool_step(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                                       cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                       state_v_first=state_v_first, validate=validate, **extra)


def select_pool_step(q: Tensor, v: Tensor, ssm_state_indices: Tensor, backend: Optional[str],
                     extras: frozenset[str] = frozenset()) -> Selection:
    """The policy's choice of backend for the pool step of these inputs with the serving
    ``extras`` (keys of :data:`torch_gdr.ops._backend.POOL_EXTRAS`)."""
    spec = CallSpec.of("pool_step", q, v, CHUNK_SIZES[0], False)._replace(pool_extras=extras)
    if ssm_state_indices.dim() == 2:  # [N, S]: S tokens per sequence at most (checked by the pool rules)
        spec = spec._replace(tokens_per_sequence=int(ssm_state_indices.shape[1]))
    return select(spec, backend)


def run_checkpoints(args: OpArgs, checkpoint_every: int, backend: Optional[str] = None) -> tuple[Tensor, ...]:
    """The chunked call with checkpoints every ``checkpoint_every`` tokens (inference);
    returns ``(o, final_state, checkpoints, checkpoint_offsets)``."""
    selection = select(CallSpec.of("checkpoints", args.q, args.v, args.chunk_size, False), backend)
    g, beta = apply_gating(args.g, args.beta, use_gate_in_kernel=args.use_gate_in_kernel, A_log=args.A_log,
                           dt_bias=args.dt_bias, use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel,
                           allow_neg_eigval=args.allow_neg_eigval)
    return selection.backend.checkpoints(
        args.q, args.k, args.v, g, beta, checkpoint_every, args.scale, args.initial_state,
        use_qk_l2norm_in_kernel=args.use_qk_l2norm_in_kernel, cu_seqlens=args.cu_seqlens,
        chunk_size=args.chunk_size, state_v_first=args.state_v_first)
