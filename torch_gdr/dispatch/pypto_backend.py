"""The ``"pypto"`` backend: the PyPTO kernel where it can serve a call, else a fallback.

On NPU tensors the kernel runs on the device; on CPU tensors the same kernel runs through
PyPTO's verify interpreter, so every CPU machine can check it. Gradients come from the
pure-torch backward op on the same device.

Where the kernel cannot serve a call (see :func:`unsupported_reason`, or a kernel that
fails to build or run), a call that asked for the backend by name (``backend="pypto"`` or
``TORCH_GDR_BACKEND=pypto``) raises :class:`PyptoBackendError`; the default backend of an
NPU device warns once per reason and runs the pure-torch path on the same device.
``TORCH_GDR_STRICT=1`` turns every fallback into an error.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Optional

import torch

from torch_gdr._layout import run_in_canonical_layout
from torch_gdr.dispatch.device import is_npu_device
from torch_gdr.dispatch.kernel_cache import pick_chunk_size
from torch_gdr.ops.registration import _check_real, chunked_pure_torch
from torch_gdr.ref.chunk import chunk_gated_delta_rule_fwd

STRICT_ENV_VAR = "TORCH_GDR_STRICT"
KERNEL_HEAD_DIMS: tuple[int, ...] = (64, 128)
KERNEL_CHUNK_SIZES: tuple[int, ...] = (32, 64, 128)
KERNEL_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

Tensor = torch.Tensor


class PyptoBackendError(RuntimeError):
    """The PyPTO backend was asked for by name and cannot serve the call."""


class PyptoFallbackWarning(RuntimeWarning):
    """The default backend fell back from the PyPTO kernel to the pure-torch path."""


_warned: set[str] = set()
_warned_lock = threading.Lock()


def strict_mode() -> bool:
    """True when ``TORCH_GDR_STRICT`` asks for every fallback to be an error."""
    return os.environ.get(STRICT_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def unsupported_reason(q: Tensor, v: Tensor, chunk_size: int) -> Optional[str]:
    """Why the kernel cannot serve a call with these inputs, or None when it can."""
    from torch_gdr.ops.pypto import is_pypto_available

    device_type = q.device.type
    if device_type != "cpu" and not is_npu_device(device_type):
        return f"PyPTO runs on Ascend NPUs (and on the CPU through its interpreter), not on {device_type!r} tensors"
    if not is_pypto_available():
        return "pypto is not installed (pip install 'torch_gdr[npu]', which brings pypto==0.2.0)"
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernel computes in float32 and takes float32/float16/bfloat16 inputs, got {q.dtype}"
    head_k_dim, head_v_dim = q.shape[-1], v.shape[-1]
    if head_k_dim not in KERNEL_HEAD_DIMS or head_v_dim not in KERNEL_HEAD_DIMS:
        return f"the kernel has head dims K, V in {list(KERNEL_HEAD_DIMS)}, got K = {head_k_dim}, V = {head_v_dim}"
    if chunk_size not in KERNEL_CHUNK_SIZES:
        return f"the kernel has chunk sizes {list(KERNEL_CHUNK_SIZES)}, got chunk_size = {chunk_size}"
    return None


def _warn_fallback(reason: str) -> None:
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(f"torch_gdr: the PyPTO kernel cannot serve this call ({reason}); running the pure-torch "
                  f"chunked path on the same device instead. Set {STRICT_ENV_VAR}=1 to make this an error.",
                  PyptoFallbackWarning, stacklevel=5)


def _kernel_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens, chunk_size):
    """The kernel in the canonical layout (batched, key-first state): packs B equal-length
    sequences as varlen, since the kernel reads token-major input with offsets."""
    from torch_gdr.ops.pypto import pypto_chunk_gated_delta_rule_fwd

    batch_size, seq_len = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(batch_size + 1, device=q.device) * seq_len
        max_seqlen = seq_len
    else:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    chunk_size = pick_chunk_size(max_seqlen, chunk_size)
    o, final_state, _ = pypto_chunk_gated_delta_rule_fwd(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), g.flatten(0, 1), beta.flatten(0, 1), cu_seqlens,
        None if initial_state is None else initial_state.float(),
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    return o.view(v.shape).to(v.dtype), final_state


class _PyptoChunkedGatedDeltaRule(torch.autograd.Function):
    """Kernel forward, pure-torch backward (the op's backward on the same device)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, g, beta, initial_state, options: tuple) -> tuple[Tensor, Tensor]:
        scale, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first = options
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.options = options
        return run_in_canonical_layout(_kernel_forward, q, k, v, g, beta, scale, initial_state,
                                       use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)

    @staticmethod
    def backward(ctx: Any, grad_o: Tensor, grad_final_state: Tensor) -> tuple:
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        scale, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first = ctx.options
        grads = torch.ops.gdr.chunked_gated_delta_rule_backward(
            grad_o, grad_final_state, q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
            chunk_size, state_v_first)
        dq, dk, dv, dg, dbeta, d_initial = grads
        return dq, dk, dv, dg, dbeta, (d_initial if initial_state is not None else None), None


def pypto_forward_or_fallback(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                              chunk_size, state_v_first, *, explicit: bool,
                              differentiable: bool) -> tuple[Tensor, Tensor]:
    """Run the kernel, or fall back as the module doc says; returns ``(o, final_state)``."""
    reason = unsupported_reason(q, v, chunk_size)
    if reason is None:
        try:
            if differentiable:
                options = (scale, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)
                return _PyptoChunkedGatedDeltaRule.apply(q, k, v, g, beta, initial_state, options)
            return run_in_canonical_layout(_kernel_forward, q, k, v, g, beta, scale, initial_state,
                                           use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)
        except Exception as error:  # noqa: BLE001 - a kernel that fails to build or run is a fallback reason
            if explicit or strict_mode():
                raise PyptoBackendError(f"backend 'pypto': the kernel failed: {type(error).__name__}: {error}") \
                    from error
            reason = f"the kernel failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if explicit or strict_mode():
        raise PyptoBackendError(f"backend 'pypto' cannot serve this call: {reason}")
    _warn_fallback(reason)
    if differentiable:  # the "torch" backend's path: under autograd it keeps the chunk states
        return chunked_pure_torch(q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens,
                                  chunk_size, state_v_first)
    return run_in_canonical_layout(chunk_gated_delta_rule_fwd, q, k, v, g, beta, scale, initial_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)


def pypto_backend(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                  chunk_size, state_v_first, *, explicit: bool = True) -> tuple[Tensor, Tensor]:
    """The backend callable: the op's arguments in order; returns ``(o, final_state)``."""
    _check_real(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    return pypto_forward_or_fallback(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                     chunk_size, state_v_first, explicit=explicit, differentiable=True)


def _npu_op_impl(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_v_first=False):
    """The op's implementation for Ascend NPU tensors (the ``privateuseone`` dispatch key)."""
    _check_real(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    o, final_state = pypto_forward_or_fallback(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first,
        explicit=False, differentiable=False)
    return o, (final_state if output_final_state else final_state.new_empty(0))


torch.library.register_kernel("gdr::chunked_gated_delta_rule", "privateuseone", _npu_op_impl)
