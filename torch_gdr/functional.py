"""The public call, with the signature of flash-linear-attention's function."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Callable, Optional

import torch

from torch_gdr._decode_memo import SignatureMemo, signature
from torch_gdr._fallback import strict_mode
from torch_gdr._gating import Gating, apply_gating, check_gating
from torch_gdr._inplace import check_inplace_state, resolve_inplace_flag
from torch_gdr._layout import canonical_call, compute_dtype_for
from torch_gdr._pool import (FP8_DTYPES, check_no_grad, check_pool_args, pool_chunk_prefill, rows_packed,
                             store_cast, token_states_buffer)
from torch_gdr._validate import CHUNK_SIZES, check_inputs, resolve_varlen_metadata
from torch_gdr.dispatch.run import needs_grad as _needs_grad
from torch_gdr.dispatch.pool_serve import run_pool_serve
from torch_gdr.dispatch.registry import BACKEND_ENV_VAR, Selection, default_backend
from torch_gdr.dispatch.run import (run_checkpoints, run_chunk, run_pool_step, run_step, run_step_inplace,
                                    select_pool_step)
from torch_gdr.ops._backend import OpArgs
from torch_gdr.ops.torch.checkpoints import check_checkpoint_every

if TYPE_CHECKING:
    from torch_gdr.distributed import CPContext


def _state_v_first(state_v_first: bool, transpose_state_layout: Optional[bool]) -> bool:
    """``state_v_first``, or fla's deprecated ``transpose_state_layout`` for it (with fla's
    warning and its refusal of both at once)."""
    if transpose_state_layout is None:
        return state_v_first
    if not isinstance(transpose_state_layout, bool):
        raise TypeError(f"transpose_state_layout: expected a bool, got {type(transpose_state_layout).__name__} "
                        f"{transpose_state_layout!r}")
    if state_v_first:
        raise ValueError("transpose_state_layout: the deprecated name of state_v_first; pass only one of them, got "
                         "both (state_v_first=True)")
    warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first", DeprecationWarning,
                  stacklevel=3)
    return transpose_state_layout


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
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_indices: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
    transpose_state_layout: Optional[bool] = None,
    backend: Optional[str] = None,
    checkpoint_every: Optional[int] = None,
    cp_context: Optional["CPContext"] = None,
    initial_state_indices: Optional[torch.Tensor] = None,
    final_state_indices: Optional[torch.Tensor] = None,
    checkpoint_offsets: Optional[torch.Tensor] = None,
    checkpoint_indices: Optional[torch.Tensor] = None,
    validate: bool = True,
    inplace_final_state: Optional[bool] = None,
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
            (``-inf`` resets the state); the op does the within-chunk cumsum itself. With
            ``use_gate_in_kernel`` the raw gate ``a`` instead.
        beta: write strengths ``[B, T, HV]`` (``[T, HV]``), any float dtype. With
            ``use_beta_sigmoid_in_kernel`` the beta logits instead.
        scale: multiplies q (after the l2norm); ``K ** -0.5`` when None.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``), any
            float dtype, used in float32; zeros when None. N is B, or the number of
            sequences with ``cu_seqlens``.
        output_final_state: return the final state.
        use_qk_l2norm_in_kernel: replace q and k by ``x / sqrt(sum(x**2) + 1e-6)``.
        use_gate_in_kernel: ``g`` is the raw gate ``a`` and the decay is
            ``-exp(A_log) * softplus(a + dt_bias)``, computed in float32 (softplus threshold
            20) with gradients for ``a``, ``A_log`` and ``dt_bias`` (fla's name and meaning;
            see :mod:`torch_gdr._gating`): inside the ``"cpu"`` kernels, in torch around
            the other backends'.
        A_log: ``[HV]`` float, the log decay rates; required with ``use_gate_in_kernel``, and
            refused without it.
        dt_bias: ``[HV]`` float added to ``a`` before the softplus, or None; only with
            ``use_gate_in_kernel``.
        use_beta_sigmoid_in_kernel: ``beta`` holds logits and the op uses ``sigmoid(beta)``
            (in float32), with its gradient.
        allow_neg_eigval: beta is scaled by 2 after the sigmoid (range ``[0, 2]``, negative
            eigenvalues of the transition); requires ``use_beta_sigmoid_in_kernel`` (fla's rule).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets ``0 = c_0 <= ... <= c_N = T`` of
            sequences packed along T (B must be 1); on the CPU or the inputs' device.
            Sequences never mix; empty ones are allowed.
        cu_seqlens_cpu: the host copy of ``cu_seqlens`` (CPU, same values): the call reads it
            instead of ``cu_seqlens``, which saves a host sync on accelerators. Checked equal to
            ``cu_seqlens`` where that reads no device memory, or with ``TORCH_GDR_VALIDATE=1``.
        chunk_indices: fla's precomputed ``[num_chunks, 2]`` rows ``[sequence, chunk]`` of
            ``cu_seqlens`` at ``chunk_size``; accepted and checked like ``cu_seqlens_cpu``,
            otherwise unused (the backends chunk by themselves).
        chunk_size: tokens per chunk, one of 16, 32, 64, 128; every size gives the same
            result up to rounding.
        state_v_first: states are value-first ``[N, HV, V, K]`` (the layout of vLLM, the
            CANN op and PyPTO) instead of key-first.
        transpose_state_layout: fla's deprecated name of ``state_v_first``: taken for it with
            a ``DeprecationWarning``; passing it with ``state_v_first=True`` raises.
        backend: ``"cpu"`` (the fused C++ kernels, CPU tensors), ``"torch"`` (the chunked
            algorithm in pure torch, any device), ``"recurrent"`` (the per-token recurrence),
            ``"pypto"`` (the PyPTO kernel: on NPUs, or on the CPU through PyPTO's
            interpreter) or ``"fla"`` (fla-core's kernels, CUDA); None takes
            ``TORCH_GDR_BACKEND`` or the first backend of the device's order that serves the
            call (``"cpu"`` on CPU tensors, ``"pypto"`` on NPUs, ``"fla"`` on CUDA, then
            ``"torch"``; see :mod:`torch_gdr.dispatch.registry`).
        checkpoint_every: for serving (prefix caching, speculative decoding), also return the
            state after every ``checkpoint_every`` tokens of each sequence, a positive multiple
            of ``chunk_size`` (FlashInfer's ``state_checkpoints`` convention, see
            :mod:`torch_gdr.ops.torch.checkpoints`); inference only (no autograd); served by
            the backends that have checkpoints (``"torch"``); not with ``cp_context``.
        cp_context: context parallelism (:func:`torch_gdr.distributed.build_cp_context`, fla's
            name): the tensors are this rank's slice ``[1, T_local, ...]`` of a packed batch
            split over the context's process group, ``cu_seqlens`` None or the context's local
            offsets; every rank calls together (one all-gather forward, one in the backward).
            See :func:`torch_gdr.distributed.context_parallel_chunk_gated_delta_rule`.
        initial_state_indices: serving over a state pool (:mod:`torch_gdr._pool`):
            ``initial_state`` is then the pool ``[slots, HV, K, V]`` (value-first with
            ``state_v_first``; float32, bfloat16 or float16, padded row strides allowed) and
            sequence n starts from row ``initial_state_indices[n]`` (``[N]`` int32/int64; -1:
            a zero state). Inference only. The call returns ``(o, pool)``, the pool updated
            in place.
        final_state_indices: ``[N]`` rows the final states are written to (-1: not written);
            None: the initial rows.
        checkpoint_offsets, checkpoint_indices: ``[N, M]`` (or ``[N]``): the state of sequence
            n after its first ``checkpoint_offsets[n, m]`` tokens (any offset, not only
            multiples of the chunk) is written to row ``checkpoint_indices[n, m]`` (-1:
            padding), within the one pass over the tokens.
        validate: check pool indices also when they live on a device (a host sync); indices
            on the CPU are always checked.
        inplace_final_state: True: write the final state into ``initial_state`` (which must
            be given) in place and return that tensor as the final state (vLLM's meaning;
            inference only, a float32/float16/bfloat16 state, each sequence's state
            contiguous: :mod:`torch_gdr._inplace`). None or False: fla's behaviour,
            ``initial_state`` untouched and a new final state; over a state pool (always
            in place) None or True.

    Returns:
        ``o`` in the shape of v and dtype of v (q/k may have another float dtype than v), and
        the final state (float32; float64 for float64 inputs) in the layout of
        ``initial_state``, or None unless ``output_final_state``. With ``checkpoint_every``,
        also the checkpoints ``[num_checkpoints, HV, K, V]`` (state layout as the final
        state's) and ``checkpoint_offsets [N + 1]`` int64, sequence n's checkpoints being rows
        ``checkpoint_offsets[n]:checkpoint_offsets[n + 1]``.

    Raises:
        ValueError: wrong shapes, ranks, devices, ``cu_seqlens`` values, chunk size or backend;
            activation arguments that conflict (``A_log`` without ``use_gate_in_kernel`` or
            the reverse, ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel``),
            ``cu_seqlens_cpu``/``chunk_indices`` that do not match ``cu_seqlens``.
        TypeError: non-floating inputs, non-integer ``cu_seqlens`` or chunk size, a scale
            that is not a real number, a flag that is not a bool, a state of a dtype
            ``inplace_final_state`` cannot write.
        ValueError: with ``inplace_final_state=True``, a state that requires grad (or inputs
            autograd records), is not writable in place, or is not laid out as pool rows.
        torch_gdr.dispatch.BackendError: the backend named (``backend`` or
            ``TORCH_GDR_BACKEND``) cannot serve the call (its subclass says which backend:
            ``PyptoBackendError`` for pypto absent, an unsupported head dim, dtype or chunk
            size...), or strict mode is on and a default had to fall back.
    """
    state_v_first = _state_v_first(state_v_first, transpose_state_layout)
    pooled = any(x is not None for x in (initial_state_indices, final_state_indices, checkpoint_offsets,
                                         checkpoint_indices))
    # over a pool, initial_state is the pool: its checks are the pool's (torch_gdr._pool)
    check_inputs(q, k, v, g, beta, scale, None if pooled else initial_state, cu_seqlens, chunk_size, state_v_first)
    check_gating(v.shape[-2], q.device, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    cu_seqlens = resolve_varlen_metadata(cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, q.device)
    gating = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    inplace = resolve_inplace_flag(inplace_final_state, pooled)
    if pooled and not inplace:
        raise ValueError("inplace_final_state: a state pool (initial_state_indices) is always updated in place; "
                         "pass None or True, got False")
    target = None  # the caller's state that receives the final state in place
    if inplace and not pooled:
        target = check_inplace_state(initial_state, compute_dtype_for(_wider(q.dtype, v.dtype)),
                                     (q, k, v, g, beta, A_log, dt_bias))
        output_final_state = True
    if pooled:
        # before the activations and the pool's own no_grad pass, where grad mode is still seen
        check_no_grad(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    if cp_context is not None or pooled:
        # context parallelism and pool prefill compose chunked calls of their own: they get
        # the activated g and beta (differentiable torch, torch_gdr._gating)
        g, beta = apply_gating(g, beta, **gating)
    if cp_context is not None:
        if checkpoint_every is not None:
            raise ValueError(f"checkpoint_every: not available with cp_context (each rank holds a slice of the "
                             f"sequences), got checkpoint_every={checkpoint_every!r}; call without cp_context")
        from torch_gdr.distributed import context_parallel_chunk_gated_delta_rule

        o, final_state = context_parallel_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
            state_v_first=state_v_first, backend=backend, cp_context=cp_context)
        return o, _into(target, final_state)
    if pooled:
        if checkpoint_every is not None:
            raise ValueError(f"checkpoint_every: not available with a state pool (pass checkpoint_offsets and "
                             f"checkpoint_indices instead), got checkpoint_every={checkpoint_every!r}")
        if initial_state_indices is None:
            raise ValueError("initial_state_indices: required with final_state_indices or checkpoints over a "
                             "state pool (the rows each sequence starts from), got None")
        return _pool_prefill(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                             chunk_size, state_v_first, backend, initial_state_indices, final_state_indices,
                             checkpoint_offsets, checkpoint_indices, validate)
    grad = _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    if checkpoint_every is not None and grad:
        raise ValueError("checkpoint_every: checkpoints are for inference; call under torch.no_grad() (an input "
                         "requires grad)")
    scale = None if scale is None else float(scale)
    # raw g and beta with the activation arguments: the op applies them (in its kernels where
    # the backend has them)
    args = OpArgs(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                  chunk_size, state_v_first, **gating)
    if checkpoint_every is not None:
        check_checkpoint_every(checkpoint_every, chunk_size)
        o, final_state, checkpoints, offsets = run_checkpoints(args, checkpoint_every, backend)
        return o, _into(target, final_state if output_final_state else None), checkpoints, offsets
    o, final_state = run_chunk(args, grad, backend)
    return o, _into(target, final_state if output_final_state else None)


def _wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """float64 when either is (the call computes in float64), else ``b``."""
    return torch.float64 if torch.float64 in (a, b) else b


def _into(target: Optional[torch.Tensor], final_state: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The final state, copied into ``target`` (the caller's state, ``inplace_final_state``)
    when there is one, which is then returned instead."""
    if target is None or final_state is None:
        return final_state
    target.copy_(final_state)
    return target


chunked_gated_delta_rule = chunk_gated_delta_rule


def _pool_prefill(q, k, v, g, beta, scale, pool, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first,
                  backend, initial_state_indices, final_state_indices, checkpoint_offsets, checkpoint_indices,
                  validate) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked call over a state pool (:func:`torch_gdr._pool.pool_chunk_prefill`), each
    piece through the backend dispatch picks."""
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"initial_state: expected the state pool tensor with initial_state_indices, got "
                        f"{type(pool).__name__}")

    def chunk_call(q_, k_, v_, g_, beta_, scale_, initial, cu):
        args = OpArgs(q_, k_, v_, g_, beta_, None if scale_ is None else float(scale_), initial, True,
                      use_qk_l2norm_in_kernel, cu, chunk_size, False)
        return run_chunk(args, False, backend)

    with torch.no_grad():
        o = pool_chunk_prefill(q, k, v, g, beta, scale, pool, initial_state_indices=initial_state_indices,
                               final_state_indices=final_state_indices, checkpoint_offsets=checkpoint_offsets,
                               checkpoint_indices=checkpoint_indices, cu_seqlens=cu_seqlens,
                               state_v_first=state_v_first, chunk_call=chunk_call, validate=validate)
    return o, pool


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
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    state_v_first: bool = False,
    transpose_state_layout: Optional[bool] = None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    inplace_final_state: Optional[bool] = None,
    validate: bool = True,
    initial_state_indices: Optional[torch.Tensor] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None,
    intermediate_states_buffer: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None,
    disable_state_update: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule one token at a time, for decoding and short inputs, a drop-in for
    ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule`` (pass ``beta`` by name, as
    fla 0.6 put ``gk, gv`` before it). No chunk padding; cost grows with T one step at a
    time (for long inputs use :func:`chunk_gated_delta_rule`).

    Arguments and results as :func:`chunk_gated_delta_rule`'s (g None: no decay; beta None:
    ones; q/k and v may differ in dtype, computed in float32, float64 when q or v is
    float64; ``use_gate_in_kernel`` needs g, ``use_beta_sigmoid_in_kernel`` needs beta).
    ``gk``/``gv``, fla's per-key and per-value decays, belong to another recurrence (gated
    DeltaProduct/KDA-style gating) and are refused unless None. ``backend`` picks the step: ``"cpu"`` (the fused C++ step, CPU tensors of one
    dtype, inference), ``"torch"`` (plain differentiable torch, any device), ``"recurrent"``
    (the definition), ``"fla"`` (fla's kernel on CUDA, inference) or ``"pypto"`` (one
    chunked PyPTO launch); None takes ``TORCH_GDR_BACKEND`` or the device's order (``"cpu"``
    then ``"torch"`` on CPU tensors, ``"fla"`` then ``"torch"`` on CUDA, ``"torch"``
    elsewhere), so a call that needs gradients runs ``"torch"``.

    Serving over a state pool (vLLM's names and meaning, :mod:`torch_gdr._pool`): with
    ``ssm_state_indices`` (``[N]``: one token per sequence, or ``[N, S]``: up to S tokens for
    speculative verification; int32/int64; -1: a zero state, never written),
    ``initial_state`` is the pool ``[slots, HV, K, V]`` (value-first with ``state_v_first``;
    float32, bfloat16, float16 or fp8: float8_e4m3fn, float8_e5m2, stored by a saturating cast;
    any strides); sequence n starts from row ``ssm_state_indices[n, 0]``, or
    ``ssm_state_indices[n, num_accepted_tokens[n] - 1]`` when ``num_accepted_tokens`` (``[N]``,
    1..S) is given, and the state after its token j is written to row
    ``ssm_state_indices[n, j]``, in place; returns ``(o, pool)``. With
    ``inplace_final_state=False`` the pool is only read (the start rows) and the states go to
    a new tensor ``[tokens, HV, K, V]`` of the pool's dtype and layout, the state after
    flattened token t (``cu_seqlens[n] + j``) in row t, any number of tokens per sequence;
    returns ``(o, states)``. ``initial_state_indices`` (``[N]``, with ``ssm_state_indices``;
    not with ``num_accepted_tokens``): sequence n starts from row ``initial_state_indices[n]``
    instead (-1: a zero state), a decode that reads one row and writes others (FlashInfer's
    ``output_state_indices``); a row it reads may be written in the call by its own sequence
    only. Token trees (EAGLE): ``retrieve_parent_token [N, S]`` (int32/int64): token j of
    sequence n starts from the state after token ``retrieve_parent_token[n, j]`` of the same
    sequence (-1: the sequence's start state); a parent comes before its child. Intermediate
    states in place (SGLang's and FlashInfer's): ``intermediate_states_buffer [R, S_buf, HV,
    K, V]`` (the pool's layout, float32/bfloat16/float16, contiguous) with
    ``intermediate_state_indices [N]`` receives the state after token j of sequence n at
    ``buffer[intermediate_state_indices[n], j]``; ``disable_state_update=True``: the pool is
    read, not written. Inference only. ``validate``: check the indices also when they live
    on a device (a host sync); CPU indices are always checked.

    Without a pool, ``inplace_final_state=True`` writes the final state into ``initial_state``
    in place and returns that tensor (whatever ``output_final_state``): no new state per step,
    the cost of the pool step (:mod:`torch_gdr._inplace`: inference only; a float32, float16
    or bfloat16 state, float64 for float64 calls, each sequence's state contiguous). The
    ``"cpu"`` and ``"pypto"`` backends write it from their pool kernels; the others run their
    step and copy the new state in. None (the default) or False: fla's behaviour,
    ``initial_state`` untouched and a new final state (over a pool, None means True).

    Raises:
        TypeError: non-tensor or non-floating inputs, q and k of different dtypes,
            non-integer ``cu_seqlens``, a flag that is not a bool.
        ValueError: wrong shapes, ranks, devices or ``cu_seqlens`` values, an unknown backend,
            conflicting activation arguments (as :func:`chunk_gated_delta_rule`), ``gk`` or
            ``gv`` given; with ``inplace_final_state=True`` and no pool, a state that is None,
            requires grad (or inputs autograd records), is not writable in place or not laid
            out as pool rows (``TypeError`` for its dtype).
        torch_gdr.dispatch.BackendError: the backend named cannot serve the call.
    """
    route_key = None
    if ssm_state_indices is not None:
        route_key = _pool_route_key(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                                    cu_seqlens, cu_seqlens_cpu, state_v_first, transpose_state_layout, gk, gv, backend,
                                    ssm_state_indices, num_accepted_tokens, inplace_final_state, validate,
                                    initial_state_indices, retrieve_parent_token, intermediate_states_buffer,
                                    intermediate_state_indices, disable_state_update)
        route = _POOL_ROUTES.get(route_key)
        if route is not None:  # the same call as one that passed every check here: the step's own checks remain
            selection, v_first, prepared = route
            if prepared is not None:  # the backend's step of this signature, index values checked
                o = prepared(q, k, v, g, beta, scale, initial_state, ssm_state_indices, num_accepted_tokens,
                             initial_state_indices, A_log, dt_bias, cu_seqlens)
                if o is not None:
                    return o, initial_state
            if cu_seqlens is None:  # varlen: offsets that might break a rule get every check below
                gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
                o = run_pool_step(q, k, v, g, beta, scale, initial_state, ssm_state_indices, num_accepted_tokens,
                                  cu_seqlens=None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  state_v_first=v_first, validate=validate, backend=backend, gating=gating,
                                  initial_state_indices=initial_state_indices, selection=selection)
                return o, initial_state
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, decay in (("gk", gk), ("gv", gv)):
        if decay is not None:
            raise ValueError(f"{name}: per-channel decays are another recurrence than the gated delta rule (one "
                             f"scalar decay g per token and head); expected None, got a tensor of shape "
                             f"{list(decay.shape) if isinstance(decay, torch.Tensor) else type(decay).__name__}")
    if use_gate_in_kernel is True and g is None:
        raise ValueError("g: the raw gate is required with use_gate_in_kernel=True, got None")
    if use_beta_sigmoid_in_kernel is True and beta is None:
        raise ValueError("beta: the beta logits are required with use_beta_sigmoid_in_kernel=True, got None")
    state_v_first = _state_v_first(state_v_first, transpose_state_layout)
    lead = tuple(v.shape[:-1])  # [B, T, HV] or [T, HV]
    if g is None:
        g = torch.zeros(lead, dtype=torch.float32, device=v.device)
    if beta is None:
        beta = torch.ones(lead, dtype=torch.float32, device=v.device)
    if num_accepted_tokens is not None and ssm_state_indices is None:
        raise ValueError("num_accepted_tokens: only with ssm_state_indices (a state pool), got a tensor without them")
    serving = dict(retrieve_parent_token=retrieve_parent_token, intermediate_states_buffer=intermediate_states_buffer,
                   intermediate_state_indices=intermediate_state_indices)
    for name, value in serving.items():
        if value is not None and ssm_state_indices is None:
            raise ValueError(f"{name}: only with ssm_state_indices (a state pool), got a tensor without them")
    if disable_state_update is not False and ssm_state_indices is None:
        raise ValueError("disable_state_update: only with ssm_state_indices (a state pool)")
    serving["disable_state_update"] = disable_state_update
    if initial_state_indices is not None and ssm_state_indices is None:
        raise ValueError("initial_state_indices: the decode's start rows, only with ssm_state_indices (a state "
                         "pool), got a tensor without them")
    pooled = ssm_state_indices is not None
    # over a pool, initial_state is the pool: its checks are the pool's (torch_gdr._pool)
    check_inputs(q, k, v, g, beta, scale, None if pooled else initial_state, cu_seqlens, CHUNK_SIZES[0],
                 state_v_first)
    check_gating(v.shape[-2], q.device, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                 use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    cu_seqlens = resolve_varlen_metadata(cu_seqlens, cu_seqlens_cpu, None, CHUNK_SIZES[0], q.device)
    gating = dict(use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                  use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    inplace = resolve_inplace_flag(inplace_final_state, pooled)
    if pooled:
        return _pool_step(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                          state_v_first, backend, ssm_state_indices, num_accepted_tokens, inplace,
                          validate, gating, initial_state_indices, serving, route_key)
    if inplace:
        state = check_inplace_state(initial_state, compute_dtype_for(_wider(q.dtype, v.dtype)),
                                    (q, k, v, g, beta, A_log, dt_bias))
        call = canonical_call(q, k, v, g, beta, scale, state, use_qk_l2norm_in_kernel, cu_seqlens,
                              CHUNK_SIZES[0], state_v_first, **gating)
        o = run_step_inplace(call, state, backend)
        return (o.squeeze(0) if call.token_major else o).contiguous(), state
    grad = _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    # raw g and beta: the step applies the activations (in its kernel where it has them)
    call = canonical_call(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                          CHUNK_SIZES[0], state_v_first, **gating)
    o, final_state = run_step(call, grad, backend)
    # every backend's step returns a new final state (an op's output, or the pure-torch step's own)
    o, final_state = call.public_outputs(o, final_state, may_alias=False)
    return o, (final_state if output_final_state else None)


#: Public pool steps that passed every check of :func:`fused_recurrent_gated_delta_rule`
#: (their :func:`_pool_route_key`) -> ``(selection, state_v_first, prepared)``: the backend
#: serving them, the resolved layout, and the backend's prepared step of the signature
#: (``Backend.prepared_pool_step``) or None. A later call of the same signature goes straight
#: to that step (or to the backend's step), which still checks the index values (and, but
#: for the CPU's fused step, every rule).
_POOL_ROUTES: SignatureMemo[tuple[Selection, bool, Optional[Callable]]] = SignatureMemo()


def _pool_route_key(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, cu_seqlens,
                    cu_seqlens_cpu, state_v_first, transpose_state_layout, gk, gv, backend, ssm_state_indices,
                    num_accepted_tokens, inplace_final_state, validate, initial_state_indices, retrieve_parent_token,
                    intermediate_states_buffer, intermediate_state_indices,
                    disable_state_update) -> Optional[tuple]:
    """The signature of a public in-place pool step (:mod:`torch_gdr._decode_memo`, with the
    backend and strict-mode variables the selection reads), or None for a call the route memo
    does not serve: traced, without g or beta, with serving extras, a tensor ``scale`` (a
    value the checks read), ``cu_seqlens_cpu`` or the deprecated ``transpose_state_layout``
    (which warns on every call). A varlen route (offsets are values) is taken only through
    its backend's prepared step, which checks them; elsewhere the call runs every check."""
    if (torch.compiler.is_compiling() or g is None or beta is None
            or isinstance(scale, torch.Tensor) or transpose_state_layout is not None
            or cu_seqlens_cpu is not None or gk is not None or gv is not None or retrieve_parent_token is not None
            or intermediate_states_buffer is not None or intermediate_state_indices is not None
            or disable_state_update is not False or inplace_final_state is False):
        return None
    return signature(q, k, v, g, beta, scale, initial_state, ssm_state_indices, num_accepted_tokens,
                     initial_state_indices, cu_seqlens, A_log, dt_bias, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                     transpose_state_layout, backend, inplace_final_state, validate,
                     os.environ.get(BACKEND_ENV_VAR), strict_mode())


def _pool_step(q, k, v, g, beta, scale, pool, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first, backend,
               ssm_state_indices, num_accepted_tokens, inplace_final_state, validate, gating,
               initial_state_indices=None, serving=None, route_key=None):
    """The step over a state pool on the backend serving it: in place, or with the state
    after every token in a new tensor (``inplace_final_state=False``). ``route_key``: the
    call's :func:`_pool_route_key`, under which an in-place step that ran is remembered."""
    if not isinstance(inplace_final_state, bool):
        raise TypeError(f"inplace_final_state: expected a bool, got {type(inplace_final_state).__name__}")
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"initial_state: expected the state pool tensor with ssm_state_indices, got "
                        f"{type(pool).__name__}")
    # before dispatch reads their shapes (the pool rules check the rest)
    for name, index, layout in (("ssm_state_indices", ssm_state_indices, "[N] or [N, S]"),
                                ("num_accepted_tokens", num_accepted_tokens, "[N]")):
        if index is not None and not isinstance(index, torch.Tensor):
            raise TypeError(f"{name}: expected an integer torch.Tensor {layout}, got {type(index).__name__}")
    # here, where grad mode is still seen (a backend's op runs below autograd)
    check_no_grad(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, A_log=gating["A_log"],
                  dt_bias=gating["dt_bias"])
    step = dict(cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first,
                backend=backend, gating=Gating(**gating))
    # a tree, an intermediate buffer, or a pool whose rows are not packed: over packed rows
    if (serving and (any(serving[n] is not None for n in ("retrieve_parent_token", "intermediate_states_buffer",
                                                           "intermediate_state_indices"))
                     or serving["disable_state_update"] is not False)) or not rows_packed(pool):
        if not inplace_final_state:
            raise ValueError("inplace_final_state: False returns the states as a new tensor; with "
                             "retrieve_parent_token, an intermediate buffer or disable_state_update pass True")
        serving = serving or dict(retrieve_parent_token=None, intermediate_states_buffer=None,
                                  intermediate_state_indices=None, disable_state_update=False)
        o = run_pool_serve(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                           initial_state_indices=initial_state_indices, validate=validate, **serving, **step)
        return o, pool
    if inplace_final_state:
        selection = select_pool_step(q, v, ssm_state_indices, backend)
        o = run_pool_step(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens, validate=validate,
                          initial_state_indices=initial_state_indices, selection=selection, **step)
        # remembered unless the policy passed a default backend over (its warning comes once per
        # reason, again after torch_gdr._fallback.reset_warnings(): select() keeps that)
        if route_key is not None and (selection.named or
                                      selection.backend.name == default_backend(q.device, "pool_step")):
            prepare = selection.backend.prepared_pool_step
            gated = step["gating"] if step["gating"].gated else None
            prepared = None if prepare is None else prepare(
                q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_v_first=state_v_first, gating=gated,
                initial_state_indices=initial_state_indices, cu_seqlens=cu_seqlens)
            _POOL_ROUTES.put(route_key, (selection, state_v_first, prepared))
        return o, pool
    plan = check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                           ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                           validate=validate, in_place=False, start_indices=initial_state_indices)
    states, rows = token_states_buffer(pool, plan)
    if states.dtype in FP8_DTYPES:  # the steps run over float32 rows; the states are returned rounded
        states_f32 = states.to(torch.float32)
        o = run_pool_step(q, k, v, g, beta, scale, states_f32, rows, None, validate=False, **step)
        return o, store_cast(states_f32[:-1], pool.dtype)
    o = run_pool_step(q, k, v, g, beta, scale, states, rows, None, validate=False, **step)
    return o, states[:-1]
