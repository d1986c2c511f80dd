"""Keeping a NaN or inf where the recurrence keeps it.

In the recurrence a non-finite k, v or beta at token t (or a g that is NaN or ``+inf``;
``-inf`` is a legal full reset) makes the state, and so the outputs from t on, non-finite;
the outputs before t stay as they were. The chunked algorithm multiplies whole chunks by
triangular matrices, and ``0 * nan = nan``: a NaN at token t would reach the outputs of
the earlier tokens of its chunk too. So a chunked forward checks its outputs
(:func:`outputs_finite`, one min-max pass); only where they are not finite does it look for
such tokens (:func:`find_nonfinite`, a pass over k, v, g and beta), run again on inputs
with those tokens made inert (:func:`sanitised`: zero k, v and beta, zero g), and mark the
outputs from the first bad token of each sequence, value head and value column on, and
those columns of the final state, as NaN (:func:`poison`). A q that is not finite only touches
its own token's output in both algorithms and needs nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch

from torch_gdr._gating import activate_call
from torch_gdr._layout import GdrCall
from torch_gdr.ops.torch.utils import repeat_kv_heads

Tensor = torch.Tensor


def _all_finite(x: Tensor) -> bool:
    """Whether every element of ``x`` is finite, from its smallest and largest (a NaN or an
    inf reaches one of them): one pass in ``x``'s own dtype. (A float32 sum of a half ``o``
    first made a float32 copy of it, ~12x the time of this pass on the CPU.)"""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def outputs_finite(o: Tensor, final_state: Tensor) -> bool:
    """Whether ``o`` and ``final_state`` are finite (exactly: no false alarm from an overflow)."""
    return _all_finite(o) and _all_finite(final_state)


class Nonfinite(NamedTuple):
    """Where a call's inputs are not finite.

    Attributes:
        rows: ``[B, T, HV]``, a non-finite k (of the value head's q/k head) or beta, or a g
            that is NaN or ``+inf``: every value column of the head is hit from there on.
        values: ``[B, T, HV, V]``, a non-finite v: only its own value column is (the
            recurrence updates the columns of ``S [K, V]`` independently).
    """

    rows: Tensor
    values: Tensor


def find_nonfinite(call: GdrCall) -> Optional[Nonfinite]:
    """Where k, v, g or beta of ``call`` are not finite (``g = -inf`` is), or None."""
    bad_k = ~torch.isfinite(call.k).all(-1)  # [B, T, H]
    rows = ~torch.isfinite(call.beta) | torch.isnan(call.g) | (call.g == float("inf"))
    rows |= repeat_kv_heads(bad_k.unsqueeze(-1), rows.shape[-1]).squeeze(-1)
    values = ~torch.isfinite(call.v)
    return Nonfinite(rows, values) if bool(rows.any() or values.any()) else None


def sanitised(call: GdrCall, bad: Nonfinite) -> GdrCall:
    """``call`` with its non-finite inputs made inert: the tokens of ``bad.rows`` do nothing
    to their value heads (beta and g zero), non-finite keys and values are zero."""
    bad_k = ~torch.isfinite(call.k).all(-1)  # [B, T, H]
    return dataclasses.replace(
        call,
        k=call.k.masked_fill(bad_k[..., None], 0.0),
        v=call.v.masked_fill(bad.values, 0.0),
        g=call.g.masked_fill(bad.rows, 0.0),
        beta=call.beta.masked_fill(bad.rows, 0.0),
    )


def poison(call: GdrCall, bad: Nonfinite, o: Tensor, final_state: Tensor) -> tuple[Tensor, Tensor]:
    """NaN in ``o [B, T, HV, V]`` from the first bad token of each sequence, value head and
    value column on, and in those columns of the final states ``[N, HV, K, V]``."""
    hit = bad.values | bad.rows[..., None]  # [B, T, HV, V]
    if call.offsets is None:
        from_first_bad = hit.int().cummax(dim=1).values.bool()
        columns = hit.any(dim=1)  # [N = B, HV, V]
    else:
        from_first_bad = torch.zeros_like(hit)
        columns = hit.new_zeros(call.num_seqs, *hit.shape[2:])
        for n, (start, end) in enumerate(zip(call.offsets[:-1], call.offsets[1:])):
            if end > start:
                span = hit[:, start:end]
                from_first_bad[:, start:end] = span.int().cummax(dim=1).values.bool()
                columns[n] = span.any(dim=1)[0]
    o = o.masked_fill(from_first_bad, float("nan"))
    final_state = final_state.masked_fill(columns[..., None, :], float("nan"))
    return o, final_state


def contained(forward: Callable[[GdrCall, bool], tuple[Tensor, Tensor, Optional[Tensor]]], call: GdrCall,
              save_states: bool, first: Optional[tuple[Tensor, Tensor, Optional[Tensor]]] = None
              ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """``forward(call, save_states)`` (any chunked forward: ``(o, final_state, states)``) with
    its non-finite inputs kept where the recurrence keeps them (the module doc). ``first``:
    that forward's results on ``call``, where the caller has them already."""
    o, final_state, states = forward(call, save_states) if first is None else first
    if not outputs_finite(o, final_state):
        call = activate_call(call)  # a gated call (raw g or beta): judged on the activated values
        bad = find_nonfinite(call)
        if bad is not None:
            o, final_state, states = forward(sanitised(call, bad), save_states)
            o, final_state = poison(call, bad, o, final_state)
    return o, final_state, states
