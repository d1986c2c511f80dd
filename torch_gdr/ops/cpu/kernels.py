"""The Python side of the fused CPU kernels: tensors in the kernels' form, then the C++.

Canonical layout: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (``HV % H == 0``); g, beta
``[B, T, HV]``; initial_state key-first ``[N, HV, K, V]`` or None; cu_seqlens int64
``[N + 1]`` or None (then B == 1); scale a float. The kernels compute in float32 for
float32, float16 and bfloat16 inputs (q and v of one dtype; states always float32), except
the bfloat16 chunked forward of the ``avx512bf16`` variant, whose products take bfloat16
operands with float32 accumulation (:data:`HALF_PRODUCTS`). Where
the extension cannot be built or loaded these functions raise: the ``"cpu"`` backend
(:mod:`.backend`) declares that as its reason, and dispatch picks another backend. The
chunk states a forward returns are ``[total_chunks, HV, K, V]``, the state entering every
chunk of every sequence in order, for :func:`chunk_bwd` of the same call.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._gating import Gating
from torch_gdr._layout import default_scale
from torch_gdr.ops.cpu import _build

Tensor = torch.Tensor

#: Input dtypes the kernels take (they compute in float32).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: How the chunked kernels run their stages: 0 chooses (per unit in one thread when the
#: units keep every thread busy, else over segments with the intra-chunk part parallel over
#: chunks), 1 forces the first, 2 the second. Tests set it to cover both.
STAGES = 0
#: How the bfloat16 chunked forward multiplies: 0 on the machine's pair-dot unit where the
#: loaded variant has one (``avx512bf16``: VDPBF16PS, bfloat16 operands, float32
#: accumulation) and the shapes fit (chunk, K, V multiples of 16), else in float32 after
#: converting the tiles; 1 always in float32; 2 with the pair-dot unit's arithmetic emulated
#: on AVX2 (csrc/pairdot.h), which tests set to run that path on machines without the unit.
HALF_PRODUCTS = 0
#: The longest chunk the kernels run a forward that keeps no chunk states with (inference).
#: Its intra-chunk work per token grows with the chunk while the state scan's does not, so
#: shorter chunks cost less; the result does not depend on the chunk up to rounding. A
#: forward that keeps its states (training) runs at the caller's chunk, whose states the
#: backward reads (at 32 they would double). bench/RESULTS.md has the measurements.
FORWARD_ONLY_CHUNK = 32


def available() -> bool:
    """True when the extension is built (building it now if needed) and loaded."""
    return _build.load() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (no compiler, a build failure...), or None."""
    available()
    return _build.unavailable_reason()


def half_unit() -> str:
    """The pair-dot unit the loaded kernels' bfloat16 forward runs on (``"avx512bf16"``), or
    ``""`` where they convert bfloat16 tiles to float32 (see :data:`HALF_PRODUCTS`)."""
    return _extension().half_unit()


def pair_dot_lanes(acc: Tensor, a: Tensor, b: Tensor, hardware: bool = False) -> Optional[Tensor]:
    """One step of the pair-dot unit per lane (tests): ``acc + a.hi * b.hi + a.lo * b.lo`` as
    the unit computes it, for ``acc`` float32 ``[n]`` and ``a``, ``b`` int32 ``[n]`` (each word
    two bfloat16 values, the low half the first), n a multiple of 16. ``hardware``: the
    machine's unit (:func:`half_unit`), else its AVX2 emulation. None where the loaded
    kernels have not the one asked for."""
    out = _extension().pair_dot_lanes(acc.contiguous(), a.contiguous(), b.contiguous(), bool(hardware))
    return out if out.numel() == acc.numel() else None


def _mode() -> int:
    """The kernels' ``stages`` argument: :data:`STAGES` plus 4 x :data:`HALF_PRODUCTS`."""
    return STAGES + 4 * HALF_PRODUCTS


def _extension():
    """The loaded extension; ``RuntimeError`` with the reason where it cannot be loaded."""
    module = _build.load()
    if module is None:
        raise RuntimeError(f"torch_gdr: the fused CPU kernels are unavailable ({_build.unavailable_reason()})")
    return module


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype).contiguous()``, without the two dispatcher calls (a noticeable share of a
    decode step's overhead) when they would return ``t`` itself."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _token_view(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` (``[B, T, ...]``) as the kernel reads it: itself where it has ``dtype``, a
    contiguous last dim (or none: g and beta) and batch and time dims that flatten into one
    token dim (a view of a packed ``mixed_qkv`` qualifies); else a contiguous copy in ``dtype``."""
    if t.dtype == dtype and (t.dim() == 3 or t.stride(-1) == 1 or t.shape[-1] == 1):
        batch, time = t.shape[0], t.shape[1]
        if batch == 1 or time == 1 or t.stride(0) == time * t.stride(1):
            return t
    return t.to(dtype).contiguous()


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Optional[Tensor],
             views: bool = False):
    """A kernel's inputs: q, k, v in v's dtype, g and beta float32, ``cu_seqlens`` int64 on the
    CPU. ``views``: for the forward kernels, which read through the strides: views where they
    qualify (:func:`_token_view`), else contiguous copies; otherwise (the backward) contiguous."""
    dtype = v.dtype
    convert = _token_view if views else _as
    q, k, v = convert(q, dtype), convert(k, dtype), convert(v, dtype)
    g, beta = convert(g, torch.float32), convert(beta, torch.float32)
    cu = None if cu_seqlens is None else cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    return q, k, v, g, beta, cu


def _gating_args(gating: Optional[Gating]) -> tuple:
    """The four trailing arguments of every kernel: ``A_log``, ``dt_bias`` (float32 ``[HV]`` or
    None), the beta sigmoid flag and its scale."""
    if gating is None or not gating.gated:
        return None, None, False, 1.0
    a_log = dt_bias = None
    if gating.use_gate_in_kernel:
        a_log = _as(gating.A_log, torch.float32)
        dt_bias = None if gating.dt_bias is None else _as(gating.dt_bias, torch.float32)
    return (a_log, dt_bias, bool(gating.use_beta_sigmoid_in_kernel),
            2.0 if gating.use_beta_sigmoid_in_kernel and gating.allow_neg_eigval else 1.0)


def _state(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else _as(x, torch.float32)


def _total_chunks(v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int) -> int:
    if cu_seqlens is None:
        return v.shape[0] * -(-v.shape[1] // chunk_size)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return int(((lengths + chunk_size - 1) // chunk_size).sum())


def _scale(scale: Optional[float], q: Tensor) -> float:
    return float(default_scale(q.shape[-1]) if scale is None else scale)


def forward_chunk_size(chunk_size: int, save_states: bool) -> int:
    """The chunk length the kernels run a forward with: the caller's where the chunk states
    are kept, else at most :data:`FORWARD_ONLY_CHUNK`."""
    return int(chunk_size) if save_states else min(int(chunk_size), FORWARD_ONLY_CHUNK)


def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
              initial_state: Optional[Tensor], use_qk_l2norm: bool, cu_seqlens: Optional[Tensor], chunk_size: int,
              save_states: bool, gating: Optional[Gating] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The chunked forward; the kernels run it at :func:`forward_chunk_size`.

    Returns:
        ``o [B, T, HV, V]`` in v's dtype, the final state ``[N, HV, K, V]`` float32, and with
        ``save_states`` the chunk states for :func:`chunk_bwd` (``[total_chunks, HV, K, V]``
        float32, the state entering every chunk of every sequence, sequences in order), else
        None.
    """
    return chunk_fwd_checked(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens, chunk_size,
                             save_states, gating)[:3]


def chunk_fwd_checked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                      initial_state: Optional[Tensor], use_qk_l2norm: bool, cu_seqlens: Optional[Tensor],
                      chunk_size: int, save_states: bool, gating: Optional[Gating] = None
                      ) -> tuple[Tensor, Tensor, Optional[Tensor], bool]:
    """:func:`chunk_fwd`'s results and whether every input the kernels check was finite: k,
    v and beta, and g neither NaN nor ``+inf`` (after the activations with ``gating``), as
    :func:`~torch_gdr.ops.torch.nonfinite.find_nonfinite` judges them. Where they all are, the
    outputs need no containment (a NaN q or an overflow stays where the recurrence has it), and
    the caller is spared a pass over o (:func:`~torch_gdr.ops.torch.nonfinite.contained`)."""
    ext = _extension()
    q, k, v, g, beta, cu = _prepare(q, k, v, g, beta, cu_seqlens, views=True)
    o, final_state, states, nonfinite = ext.chunk_fwd(q, k, v, g, beta, _scale(scale, q), _state(initial_state),
                                                      bool(use_qk_l2norm), cu,
                                                      forward_chunk_size(chunk_size, save_states), bool(save_states),
                                                      True, _mode(), *_gating_args(gating))
    return o, final_state, (states if save_states else None), not nonfinite


def chunk_bwd(grad_o: Optional[Tensor], grad_final_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
              g: Tensor, beta: Tensor, scale: Optional[float], initial_state: Optional[Tensor], use_qk_l2norm: bool,
              cu_seqlens: Optional[Tensor], chunk_size: int, chunk_states: Optional[Tensor],
              gating: Optional[Gating] = None) -> tuple[Optional[Tensor], ...]:
    """Gradients of :func:`chunk_fwd` for the loss with gradients ``grad_o`` on o (None:
    zeros) and ``grad_final_state`` on the final state (None: zeros).

    ``chunk_states``: what :func:`chunk_fwd` returned with ``save_states``, or None to
    recompute them (one more forward scan, without outputs).

    Returns:
        ``(dq, dk, dv, dg, dbeta, d_initial_state)`` in the shapes and dtypes of their
        inputs; ``d_initial_state`` is None when ``initial_state`` is None. With ``gating``
        (a flag set) also ``dA_log, ddt_bias``, each None where its input is None.
    """
    ext = _extension()
    gating_args = _gating_args(gating)
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    q_, k_, v_, g_, beta_, cu = _prepare(q, k, v, g, beta, cu_seqlens)
    scale_ = _scale(scale, q)
    if chunk_states is None:
        _, _, chunk_states, _ = ext.chunk_fwd(q_, k_, v_, g_, beta_, scale_, _state(initial_state),
                                              bool(use_qk_l2norm), cu, int(chunk_size), True, False, _mode(),
                                              *gating_args)
    else:
        expected = (_total_chunks(v_, cu, int(chunk_size)), v.shape[2], q.shape[-1], v.shape[-1])
        if tuple(chunk_states.shape) != expected or chunk_states.dtype != torch.float32:
            raise ValueError(f"chunk_states: expected float32 of shape {list(expected)} for this call, got "
                             f"{chunk_states.dtype} of shape {list(chunk_states.shape)}")
    grads = ext.chunk_bwd(grad_o.to(v.dtype).contiguous(), _state(grad_final_state), q_, k_, v_, g_, beta_, scale_,
                          initial_state is not None, bool(use_qk_l2norm), cu, int(chunk_size),
                          chunk_states.contiguous(), _mode(), *gating_args)
    out = [t.to(dtype) for t, dtype in zip(grads[:5], dtypes)]
    d_initial = grads[5].to(initial_state.dtype) if initial_state is not None else None
    if gating is None or not gating.gated:
        return (*out, d_initial)
    heads = [None if param is None else d.to(param.dtype)
             for d, param in zip(grads[6:8], (gating.A_log, gating.dt_bias))]
    return (*out, d_initial, *heads)


def recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                  initial_state: Optional[Tensor], use_qk_l2norm: bool, cu_seqlens: Optional[Tensor],
                  out_state: Optional[Tensor] = None, gating: Optional[Gating] = None) -> tuple[Tensor, Tensor]:
    """The per-token recurrence, fused (decode and short T).

    ``out_state``: a float32 contiguous ``[N, HV, K, V]`` tensor to write the final state
    into, or None for a new one; it may be ``initial_state`` itself (an in-place step).

    Returns:
        ``o [B, T, HV, V]`` in v's dtype and the final state ``[N, HV, K, V]`` float32
        (``out_state`` when given).
    """
    ext = _extension()
    q, k, v, g, beta, cu = _prepare(q, k, v, g, beta, cu_seqlens, views=True)
    if out_state is not None and (out_state.dtype != torch.float32 or not out_state.is_contiguous()):
        raise ValueError(f"out_state: expected a contiguous float32 tensor, got {out_state.dtype} "
                         f"(contiguous: {out_state.is_contiguous()})")
    initial = initial_state if initial_state is out_state else _state(initial_state)
    return tuple(ext.recurrent_fwd(q, k, v, g, beta, _scale(scale, q), initial, bool(use_qk_l2norm), cu, out_state,
                                   *_gating_args(gating)))
