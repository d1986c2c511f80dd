"""The ``"pypto"`` backend's ops.

``gdr::_pypto_fwd`` runs the PyPTO forward kernel: on Ascend NPU tensors on the device, on
CPU tensors through PyPTO's verify interpreter (a correctness check, not fast). Its backward
op ``gdr::_pypto_bwd`` runs the PyPTO backward kernel (:mod:`.kernel_bwd`), which walks the
chunks in reverse from the state entering each chunk; where that kernel fails, the policy
travelling with the call (``strict``, :mod:`torch_gdr.ops._define`) decides: an error for a
backend the caller named (or strict mode), else the pure-torch backward on the same device
with one warning per reason. Both ops trust their arguments: dispatch has checked them and
that the backend serves the call (:mod:`.backend`).

fla's gate and beta activations (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``,
``allow_neg_eigval``) are computed inside the kernels (:mod:`.kernel_gating`): both ops
are defined with ``in_kernel_gating``, so they receive the raw gate and beta logits, the
forward kernel activates them as it reads a chunk, and the backward kernel applies the
chain rule to its gradients per token; ``dA_log`` and ``ddt_bias`` are sums over tokens of
its per-token terms, in torch (:func:`.backward.launch_backward`). The pure-torch fallback
of the backward applies the activations and their chain rule in torch
(:mod:`torch_gdr._gating`).
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._fallback import failure_reason, refuse_or_warn
from torch_gdr._gating import gating_of
from torch_gdr._layout import GdrCall
from torch_gdr.ops._define import define_backend, define_backward_op
from torch_gdr.ops.torch.chunk_backward import raw_call_backward
from torch_gdr.ops.torch.nonfinite import contained

from .backward import launch_backward
from .forward import launch_forward
from .kernel import kernel_chunk_size
from .spec import CHUNK_SIZES

Tensor = torch.Tensor


def _token_major(x: Tensor) -> Tensor:
    return x.flatten(0, 1)


def _packed(call: GdrCall) -> tuple[Tensor, int]:
    """The call's ``cu_seqlens`` (B equal-length sequences packed as varlen: the kernels read
    token-major input with offsets) and the kernels' chunk size for it, the same for the
    forward and the backward."""
    q, v = call.q, call.v
    batch_size, seq_len = q.shape[:2]
    cu_seqlens = call.cu_seqlens
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch_size + 1, device=q.device) * seq_len
    chunk_size = kernel_chunk_size(q.shape[-1], v.shape[-1], max(call.seq_lens, default=0),
                                   num_seqs=call.num_seqs, num_v_heads=v.shape[2])
    return cu_seqlens, chunk_size


def pypto_forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The forward kernel on a call in the canonical layout; with ``save_chunk_states`` also
    the state entering every kernel chunk, ``[C, HV, K, V]`` fp32 (what the backward reads).
    A NaN or inf in the inputs spreads as in the recurrence (:mod:`torch_gdr.ops.torch.nonfinite`)."""
    return contained(_kernel_forward, call, save_chunk_states)


def _kernel_forward(call: GdrCall, save_chunk_states: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    cu_seqlens, _ = _packed(call)
    o, final_state, chunk_states = launch_forward(
        _token_major(q), _token_major(k), _token_major(v), _token_major(g), _token_major(beta), cu_seqlens,
        None if call.initial_state is None else call.initial_state.float(),
        scale=call.scale, use_qk_l2norm_in_kernel=call.use_qk_l2norm, output_chunk_states=save_chunk_states,
        gating=gating_of(call))
    return o.view(v.shape).to(v.dtype), final_state, chunk_states


def pypto_backward(call: GdrCall, grad_o: Tensor, grad_final_state: Optional[Tensor],
                   chunk_states: Optional[Tensor], strict: bool = False) -> tuple[Optional[Tensor], ...]:
    """The PyPTO backward kernel on a call in the canonical layout (B equal-length sequences
    packed as varlen, the kernel's chunk size as the forward's). Where it cannot serve the
    call (a configuration the forward ran on, but a kernel that fails to build or run), the
    fallback policy: with ``strict`` (the backend was named, or strict mode) a
    ``PyptoBackendError``, else the pure-torch backward on the same device, with one warning
    per reason. A gated call (raw g and beta, :mod:`torch_gdr._gating`) gets the gradients
    of the raw inputs and ``(dA_log, ddt_bias)`` after the initial state's."""
    q, k, v, g, beta = call.q, call.k, call.v, call.g, call.beta
    cu_seqlens, chunk_size = _packed(call)
    try:
        dq, dk, dv, dg, dbeta, d_initial, *d_heads = launch_backward(
            _token_major(grad_o), grad_final_state, _token_major(q), _token_major(k), _token_major(v),
            _token_major(g), _token_major(beta), cu_seqlens, call.initial_state, chunk_states, scale=call.scale,
            use_qk_l2norm_in_kernel=call.use_qk_l2norm, chunk_size=chunk_size, gating=gating_of(call))
        return (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g.shape), dbeta.view(beta.shape),
                d_initial, *d_heads)
    except Exception as error:  # noqa: BLE001 - a kernel failing to build or run is a fallback reason
        reason = failure_reason("the backward kernel", error)
    refuse_or_warn("pypto", reason, named=strict, instead="the pure-torch backward")
    return raw_call_backward(call, grad_o, grad_final_state)


pypto_bwd = define_backward_op("gdr::_pypto_bwd", pypto_backward, in_kernel_gating=True)


def _states_shape(q: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], chunk_size: int,
                  use_qk_l2norm: bool) -> list[Optional[int]]:
    """``[C, HV, K, V]``: C, the number of kernel chunks, follows the lengths and the kernel's
    chunk size, known once the op has run."""
    return [None, v.shape[-2], q.shape[-1], v.shape[-1]]


pypto_fwd = define_backend("pypto", pypto_forward, pypto_bwd, _states_shape, in_kernel_gating=True)


def pypto_step(call: GdrCall) -> tuple[Tensor, Tensor]:
    """The step entry: one launch of the chunked forward kernel at its smallest chunk
    (differentiable through the op's autograd), canonical layout; fla's activations in the
    kernel (raw g and beta where the call's flags say)."""
    o, final_state, _ = pypto_fwd(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state, True,
                                  call.use_qk_l2norm, call.cu_seqlens, CHUNK_SIZES[0], False, False, False,
                                  *gating_of(call))
    return o, final_state
