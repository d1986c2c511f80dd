"""The fused CPU decode step over a state pool, in place (the semantics: :mod:`torch_gdr._pool`).

One parallel region over (sequence, value head) (``csrc/pool.cpp``): each reads its start
row, runs its tokens and writes the state after each token to that token's row, straight
into the pool: any strides (any view of a larger allocation; value-first pools are such a
view), float32, bfloat16, float16 or fp8 (``float8_e4m3fn``/``float8_e5m2``, stored by a
saturating cast), each block converted in vector registers; the state is carried in float32
between the tokens of a sequence and rounded where stored. The serving extras run in the
same pass: a token tree (``retrieve_parent_token``: a token starts from its parent's state),
the state after every token into the caller's ``intermediate_states_buffer`` (any strides,
float32/bfloat16/float16), and ``disable_state_update`` (the pool only read). q, k, v, g and
beta are read through their strides (views of a packed ``mixed_qkv``), never copied when
they already have v's dtype. Nothing proportional to the pool is allocated.

The ``"cpu"`` backend serves pool steps only where the extension is loaded (:mod:`.backend`);
dispatch runs the pure-torch step (:func:`torch_gdr.ops.torch.pool.pool_recurrent_step`)
elsewhere.

Graph capture: the step is the op ``gdr::_cpu_pool_step`` (it mutates the pool and the
buffer and returns ``o``; its fake gives ``o`` in v's shape and dtype). The checks that read
index values (rows in range, no row written twice, parents before children, ...) run in the
op's eager body, so ``torch.compile`` traces no branch on data and the checks still raise
their ``ValueError`` at run time; the checks that read no values run before the op, where
Dynamo sees them.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from torch_gdr import _pool
from torch_gdr._decode_memo import SignatureMemo, quick_start_rows, signature
from torch_gdr.ops.cpu import _build
from torch_gdr._gating import Gating
from torch_gdr.ops.cpu.kernels import KERNEL_DTYPES, _gating_args, _token_view

Tensor = torch.Tensor


def pool_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                       pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None, *,
                       cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                       state_v_first: bool = False, validate: bool = True, gating: Optional[Gating] = None,
                       initial_state_indices: Optional[Tensor] = None,
                       retrieve_parent_token: Optional[Tensor] = None,
                       intermediate_states_buffer: Optional[Tensor] = None,
                       intermediate_state_indices: Optional[Tensor] = None,
                       disable_state_update: bool = False) -> Tensor:
    """The decode step over a pool on CPU tensors, in place; q, k and v of one dtype.

    Args:
        q, k: ``[B, T, H, K]`` or token-major ``[T, H, K]``; float32, float16 or bfloat16
            (cast to v's dtype; float64 runs the pure-torch step); any strides with a
            contiguous last dim where the batch and time dims flatten into one.
        v: ``[B, T, HV, V]`` (``[T, HV, V]``); g, beta: ``[B, T, HV]`` (``[T, HV]``), any float
            dtype (used in float32).
        scale: factor on q after the l2norm; ``K ** -0.5`` when None.
        pool: ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``), float32,
            bfloat16, float16, float8_e4m3fn or float8_e5m2, any strides; updated in place.
        ssm_state_indices: ``[N]`` or ``[N, S]`` int32/int64 rows (vLLM's meaning, see
            :mod:`torch_gdr._pool`); always validated (they are on the CPU).
        num_accepted_tokens: ``[N]`` int32/int64 in ``1..S``, or None.
        cu_seqlens: ``[N + 1]`` offsets (B = 1), or None (B sequences of T tokens).
        validate: unused (CPU indices are always checked: the kernel reads by them).
        gating: fla's activations (:class:`torch_gdr._gating.Gating`, checked), applied in
            the kernel to the raw g and beta, or None.
        initial_state_indices: ``[N]`` rows the sequences start from (-1: zeros) instead of
            ``ssm_state_indices`` at ``num_accepted_tokens - 1``, or None.
        retrieve_parent_token: ``[N, S']`` int32/int64 token tree (-1: the start state), or
            None (a chain).
        intermediate_states_buffer: ``[R, S', HV, ...]`` in the pool's layout, float32,
            bfloat16 or float16, any strides, receiving the state after token j of sequence n
            at ``[intermediate_state_indices[n], j]``; or None.
        intermediate_state_indices: ``[N]`` int32/int64 rows of the buffer, given with it.
        disable_state_update: the pool is read, not written.

    Returns:
        ``o`` in the shape and dtype of v.
    """
    compiling = torch.compiler.is_compiling()
    if compiling:  # the checks that read no index values, before the op, where Dynamo traces them (eager: in its body)
        _pool.check_pool_tensors(q, v, pool, state_v_first)
    if q.device.type != "cpu":
        raise ValueError(f"q: expected CPU tensors for the fused CPU pool step, got {q.device}")
    if v.dtype not in KERNEL_DTYPES:
        raise TypeError(f"v: the fused CPU pool step takes float32, float16 or bfloat16, got {v.dtype}")
    if not isinstance(disable_state_update, bool):
        raise TypeError(f"disable_state_update: expected a bool, got {type(disable_state_update).__name__}")
    gating = gating or Gating()
    # eager: the op's body directly (the custom op's Python dispatch, ~0.1-0.4 ms, costs more
    # than the kernel of a small decode step); traced: the op, whose eager body keeps the
    # index checks out of the graph
    step = _cpu_pool_step_op if compiling else _cpu_pool_step_impl
    return step(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                None if scale is None else float(scale), bool(use_qk_l2norm_in_kernel),
                bool(state_v_first), *gating, initial_state_indices=initial_state_indices,
                retrieve_parent_token=retrieve_parent_token, intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices, disable_state_update=disable_state_update)


_CPU_POOL_STEP_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, "
                         "Tensor ssm_state_indices, Tensor? num_accepted_tokens, Tensor? cu_seqlens, float? scale, "
                         "bool use_qk_l2norm_in_kernel, bool state_v_first, bool use_gate_in_kernel=False, "
                         "Tensor? A_log=None, Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, "
                         "bool allow_neg_eigval=False, Tensor? initial_state_indices=None, "
                         "Tensor? retrieve_parent_token=None, Tensor(b!)? intermediate_states_buffer=None, "
                         "Tensor? intermediate_state_indices=None, bool disable_state_update=False) -> Tensor")


def _host_rows(t: Tensor) -> Tensor:
    """Index values as the kernel reads them: int64, contiguous, on the CPU."""
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def _parent_table(retrieve_parent_token: Tensor, lens: tuple[int, ...], width: int) -> Tensor:
    """``[N, width]`` int64: the parents of every sequence's tokens (checked), -1 past its length."""
    parents = retrieve_parent_token[:, :width].to(device="cpu", dtype=torch.int64)
    if parents.shape[1] < width:
        parents = torch.nn.functional.pad(parents, (0, width - parents.shape[1]), value=-1)
    past_end = (torch.arange(width, device="cpu").unsqueeze(0)
                >= torch.tensor(lens, dtype=torch.int64, device="cpu").unsqueeze(1))
    return parents.masked_fill(past_end, -1).contiguous()


class _CheckedShape(NamedTuple):
    """What the pool rules derived from a decode call's metadata (no serving extras),
    remembered per signature (:mod:`torch_gdr._decode_memo`)."""

    token_major: bool
    num_seqs: int
    width: int
    seq_len: int
    slots: int
    as_given: bool  # q, k, v, g, beta go to the kernel as they are (no cast, no copy)
    #: one token a sequence ([N, 1, ...] inputs, or [1, N, ...] with ``cu_seqlens``), [N] rows,
    #: no num_accepted_tokens, initial_state_indices or gate in the kernel: the extension's
    #: ``pool_step_rows`` checks the rows (and the offsets), casts what needs it and runs
    one_row: bool
    #: with ``cu_seqlens`` (every sequence of one length, e.g. vLLM's speculative decode): the
    #: offsets, which a later call must repeat to be served here; None without
    offsets: Optional[list[int]] = None


#: Decode signatures that passed :func:`torch_gdr._pool.check_pool_args` here.
_CHECKED: SignatureMemo[_CheckedShape] = SignatureMemo()


def _memo_key(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor, ssm_state_indices: Tensor,
              num_accepted_tokens: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: Optional[float],
              use_qk_l2norm_in_kernel: bool, state_v_first: bool, gating: Gating,
              initial_state_indices: Optional[Tensor], extras: bool, disable_state_update: bool) -> Optional[tuple]:
    """The signature of a plain decode step (None for one with serving extras, which have
    rules of their own). With ``cu_seqlens`` (offsets are values) only records of sequences of
    one length are kept under it, whose step checks the offsets (:class:`_CheckedShape`)."""
    if extras or disable_state_update:
        return None
    return signature(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, initial_state_indices, cu_seqlens,
                     scale, use_qk_l2norm_in_kernel, state_v_first, *gating)


def _checked_step(ext, shape: _CheckedShape, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                  initial_state_indices: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                  state_v_first: bool, gating: Gating, cu_seqlens: Optional[Tensor] = None) -> Optional[Tensor]:
    """The step of a call whose signature passed the checks before: only the index values
    are checked (:func:`quick_start_rows`), and the offsets against the record's; None where
    they might break a rule (the caller then runs every check, for the error)."""
    if shape.one_row:
        return _one_row_step(ext, q, k, v, g, beta, scale, pool, ssm_state_indices, cu_seqlens,
                             use_qk_l2norm_in_kernel, state_v_first, *_gating_args(gating)[2:])
    if cu_seqlens is not None and cu_seqlens.tolist() != shape.offsets:
        return None
    values = ssm_state_indices.tolist()
    starts = quick_start_rows(values, None if num_accepted_tokens is None else num_accepted_tokens.tolist(),
                              None if initial_state_indices is None else initial_state_indices.tolist(),
                              shape.seq_len, shape.slots)
    if starts is None:
        return None
    indices = ssm_state_indices if ssm_state_indices.is_contiguous() else ssm_state_indices.contiguous()
    # the kernel takes int32 or int64 rows, [N] or [N, S]; [N] rows are their own start rows
    start_rows = indices if starts is values else torch.tensor(starts, dtype=torch.int64, device="cpu")
    if shape.token_major:
        q, k, v, g, beta = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0)
    if not shape.as_given:
        dtype = v.dtype
        q, k, v = _token_view(q, dtype), _token_view(k, dtype), _token_view(v, dtype)
        g, beta = _token_view(g, torch.float32), _token_view(beta, torch.float32)
    cu = None if cu_seqlens is None else _host_rows(cu_seqlens)
    o = ext.pool_recurrent_fwd(q, k, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale, pool, indices,
                               start_rows, use_qk_l2norm_in_kernel, cu, state_v_first, *_gating_args(gating), None,
                               True, None, None)
    return o.squeeze(0) if shape.token_major else o


def prepared_pool_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
                       ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None, *,
                       use_qk_l2norm_in_kernel: bool = False, state_v_first: bool = False,
                       gating: Optional[Gating] = None, initial_state_indices: Optional[Tensor] = None,
                       cu_seqlens: Optional[Tensor] = None) -> Optional[Callable[..., Optional[Tensor]]]:
    """The step of later calls of this plain decode call's signature, which
    :func:`pool_recurrent_fwd` has checked and run (``Backend.prepared_pool_step``): a
    function ``(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
    initial_state_indices, A_log, dt_bias, cu_seqlens) -> o`` (None where the index or offset
    values might break a rule), or None where this signature has not passed here or the
    kernels are not loaded.
    Every tensor and the scale are the later call's own."""
    gating = gating or Gating()
    scale = None if scale is None else float(scale)
    l2norm, v_first = bool(use_qk_l2norm_in_kernel), bool(state_v_first)
    shape = _CHECKED.get(_memo_key(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, cu_seqlens, scale,
                                   l2norm, v_first, gating, initial_state_indices, False, False))
    ext = _build.load()
    if shape is None or ext is None or torch.compiler.is_compiling():
        return None
    if shape.one_row:
        return _rows_step(ext, l2norm, v_first, *_gating_args(gating)[2:])
    gate, beta_sigmoid, neg_eigval = gating.use_gate_in_kernel, gating.use_beta_sigmoid_in_kernel, gating.allow_neg_eigval

    def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
             ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], initial_state_indices: Optional[Tensor],
             A_log: Optional[Tensor], dt_bias: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> Optional[Tensor]:
        return _checked_step(ext, shape, q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens,
                             initial_state_indices, None if scale is None else float(scale), l2norm, v_first,
                             Gating(gate, A_log, dt_bias, beta_sigmoid, neg_eigval), cu_seqlens)

    return step


def _rows_step(ext, l2norm: bool, v_first: bool, beta_sigmoid: bool,
               beta_scale: float) -> Callable[..., Optional[Tensor]]:
    """:func:`prepared_pool_step`'s step where every sequence has one token and its ``[N]``
    row (no ``num_accepted_tokens``, no ``initial_state_indices``, no gate in the kernel):
    one call into the extension, which checks the row values (in range, none written twice)
    and the offsets (one token a sequence), casts q, k to v's dtype and g, beta to float32
    where they differ, and runs the kernel, or returns None and runs nothing where a value
    might break a rule."""

    def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
             ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], initial_state_indices: Optional[Tensor],
             A_log: Optional[Tensor], dt_bias: Optional[Tensor], cu_seqlens: Optional[Tensor]) -> Optional[Tensor]:
        return _one_row_step(ext, q, k, v, g, beta, None if scale is None else float(scale), pool, ssm_state_indices,
                             cu_seqlens, l2norm, v_first, beta_sigmoid, beta_scale)

    return step


def _one_row_step(ext, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                  pool: Tensor, rows: Tensor, cu_seqlens: Optional[Tensor], l2norm: bool, v_first: bool,
                  beta_sigmoid: bool, beta_scale: float) -> Optional[Tensor]:
    """The extension's ``pool_step_rows`` (:class:`_CheckedShape` ``one_row``): o, or None
    where a row or offset value might break a rule."""
    return ext.pool_step_rows(q, k, v, g, beta, q.shape[-1] ** -0.5 if scale is None else scale, pool, rows,
                              cu_seqlens, l2norm, v_first, None, None, beta_sigmoid, beta_scale)


def _cpu_pool_step_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                        ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                        cu_seqlens: Optional[Tensor], scale: Optional[float], use_qk_l2norm_in_kernel: bool,
                        state_v_first: bool, use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                        dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, initial_state_indices: Optional[Tensor] = None,
                        retrieve_parent_token: Optional[Tensor] = None,
                        intermediate_states_buffer: Optional[Tensor] = None,
                        intermediate_state_indices: Optional[Tensor] = None,
                        disable_state_update: bool = False) -> Tensor:
    """The op's eager body: every pool rule checked (index values read on the host), then the
    kernel; a plain decode step whose signature passed the checks before checks only its
    index values (:mod:`torch_gdr._decode_memo`)."""
    gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    extras = (retrieve_parent_token is not None or intermediate_states_buffer is not None
              or intermediate_state_indices is not None)
    key = _memo_key(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, cu_seqlens, scale,
                    use_qk_l2norm_in_kernel, state_v_first, gating, initial_state_indices, extras, disable_state_update)
    shape = _CHECKED.get(key)
    ext = _build.load()
    if shape is not None and ext is not None:
        o = _checked_step(ext, shape, q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens,
                          initial_state_indices, scale, use_qk_l2norm_in_kernel, state_v_first, gating, cu_seqlens)
        if o is not None:
            return o
    plan = _pool.check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                                 start_indices=initial_state_indices, in_place=not disable_state_update)
    serve = None
    if extras:
        serve = _pool.check_serving_extras(plan, pool, retrieve_parent_token, intermediate_states_buffer,
                                           intermediate_state_indices, disable_state_update, contiguous_buffer=False)
    if ext is None:
        raise RuntimeError(f"torch_gdr: the fused CPU kernels are unavailable ({_build.unavailable_reason()})")
    batched = [t.unsqueeze(0) if plan.token_major else t for t in (q, k, v, g, beta)]
    dtype = v.dtype
    qb, kb, vb = (_token_view(t, dtype) for t in batched[:3])
    gb, bb = (_token_view(t, torch.float32) for t in batched[3:])
    cu = None if cu_seqlens is None else _host_rows(cu_seqlens)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    indices = plan.indices
    width = indices.shape[1]
    parents = buffer_rows = None
    if serve is not None:
        # the kernel's width: the longest sequence (entries past a sequence's length are never written)
        width = max(max(plan.seq_lens, default=0), 1)
        indices = indices[:, :width]
        if serve.parents is not None:
            parents = _parent_table(retrieve_parent_token, plan.seq_lens, width)
        if intermediate_states_buffer is not None:
            buffer_rows = torch.tensor(serve.buffer_rows, dtype=torch.int64, device="cpu")
    o = ext.pool_recurrent_fwd(qb, kb, vb, gb, bb, scale, pool, _host_rows(indices), _host_rows(plan.start_rows),
                               bool(use_qk_l2norm_in_kernel), cu, bool(state_v_first), *_gating_args(gating),
                               parents, not disable_state_update, intermediate_states_buffer, buffer_rows)
    if key is not None:
        as_given = all(view is given for view, given in zip((qb, kb, vb, gb, bb), batched))
        one_row = (not plan.token_major and ssm_state_indices.dim() == 1
                   and all(length == 1 for length in plan.seq_lens) and num_accepted_tokens is None
                   and initial_state_indices is None and not gating.use_gate_in_kernel)
        if cu_seqlens is None or len(set(plan.seq_lens)) == 1:  # other offsets: every check, every call
            _CHECKED.put(key, _CheckedShape(plan.token_major, plan.num_seqs, width, plan.seq_lens[0], plan.slots,
                                            as_given, one_row, None if cu_seqlens is None else cu.tolist()))
    return o.reshape(v.shape)


_cpu_pool_step_op = torch.library.custom_op("gdr::_cpu_pool_step", _cpu_pool_step_impl,
                                            mutates_args=("pool", "intermediate_states_buffer"),
                                            schema=_CPU_POOL_STEP_SCHEMA)


@_cpu_pool_step_op.register_fake
def _cpu_pool_step_fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                        *args, **kwargs) -> Tensor:
    return torch.empty_like(v)
