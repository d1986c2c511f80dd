"""The ``"fla"`` backend's kernels: fla-core's Triton forward and backward, called raw.

fla's public ``chunk_gated_delta_rule`` is an ``autograd.Function`` behind
``torch.compiler.disable``; here its internal pieces (fla-core 0.6.x:
``fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd`` / ``_bwd`` and the l2norm of
``fla.modules.norm.l2norm``) are called directly, so that torch_gdr's ops, with our fake
and our autograd, can use them as their CUDA kernels.

Both run in the canonical layout: batched ``[B, T, ...]``, key-first state, int64
``cu_seqlens`` on the inputs' device. The forward returns what fla's own backward needs
beside the op's inputs, so the backward recomputes nothing fla itself would not:

=================  ======================  ===========================================
saved              shape                   dtype
=================  ======================  ===========================================
``g_cumsum``       ``[B, T, HV]``          float32: g cumulated within each chunk, in
                                           fla's base-2 units (``log2(e) * cumsum(g)``)
``A``              ``[B, T, HV, BT]``      q's dtype: fla's ``(I + A)^-1`` per chunk,
                                           ``BT`` = :func:`fla_chunk_size` (chunk_size)
``q_rstd``         ``[B, T, H]``           float32: ``1 / sqrt(|q|^2 + 1e-6)``; ``[0]``
                                           without ``use_qk_l2norm_in_kernel``
``k_rstd``         ``[B, T, H]``           float32, likewise for k
=================  ======================  ===========================================

fla's activations run in fla's kernels, as fla's own ``chunk_gated_delta_rule`` runs them
(:class:`~torch_gdr._gating.Gating`): with ``use_gate_in_kernel`` g is the raw gate, which
fla's chunk cumsum kernel activates (``-exp(A_log) softplus(g + dt_bias)``) and its backward
differentiates (the raw gate's gradient, ``dA_log``, ``ddt_bias``); with
``use_beta_sigmoid_in_kernel`` beta holds logits, through fla's fused sigmoid kernels (times 2
with ``allow_neg_eigval``) before the forward and after the backward.

fla's refusals (for example its ``RuntimeError`` for the gated backward on Hopper GPUs
with Triton >= 3.4.0, < 3.7.1) and failures surface as :class:`FlaRefusal`, whose
``reason`` is a fallback reason for the dispatch policy (warn once and run the pure-torch
path; raise when the backend was named or ``TORCH_GDR_STRICT=1``). The backend
(:mod:`.backend`) predicts the refusals it can before any kernel runs
(:func:`backward_refusal_reason`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from torch_gdr._gating import Gating
from torch_gdr.ops.fla._loader import TESTED_RANGE, load, reset, tilelang_installed

Tensor = torch.Tensor

FLA_DEVICE_TYPES: tuple[str, ...] = ("cuda",)  # where fla's Triton kernels run (ROCm tensors are "cuda" too)
FLA_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
FLA_CHUNK_SIZES: tuple[int, ...] = (16, 32, 64)
FLA_MAX_HEAD_K_DIM = 256
_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

__all__ = ["FLA_CHUNK_SIZES", "FLA_DEVICE_TYPES", "FLA_DTYPES", "FLA_MAX_HEAD_K_DIM", "FlaRefusal", "TESTED_RANGE",
           "available", "backward_refusal_reason", "fla_chunk_bwd", "fla_chunk_fwd", "fla_chunk_size",
           "fla_fused_recurrent_fwd", "load_reason", "reset"]


class FlaRefusal(RuntimeError):
    """fla's kernels cannot serve a call; ``reason`` says why (a fallback reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def available() -> bool:
    """True when a fla-core of the tested range imports with every function used here."""
    return not isinstance(load(), str)


def load_reason() -> str:
    """Why fla's kernels cannot be used here ("" when they can): fla-core not installed, of
    another version, or broken."""
    fla = load()
    return fla if isinstance(fla, str) else ""


def fla_chunk_size(chunk_size: int) -> int:
    """The chunk size given to fla: ours where fla has it (16, 32, 64), else 64 (fla has no
    128; every chunk size gives the same result up to rounding)."""
    return chunk_size if chunk_size in FLA_CHUNK_SIZES else 64


def backward_refusal_reason() -> Optional[str]:
    """The refusal fla-core 0.6 makes in the gated backward on this machine, predicted from
    its own flags (Hopper GPU, Triton >= 3.4.0 and < 3.7.1, tilelang absent), or None.
    Best effort: the call itself still turns a refusal into :class:`FlaRefusal`."""
    fla = load()
    utils = None if isinstance(fla, str) else fla.utils
    if utils is None:
        return None
    hopper = bool(getattr(utils, "IS_NVIDIA_HOPPER", False))
    affected = bool(getattr(utils, "TRITON_ABOVE_3_4_0", False)) and not bool(
        getattr(utils, "TRITON_ABOVE_3_7_1", True))
    if hopper and affected and not tilelang_installed():
        return ("fla refuses the gated backward on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1 (wrong results, "
                "a known fla bug); upgrade Triton to >= 3.7.1 or install tilelang")
    return None


def _classify(stage: str, exc: BaseException, version: str) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, TypeError):
        return (f"fla-core {version}'s {stage} does not take the arguments of fla-core 0.6 ({message}); "
                f"tested range {TESTED_RANGE}")
    if isinstance(exc, RuntimeError) and ("Hopper" in message or "Triton" in message):
        return f"fla refuses the {stage} on this GPU: {message}"
    if isinstance(exc, (AssertionError, ValueError, NotImplementedError)):
        return f"fla's {stage} rejects the call ({type(exc).__name__}: {message})"
    return f"fla's {stage} failed ({type(exc).__name__}: {message})"


def _call(stage: str, fn: Callable, version: str, **kwargs):
    """Call one of fla's functions; its exceptions (but out-of-memory) become FlaRefusal."""
    try:
        return fn(**kwargs)
    except _OOM:
        raise
    except Exception as exc:  # noqa: BLE001 - every refusal is a fallback reason
        raise FlaRefusal(_classify(stage, exc, version)) from exc


def _fla_or_refuse():
    fla = load()
    if isinstance(fla, str):
        raise FlaRefusal(fla)
    return fla


def _device(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _empty_rstd(q: Tensor) -> Tensor:
    return q.new_empty(0, dtype=torch.float32)


def _beta_scale(gating: Gating) -> float:
    return 2.0 if gating.allow_neg_eigval else 1.0


def _activated_beta(fla, beta: Tensor, gating: Gating) -> Tensor:
    """beta as fla's kernels take it: the logits through fla's fused sigmoid (float32) with
    ``use_beta_sigmoid_in_kernel``, else as given."""
    if not gating.use_beta_sigmoid_in_kernel:
        return beta
    return _call("beta sigmoid", fla.fused_beta_sigmoid_fwd, fla.version, x=beta, scale=_beta_scale(gating))


def _gate_kwargs(gating: Gating) -> dict:
    return dict(use_gate_in_kernel=gating.use_gate_in_kernel, A_log=gating.A_log, dt_bias=gating.dt_bias)


def fla_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                  initial_state: Optional[Tensor], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                  cu_seqlens: Optional[Tensor], chunk_size: int, gating: Gating = Gating()
                  ) -> tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor, Tensor]:
    """fla's chunked forward in the canonical layout.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (one dtype: fp16, bf16 or fp32).
        g, beta: ``[B, T, HV]``, per-token log decay (the raw gate with
            ``gating.use_gate_in_kernel``) and write strength (logits with
            ``gating.use_beta_sigmoid_in_kernel``).
        scale: a float (the caller resolves None to ``K ** -0.5``).
        initial_state: key-first ``[N, HV, K, V]`` (any float dtype, used in float32) or None.
        cu_seqlens: ``[N + 1]`` int64 on the inputs' device, or None.
        chunk_size: ours; fla gets :func:`fla_chunk_size` of it.
        gating: fla's activation arguments (``A_log``, ``dt_bias`` ``[HV]``), applied in
            fla's kernels.

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None,
        g_cumsum, A, q_rstd, k_rstd)``: the last four are what :func:`fla_chunk_bwd` takes
        (see the module docstring for their shapes).

    Raises:
        FlaRefusal: fla is missing or refused or failed the call.
    """
    fla = _fla_or_refuse()
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    q_rstd = k_rstd = _empty_rstd(q)
    with _device(q):
        if use_qk_l2norm_in_kernel:
            q, q_rstd = _call("l2norm forward", fla.l2norm_fwd, fla.version, x=q)
            k, k_rstd = _call("l2norm forward", fla.l2norm_fwd, fla.version, x=k)
        bt = fla_chunk_size(chunk_size)
        chunk_indices = None if cu_seqlens is None else _call(
            "chunk indices", fla.prepare_chunk_indices, fla.version, cu_seqlens=cu_seqlens, chunk_size=bt)
        g_cumsum, o, A, final_state, _, _ = _call(
            "chunked forward", fla.chunk_gated_delta_rule_fwd, fla.version,
            q=q, k=k, v=v, g=g, beta=_activated_beta(fla, beta, gating), scale=float(scale), initial_state=h0,
            output_final_state=output_final_state, state_v_first=False, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices, chunk_size=bt, **_gate_kwargs(gating))
    return o.to(v.dtype), final_state, g_cumsum, A, q_rstd, k_rstd


def fla_chunk_bwd(grad_o: Tensor, grad_final_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                  g: Tensor, beta: Tensor, g_cumsum: Tensor, A: Tensor, q_rstd: Tensor, k_rstd: Tensor,
                  scale: float, initial_state: Optional[Tensor], use_qk_l2norm_in_kernel: bool,
                  cu_seqlens: Optional[Tensor], chunk_size: int, gating: Gating = Gating()
                  ) -> tuple[Optional[Tensor], ...]:
    """fla's chunked backward in the canonical layout.

    Args:
        grad_o: ``[B, T, HV, V]``; grad_final_state: ``[N, HV, K, V]`` or None.
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
            chunk_size, gating: the forward's arguments (raw q and k, g and beta as the
            call gave them).
        g_cumsum, A, q_rstd, k_rstd: what :func:`fla_chunk_fwd` returned.

    Returns:
        ``(dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias)`` in the dtypes of q, k,
        v, g, beta, initial_state, A_log and dt_bias: the gradients of the inputs as given
        (the raw gate's, the logits'); ``d_initial_state``, ``dA_log`` and ``ddt_bias`` are
        None where the call has no such input.

    Raises:
        FlaRefusal: fla is missing or refused (e.g. the Hopper/Triton gated backward) or
            failed the call.
    """
    fla = _fla_or_refuse()
    q_in, k_in = q, k
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:  # fla's l2norm output, exactly: x * rstd rounded to x's dtype
        q = (q.float() * q_rstd.unsqueeze(-1)).to(q.dtype)
        k = (k.float() * k_rstd.unsqueeze(-1)).to(k.dtype)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    dht = None if grad_final_state is None else grad_final_state.to(torch.float32).contiguous()
    bt = fla_chunk_size(chunk_size)
    with _device(q):
        chunk_indices = None if cu_seqlens is None else _call(
            "chunk indices", fla.prepare_chunk_indices, fla.version, cu_seqlens=cu_seqlens, chunk_size=bt)
        dq, dk, dv, dbeta, dg, dh0, d_a_log, d_dt_bias = _call(
            "chunked backward", fla.chunk_gated_delta_rule_bwd, fla.version,
            q=q, k=k, v=v, g=g_cumsum, beta=_activated_beta(fla, beta, gating), A=A, scale=float(scale),
            initial_state=h0, do=grad_o.to(v.dtype).contiguous(), dht=dht, state_v_first=False,
            cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=bt,
            g_input=g.contiguous() if gating.use_gate_in_kernel else None, **_gate_kwargs(gating))
        if use_qk_l2norm_in_kernel:
            dq = _call("l2norm backward", fla.l2norm_bwd, fla.version, y=q, rstd=q_rstd, dy=dq)
            dk = _call("l2norm backward", fla.l2norm_bwd, fla.version, y=k, rstd=k_rstd, dy=dk)
        if gating.use_beta_sigmoid_in_kernel:
            dbeta = _call("beta sigmoid backward", fla.fused_beta_sigmoid_bwd, fla.version, x=beta, dy=dbeta,
                          scale=_beta_scale(gating))
    d_initial_state = None if initial_state is None or dh0 is None else dh0.to(initial_state.dtype)
    d_a_log = None if gating.A_log is None or d_a_log is None else d_a_log.to(gating.A_log.dtype)
    d_dt_bias = None if gating.dt_bias is None or d_dt_bias is None else d_dt_bias.to(gating.dt_bias.dtype)
    return (dq.to(q_in.dtype), dk.to(k_in.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            d_initial_state, d_a_log, d_dt_bias)


def fla_fused_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                            initial_state: Optional[Tensor], output_final_state: bool,
                            use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], gating: Gating = Gating()
                            ) -> tuple[Tensor, Optional[Tensor]]:
    """fla's fused-recurrent kernel (forward only) in the canonical layout: arguments as
    :func:`fla_chunk_fwd` (q/k and v may differ in dtype; the kernel applies the activations
    itself: a gate in the kernel is ``A_log`` given); returns ``(o in v's dtype,
    final_state float32 or None)``. Raises :class:`FlaRefusal`."""
    fla = _fla_or_refuse()
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    with _device(q):
        o, final_state = _call(
            "fused-recurrent forward", fla.fused_recurrent_gated_delta_rule_fwd, fla.version,
            q=q, k=k, v=v, g=g, beta=beta, scale=float(scale), initial_state=h0,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            state_v_first=False, cu_seqlens=cu_seqlens,
            A_log=gating.A_log if gating.use_gate_in_kernel else None,
            dt_bias=gating.dt_bias if gating.use_gate_in_kernel else None,
            use_beta_sigmoid_in_kernel=gating.use_beta_sigmoid_in_kernel, allow_neg_eigval=gating.allow_neg_eigval)
    return o.to(v.dtype), final_state
