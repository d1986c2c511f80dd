"""The public call, with the signature of flash-linear-attention's function."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from torch_gdr._validate import check_inputs
from torch_gdr.dispatch.backends import run_forward
from torch_gdr.ops.cpu import kernels as cpu_kernels
from torch_gdr.ref.checkpoints import chunk_gated_delta_rule_with_checkpoints
from torch_gdr.ref.fused_recurrent import fused_recurrent_gated_delta_rule as _fused_recurrent_reference

if TYPE_CHECKING:
    from torch_gdr.distributed import CPContext


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
    checkpoint_every: Optional[int] = None,
    cp_context: Optional["CPContext"] = None,
) -> tuple[Optional[torch.Tensor], ...]:
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
            device (``"pypto"`` on NPUs, with a pure-torch fallback; ``"fla"`` on CUDA where
            fla-core imports, with a pure-torch fallback; ``"torch"`` elsewhere).
        checkpoint_every: for serving (prefix caching, speculative decoding), also return the
            state after every ``checkpoint_every`` tokens of each sequence, a positive multiple
            of ``chunk_size`` (FlashInfer's ``state_checkpoints`` convention, see
            :mod:`torch_gdr.ref.checkpoints`); inference only (no autograd), pure-torch path.
        cp_context: context parallelism (:func:`torch_gdr.distributed.build_cp_context`, fla's
            name): the tensors are this rank's slice ``[1, T_local, ...]`` of a packed batch
            split over the context's process group, ``cu_seqlens`` None or the context's local
            offsets; every rank calls together (one all-gather forward, one in the backward).
            See :func:`torch_gdr.distributed.context_parallel_chunk_gated_delta_rule`.

    Returns:
        ``o`` in the shape of v and dtype of v (q/k may have another float dtype than v), and
        the final state (float32; float64 for float64 inputs) in the layout of
        ``initial_state``, or None unless ``output_final_state``. With ``checkpoint_every``,
        also the checkpoints ``[num_checkpoints, HV, K, V]`` (state layout as the final
        state's) and ``checkpoint_offsets [N + 1]`` int64, sequence n's checkpoints being rows
        ``checkpoint_offsets[n]:checkpoint_offsets[n + 1]``.

    Raises:
        ValueError: wrong shapes, ranks, devices, ``cu_seqlens`` values, chunk size or backend.
        TypeError: non-floating inputs, non-integer ``cu_seqlens`` or chunk size, a scale
            that is not a real number.
        torch_gdr.dispatch.PyptoBackendError: ``backend="pypto"`` was named and the kernel
            cannot serve the call (pypto absent, an unsupported head dim, dtype or chunk size).
    """
    if cp_context is not None:
        from torch_gdr.distributed import context_parallel_chunk_gated_delta_rule

        return context_parallel_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            state_v_first=state_v_first, backend=backend, cp_context=cp_context)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    if checkpoint_every is not None:
        if needs_grad:
            raise ValueError("checkpoint_every: checkpoints are for inference; call under torch.no_grad() (an input "
                             "requires grad)")
        o, final_state, checkpoints, offsets = chunk_gated_delta_rule_with_checkpoints(
            q, k, v, g, beta, checkpoint_every, scale, initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, state_v_first=state_v_first)
        return o, (final_state if output_final_state else None), checkpoints, offsets
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    scale = None if scale is None else float(scale)
    o, final_state = run_forward(backend, (q, k, v, g, beta, scale, initial_state, output_final_state,
                                           use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first),
                                 needs_grad)
    return o, (final_state if output_final_state else None)


chunked_gated_delta_rule = chunk_gated_delta_rule


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule one token at a time, for decoding and short inputs, with the
    signature of ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` (pass ``beta``
    by name with fla >= 0.6 habits). Where no gradient is needed it runs a fused kernel: fla's
    fused-recurrent kernel on CUDA tensors where fla-core imports, the fused C++ step on CPU
    tensors (float32/16, bfloat16, q and v of one dtype); everywhere else the pure-torch step
    (:func:`torch_gdr.ref.fused_recurrent.fused_recurrent_gated_delta_rule`, differentiable).
    Arguments and results as :func:`chunk_gated_delta_rule`'s (g None: no decay; beta None:
    ones)."""
    from torch_gdr.ops import fla

    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    kwargs = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and g is not None and beta is not None \
            and not needs_grad:
        if q.device.type == "cuda" and fla.fused_recurrent_unavailable_reason(q, v, needs_backward=False) is None:
            return _fused_step(fla.fla_fused_recurrent_fwd, q, k, v, g, beta, scale, initial_state,
                               output_final_state, **kwargs)
        if (q.device.type == "cpu" and q.dtype == v.dtype and v.dtype in cpu_kernels.KERNEL_DTYPES
                and cpu_kernels.available()):
            return _fused_step(_cpu_step, q, k, v, g, beta, scale, initial_state, output_final_state, **kwargs)
    return _fused_recurrent_reference(q, k, v, g, beta, scale, initial_state, output_final_state, **kwargs)


def _cpu_step(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    del output_final_state  # the kernel always writes it
    return cpu_kernels.recurrent_fwd(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens)


def _fused_step(kernel, q, k, v, g, beta, scale, initial_state, output_final_state, *, use_qk_l2norm_in_kernel,
                cu_seqlens, state_v_first):
    """A fused per-token kernel (fla's on CUDA, ours on the CPU) on a checked call in any
    public layout; ``kernel`` takes the canonical layout and returns ``(o, final_state)``."""
    from torch_gdr._layout import canonical_call

    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, 16, state_v_first)
    call = canonical_call(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, 16,
                          state_v_first)
    o, final_state = kernel(call.q, call.k, call.v, call.g, call.beta, call.scale, call.initial_state, True,
                            call.use_qk_l2norm, call.cu_seqlens)
    o, final_state = call.public_outputs(o, final_state)
    return o, (final_state if output_final_state else None)
