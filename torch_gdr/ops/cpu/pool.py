"""The fused CPU decode step over a state pool, in place (the semantics: :mod:`torch_gdr._pool`).

One parallel region over (sequence, value head): each reads its start row, runs its tokens
and writes the state after each token to that token's row, straight into a float32
key-first pool (no gathered copy of the states). Key-first bfloat16 and float16 pools are
read and written in place too, each row converted in vector registers (half the bytes of a
float32 pool moved; the state carried in float32 between the tokens of a sequence and
rounded to nearest where stored); value-first pools go through a float32 buffer. The ``"cpu"`` backend serves pool steps only where the
extension is loaded (:mod:`.backend`); dispatch runs the pure-torch step
(:func:`torch_gdr.ops.torch.pool.pool_recurrent_step`) elsewhere.

Graph capture: the step is the op ``gdr::_cpu_pool_step`` (it mutates the pool and returns
``o``; its fake gives ``o`` in v's shape and dtype). The checks that read index values (rows
in range, no row written twice, ...) run in the op's eager body, so ``torch.compile``
traces no branch on data and the checks still raise their ``ValueError`` at run time; the
checks that read no values run before the op, where Dynamo sees them.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr import _pool
from torch_gdr.ops.cpu import _build
from torch_gdr._gating import Gating
from torch_gdr.ops.cpu.kernels import KERNEL_DTYPES, _as, _gating_args

Tensor = torch.Tensor


def pool_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                       pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None, *,
                       cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                       state_v_first: bool = False, validate: bool = True, gating: Optional[Gating] = None,
                       initial_state_indices: Optional[Tensor] = None) -> Tensor:
    """The decode step over a pool on CPU tensors, in place; q, k and v of one dtype.

    Args:
        q, k: ``[B, T, H, K]`` or token-major ``[T, H, K]``; float32, float16 or bfloat16
            (cast to v's dtype; float64 runs the pure-torch step).
        v: ``[B, T, HV, V]`` (``[T, HV, V]``); g, beta: ``[B, T, HV]`` (``[T, HV]``), any float
            dtype (used in float32).
        scale: factor on q after the l2norm; ``K ** -0.5`` when None.
        pool: ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``), float32,
            bfloat16 or float16, rows contiguous, row stride >= the row; updated in place.
        ssm_state_indices: ``[N]`` or ``[N, S]`` int32/int64 rows (vLLM's meaning, see
            :mod:`torch_gdr._pool`); always validated (they are on the CPU).
        num_accepted_tokens: ``[N]`` int32/int64 in ``1..S``, or None.
        cu_seqlens: ``[N + 1]`` offsets (B = 1), or None (B sequences of T tokens).
        validate: unused (CPU indices are always checked: the kernel reads by them).
        gating: fla's activations (:class:`torch_gdr._gating.Gating`, checked), applied in
            the kernel to the raw g and beta, or None.
        initial_state_indices: ``[N]`` rows the sequences start from (-1: zeros) instead of
            ``ssm_state_indices`` at ``num_accepted_tokens - 1``, or None: the kernel reads
            them as one more column of the row table, never written.

    Returns:
        ``o`` in the shape and dtype of v.
    """
    # the checks that read no index values, before the op (Dynamo traces them)
    _pool.check_pool_tensors(q, v, pool, state_v_first)
    if q.device.type != "cpu":
        raise ValueError(f"q: expected CPU tensors for the fused CPU pool step, got {q.device}")
    if v.dtype not in KERNEL_DTYPES:
        raise TypeError(f"v: the fused CPU pool step takes float32, float16 or bfloat16, got {v.dtype}")
    gating = gating or Gating()
    # eager: the op's body directly (the custom op's Python dispatch, ~0.1-0.4 ms, costs more
    # than the kernel of a small decode step); traced: the op, whose eager body keeps the
    # index checks out of the graph
    step = _cpu_pool_step_op if torch.compiler.is_compiling() else _cpu_pool_step_impl
    return step(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                None if scale is None else float(scale), bool(use_qk_l2norm_in_kernel),
                bool(state_v_first), *gating, initial_state_indices=initial_state_indices)


_CPU_POOL_STEP_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, "
                         "Tensor ssm_state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, float? scale, "
                         "bool use_qk_l2norm_in_kernel, bool state_v_first, bool use_gate_in_kernel=False, "
                         "Tensor? A_log=None, Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, "
                         "bool allow_neg_eigval=False, Tensor? initial_state_indices=None) -> Tensor")


def _cpu_pool_step_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                        ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                        cu_seqlens: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                        state_v_first: bool, use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                        dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, initial_state_indices: Optional[Tensor] = None) -> Tensor:
    """The op's eager body: every pool rule checked (index values read on the host), then the kernel."""
    gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    plan = _pool.check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                                 start_indices=initial_state_indices)
    ext = _build.load()
    if ext is None:
        raise RuntimeError(f"torch_gdr: the fused CPU kernels are unavailable ({_build.unavailable_reason()})")
    batched = [t.unsqueeze(0) if plan.token_major else t for t in (q, k, v, g, beta)]
    dtype = v.dtype
    qb, kb, vb = _as(batched[0], dtype), _as(batched[1], dtype), _as(batched[2], dtype)
    gb, bb = _as(batched[3], torch.float32), _as(batched[4], torch.float32)
    cu = None if cu_seqlens is None else cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    indices, read_pos = plan.indices, plan.read_pos
    if initial_state_indices is not None:  # the start rows as a last column, read and never written
        indices = torch.cat([indices, plan.start_rows.view(-1, 1)], dim=1)
        read_pos = torch.full((indices.shape[0],), indices.shape[1] - 1, dtype=torch.int64)
    o = ext.pool_recurrent_fwd(qb, kb, vb, gb, bb, scale, pool, indices.contiguous(), read_pos,
                               bool(use_qk_l2norm_in_kernel), cu, bool(state_v_first), *_gating_args(gating))
    return o.reshape(v.shape)


_cpu_pool_step_op = torch.library.custom_op("gdr::_cpu_pool_step", _cpu_pool_step_impl, mutates_args=("pool",),
                                            schema=_CPU_POOL_STEP_SCHEMA)


@_cpu_pool_step_op.register_fake
def _cpu_pool_step_fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                        ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                        cu_seqlens: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                        state_v_first: bool, use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                        dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, initial_state_indices: Optional[Tensor] = None) -> Tensor:
    return torch.empty_like(v)
