"""The in-place final state of the per-sequence calls (``inplace_final_state=True``).

vLLM's meaning, without a pool: the call writes the final state into the caller's
``initial_state`` tensor and returns that tensor, instead of a new one. fla's default stays:
``initial_state`` untouched, a new final state. Over a state pool the pool is always updated
in place (:mod:`torch_gdr._pool`), so there ``None`` means in place.

Writing into the caller's tensor needs a state a kernel can write straight into:

- inference only: ``initial_state`` does not require grad, and autograd records nothing
  (no input requires grad while grad mode is on);
- float32, float16 or bfloat16 (float64 where the call computes in float64: float64 q or v);
- writable: no dimension of size > 1 with stride 0 (an ``expand``-ed view), no overlap;
- the layout of a pool row: each ``[HV, K, V]`` (``[HV, V, K]`` with ``state_v_first``)
  contiguous, the sequences at a stride of at least one row (padding allowed).

A state that breaks one of these gets a ``ValueError`` (grad, layout, writability) or
``TypeError`` (dtype) naming ``initial_state`` or ``inplace_final_state``.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

#: State dtypes written in place (float64 too when the call computes in float64).
INPLACE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def resolve_inplace_flag(inplace_final_state: Optional[bool], pooled: bool) -> bool:
    """``inplace_final_state`` as a bool: None is True over a pool, False otherwise.

    Raises:
        TypeError: neither None nor a bool.
    """
    if inplace_final_state is None:
        return pooled
    if not isinstance(inplace_final_state, bool):
        raise TypeError(f"inplace_final_state: expected a bool, got {type(inplace_final_state).__name__} "
                        f"{inplace_final_state!r} (or None: in place over a state pool only)")
    return inplace_final_state


def inplace_problem(state: Optional[Tensor], compute_dtype: torch.dtype,
                    inputs: tuple[Optional[Tensor], ...] = ()) -> Optional[tuple[type, str]]:
    """Why ``state`` cannot take the final state in place: ``(exception type, message)``,
    or None when it can. ``state``: the caller's ``initial_state`` (public layout, shape
    already checked); ``compute_dtype``: the call's (float64 for float64 q or v, else
    float32); ``inputs``: the other tensors of the call (autograd must record none)."""
    if state is None:
        return ValueError, ("initial_state: inplace_final_state=True writes the final state into initial_state, "
                            "got None; pass the state tensor to update (zeros for a first call)")
    if state.requires_grad:
        return ValueError, ("initial_state: requires grad; the in-place final state (inplace_final_state=True) is "
                            "for inference; pass a state that does not require grad, or inplace_final_state=False "
                            "for a new, differentiable final state")
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        return ValueError, ("inplace_final_state: True is for inference, but an input requires grad with grad mode "
                            "on; call under torch.no_grad() or pass inplace_final_state=False")
    allowed = INPLACE_DTYPES + ((torch.float64,) if compute_dtype == torch.float64 else ())
    if state.dtype not in allowed:
        names = "/".join(str(d).replace("torch.", "") for d in allowed)
        return TypeError, (f"initial_state: the in-place final state takes a {names} state, got {state.dtype}; pass "
                           "a state of one of those dtypes, or inplace_final_state=False")
    shape, strides = list(state.shape), list(state.stride())
    if any(size > 1 and stride == 0 for size, stride in zip(shape, strides)):
        return ValueError, (f"initial_state: not writable in place (an expanded view, strides {strides} for shape "
                            f"{shape}); pass a tensor of its own (e.g. .clone()), or inplace_final_state=False")
    _, heads, inner1, inner2 = shape
    row = heads * inner1 * inner2
    rows_ok = (strides[3] == 1 or inner2 == 1) and (strides[2] == inner2 or inner1 == 1) \
        and (strides[1] == inner1 * inner2 or heads == 1) and (strides[0] >= row or shape[0] == 1)
    if not rows_ok:
        return ValueError, (f"initial_state: the in-place final state needs each sequence's state contiguous, the layout "
                            f"of a pool row (strides [>= {row}, {inner1 * inner2}, {inner2}, 1] for shape "
                            f"{shape}), got strides {strides}; pass a contiguous state (.contiguous()), or "
                            "inplace_final_state=False")
    return None


def check_inplace_state(state: Optional[Tensor], compute_dtype: torch.dtype,
                        inputs: tuple[Optional[Tensor], ...] = ()) -> Tensor:
    """Raise what :func:`inplace_problem` finds; returns ``state``."""
    problem = inplace_problem(state, compute_dtype, inputs)
    if problem is not None:
        raise problem[0](problem[1])
    assert state is not None
    return state


def row_view(state: Tensor) -> Tensor:
    """``state`` (checked) with a row stride of at least one row: a single sequence may carry
    any stride along its batch dim, which the pool kernels would refuse."""
    row = state.shape[1] * state.shape[2] * state.shape[3]
    if state.shape[0] == 1 and state.stride(0) < row:
        return state.as_strided(state.shape, (row, *state.stride()[1:]), state.storage_offset())
    return state


def write_final_state(state: Tensor, final_state: Tensor) -> Tensor:
    """Copy a new final state (the caller's layout) into ``state``; returns ``state``."""
    state.copy_(final_state)
    return state
