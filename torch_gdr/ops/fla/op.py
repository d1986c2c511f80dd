"""The ``"fla"`` backend's ops: fla-core's Triton kernels behind our fake and our autograd.

``gdr::_fla_fwd`` runs :func:`fla_chunk_fwd`; with ``save_chunk_states`` it also returns
what fla's backward needs beside the op's inputs (``g_cumsum``, ``A``, ``q_rstd``,
``k_rstd``) packed into one flat float32 tensor (``A`` in fp16/bf16 widens to float32
exactly and narrows back exactly), so that ``gdr::_fla_bwd`` recomputes nothing fla itself
would not. Its size follows the shapes only, never the data. A refusal of fla's backward
that shows only when it runs (:class:`FlaRefusal`) falls back to the pure-torch backward
on the same device, with one warning per reason (an error where the backend was named or
with ``TORCH_GDR_STRICT=1``); dispatch predicts the refusals it can before the forward runs.
``gdr::_fla_step`` runs fla's fused-recurrent kernel (inference only). All three take fla's
activation arguments (``use_gate_in_kernel`` with ``A_log`` and ``dt_bias``,
``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval``) and hand them to fla's kernels, which
apply them as fla's own functions do (:mod:`torch_gdr.ops.fla`); the backward returns the
raw inputs' gradients and those of ``A_log`` and ``dt_bias``. Its pure-torch fallback
applies them in torch (:func:`~torch_gdr.ops.torch.chunk_backward.raw_call_backward`).
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._fallback import refuse_or_warn
from torch_gdr._gating import Gating, gating_of
from torch_gdr._layout import GdrCall
from torch_gdr.ops._define import define_backend, define_backward_op, define_step_op
from torch_gdr.ops.torch.chunk_backward import raw_call_backward

from . import FlaRefusal, fla_chunk_bwd, fla_chunk_fwd, fla_chunk_size, fla_fused_recurrent_fwd

Tensor = torch.Tensor


def _saved_shapes(q_shape: tuple, v_shape: tuple, chunk_size: int, use_qk_l2norm: bool) -> list[tuple[int, ...]]:
    """Shapes of ``g_cumsum [B, T, HV]``, ``A [B, T, HV, BT]``, ``q_rstd``, ``k_rstd`` (``[B, T, H]``
    or empty)."""
    lead, num_v_heads = tuple(v_shape[:2]), v_shape[2]
    rstd = lead + (q_shape[2],) if use_qk_l2norm else (0,)
    return [lead + (num_v_heads,), lead + (num_v_heads, fla_chunk_size(chunk_size)), rstd, rstd]


def _packed_numel(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int,
                  use_qk_l2norm: bool) -> list[int]:
    q_shape = (1,) + tuple(q.shape) if q.dim() == 3 else tuple(q.shape)
    v_shape = (1,) + tuple(v.shape) if v.dim() == 3 else tuple(v.shape)
    shapes = _saved_shapes(q_shape, v_shape, chunk_size, use_qk_l2norm)
    total = 0
    for shape in shapes:
        numel = 1
        for size in shape:
            numel *= size
        total += numel
    return [total]


def _forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    o, final_state, *saved = fla_chunk_fwd(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                                           True, call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, gating_of(call))
    packed = torch.cat([t.reshape(-1).float() for t in saved]) if save_chunk_states else None
    return o, final_state, packed


def _unpack(call: GdrCall, packed: Tensor) -> list[Tensor]:
    shapes = _saved_shapes(tuple(call.q.shape), tuple(call.v.shape), call.chunk_size, call.use_qk_l2norm)
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    g_cumsum, a, q_rstd, k_rstd = (part.view(shape) for part, shape in zip(packed.split(sizes), shapes))
    return [g_cumsum, a.to(call.q.dtype), q_rstd, k_rstd]


def _backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor],
              packed: Optional[Tensor], strict: bool) -> tuple[Optional[Tensor], ...]:
    try:
        if packed is None:  # nothing kept (the forward ran without save_chunk_states): fla's forward again
            _, _, *saved = fla_chunk_fwd(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                                         False, call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, gating_of(call))
        else:
            saved = _unpack(call, packed)
        return fla_chunk_bwd(grad_o, grad_final_state, call.q, call.k, call.v, call.g, call.beta, *saved, call.scale,
                             call.initial_state, call.use_qk_l2norm, call.cu_seqlens, call.chunk_size, gating_of(call))
    except FlaRefusal as refusal:
        refuse_or_warn("fla", refusal.reason, named=strict, instead="the pure-torch backward")
        return raw_call_backward(call, grad_o, grad_final_state)


fla_bwd = define_backward_op("gdr::_fla_bwd", _backward, in_kernel_gating=True)
fla_fwd = define_backend("fla", _forward, fla_bwd, _packed_numel, in_kernel_gating=True)


def _step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Optional[Tensor],
          use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], use_gate_in_kernel: bool = False,
          A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
          allow_neg_eigval: bool = False) -> tuple[Tensor, Tensor]:
    """fla's fused-recurrent step, fla's activations in its kernel."""
    gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return fla_fused_recurrent_fwd(q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens,
                                   gating)


fla_step_op = define_step_op("gdr::_fla_step", _step)


def fla_step(call: GdrCall) -> tuple[Tensor, Tensor]:
    """The step entry on a checked call in the canonical layout."""
    return fla_step_op(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state,
                       call.use_qk_l2norm, call.cu_seqlens, *gating_of(call))
