"""The public call, with the signature of flash-linear-attention's function."""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._validate import check_inputs
from torch_gdr.dispatch.backends import run_forward


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
    backend: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    r"""The chunked gated delta rule, a drop-in for ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``.

    Per sequence and value head, with a key-first state ``S [K, V]``::

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
        o_t = S_t^T (scale q_t)

    Args:
        q: queries ``[B, T, H, K]``, or token-major ``[T, H, K]``; float16, bfloat16,
            float32 or float64.
        k: keys, shape and dtype of q.
        v: values ``[B, T, HV, V]`` (``[T, HV, V]``), dtype of q; ``HV % H == 0`` and value
            head h reads q/k head ``h // (HV // H)``.
        g: raw per-token log decay ``[B, T, HV]`` (``[T, HV]``), any float dtype, ``<= 0``
            (``-inf`` resets the state); the op does the within-chunk cumsum itself.
        beta: write strengths ``[B, T, HV]`` (``[T, HV]``), any float dtype.
        scale: multiplies q (after the l2norm); ``K ** -0.5`` when None.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any
            float dtype, used in float32; zeros when None. N is B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: replace q and k by ``x / sqrt(sum(x**2) + 1e-6)``.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets ``0 = c_0 <= ... <= c_N = T`` of
            sequences packed along T (B must be 1); on the CPU or the inputs' device.
            Sequences never mix; empty ones are allowed.
        chunk_size: tokens per chunk, one of 16, 32, 64, 128; every size gives the same
            result up to rounding.
        state_v_first: states are value-first ``[N, HV, V, K]`` (the layout of vLLM, the
            CANN op and PyPTO) instead of key-first.
        backend: ``"torch"`` (the chunked pure-torch op), ``"recurrent"`` (the per-token
            recurrence) or ``"pypto"`` (the PyPTO kernel: on NPUs, or on the CPU through
            PyPTO's interpreter); None takes ``TORCH_GDR_BACKEND`` or the default for the
            device (``"pypto"`` on NPUs, with a pure-torch fallback; ``"torch"`` elsewhere).

    Returns:
        ``o`` in the shape of v and dtype of v, and the final state (float32; float64 for
        float64 inputs) in the layout of ``initial_state``, or None unless
        ``output_final_state``.

    Raises:
        ValueError: wrong shapes, ranks, devices, ``cu_seqlens`` values, chunk size or backend.
        TypeError: non-floating inputs, non-integer ``cu_seqlens`` or chunk size, a scale
            that is not a real number.
        torch_gdr.dispatch.PyptoBackendError: ``backend="pypto"`` was named and the kernel
            cannot serve the call (pypto absent, an unsupported head dim, dtype or chunk size).
    """
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    scale = None if scale is None else float(scale)
    o, final_state = run_forward(backend, (q, k, v, g, beta, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first),
                                 needs_grad)
    return o, (final_state if output_final_state else None)


chunked_gated_delta_rule = chunk_gated_delta_rule
