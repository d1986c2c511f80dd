"""Host side of the PyPTO decode step over a state pool (the kernel: :mod:`.kernel_decode`;
the semantics: :mod:`torch_gdr._pool`).

One kernel launch per step for the whole batch. The kernel's batch is dynamic (no padding
of sequences); S is padded to its bucket (:func:`token_bucket`), so a serving loop meets at
most 16 kernels per configuration (8 token buckets; up to five task shapes by batch size for
one token a sequence, two at S = 4, 8, 12 and 16, one at the other buckets).
Sequences shorter than the speculative width S are padded with tokens whose write rows are
-1 (their outputs are dropped). The row tables are built with device ops from the index tensors (no host read
of them here; :func:`torch_gdr._pool.check_pool_args` validates them as the semantics
say).

A key-first pool whose rows are packed (row stride = row size) is read and written in
place by the kernel while S (its bucket) is at most 4. A value-first pool, one with padded
rows, or a step of more than 4 tokens a sequence (whose kernel stores every token, see
:func:`.kernel_decode.build_decode_kernel`) goes through a packed key-first copy, one row
per (sequence, token) slot, written back afterwards.

Graph capture: the step is the op ``gdr::_pypto_pool_step`` (it mutates the pool and
returns ``o``; its fake gives ``o`` in v's shape and dtype), so ``torch.compile`` records
it as one node. With device index tensors and ``cu_seqlens`` under ``validate=False``, the
step reads nothing back to the host and builds no tensor from host data, whatever the
pool's layout: the row tables, the padding, the copy of a value-first or padded pool and,
for packed sequences (``cu_seqlens``) or sequences shorter than S, the table of token
slots and the scatter of the outputs come from device ops on the index tensors and
``cu_seqlens``. What still reads the host: validation of index values and of
``cu_seqlens`` (always for CPU tensors, as the semantics say).

On CPU tensors the kernel runs through PyPTO's interpreter (:mod:`.interpreter`); on
Ascend NPU tensors it is launched on the device.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torch_gdr import _pool
from torch_gdr._gating import Gating

from . import interpreter
from .kernel_cache import get_decode_kernel

Tensor = torch.Tensor

#: ``kernel_getter(**config) -> kernel``; config holds the keyword arguments of
#: :func:`.kernel_decode.build_decode_kernel`.
KernelGetter = Callable[..., Any]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# Positions of the outputs among the kernel's tensor arguments (the gated kernel has one
# more input before them: gate_params).
_O_ARG, _POOL_OUT_ARG = 9, 10


def token_bucket(width: int) -> int:
    """The tokens per sequence (S) the kernel for a step of ``width`` tokens a sequence is
    built for: the powers of two and the midpoints between them up to 16 (1, 2, 3, 4, 6, 8,
    12, 16), so padding wastes at most a third of a launch and a configuration meets at
    most eight token buckets (one token: up to five task shapes; S = 4, 8, 12, 16: two;
    the others: one; at most 16 kernels). The host pads a sequence to its bucket with tokens whose write rows are -1."""
    from .kernel_decode import MAX_TOKENS_PER_SEQ

    if not 1 <= width <= MAX_TOKENS_PER_SEQ:
        raise ValueError(f"width: expected tokens per sequence in 1..{MAX_TOKENS_PER_SEQ}, got {width}")
    bucket = 1
    while True:
        for candidate in (bucket, bucket + bucket // 2):
            if candidate >= width:
                return candidate
        bucket *= 2


def _token_slots(cu_seqlens: Optional[Tensor], num_seqs: int, seq_len: int, width: int,
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """Where every (sequence, slot j < S) of the kernel's order lies among the flattened
    tokens, with device ops only (no host read of ``cu_seqlens``): ``(slots [N * S],
    in_sequence [N, S] bool)``. Sequence n starts at ``cu_seqlens[n]`` (without it: B
    sequences of ``seq_len`` tokens); slots past its length point at token 0, their outputs
    are dropped and their states never written (``in_sequence`` false)."""
    if cu_seqlens is None:
        starts = torch.arange(num_seqs, device=device) * seq_len
        lengths = torch.full((num_seqs,), seq_len, dtype=torch.int64, device=device)
    else:
        offsets = cu_seqlens.to(device=device, dtype=torch.int64)
        starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    position = torch.arange(width, device=device).view(1, -1)
    in_sequence = position < lengths.view(-1, 1)
    slots = torch.where(in_sequence, starts.view(-1, 1) + position, torch.zeros_like(position))
    return slots.flatten(), in_sequence


def _write_back(pool: Tensor, rows: Tensor, states: Tensor, state_v_first: bool) -> None:
    """Write key-first ``states [M, HV, K, V]`` (the pool's dtype) into pool rows ``rows
    [M]``, in place, entries -1 skipped, with shapes that do not depend on the values (no
    host read, unlike dropping them by a mask): a skipped entry writes again what the first
    written entry writes, or, when none is written, row 0 its own contents (the same bits).
    Rows of written entries are distinct (the pool rules)."""
    written = rows >= 0
    first = torch.argmax(written.to(torch.int32))  # the first written entry; 0 when none
    any_written = written.any()
    row0 = pool[0] if not state_v_first else pool[0].transpose(-1, -2)
    spare_row = torch.where(any_written, rows[first], torch.zeros_like(rows[first]))
    spare_state = torch.where(any_written, states[first], row0)
    targets = torch.where(written, rows, spare_row)
    values = torch.where(written.view(-1, 1, 1, 1), states, spare_state)
    pool.index_copy_(0, targets, values.transpose(-1, -2) if state_v_first else values)


def pypto_pool_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
                    ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None, *,
                    cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                    state_v_first: bool = False, validate: bool = True,
                    kernel_getter: Optional[KernelGetter] = None, gating: Optional[Gating] = None,
                    initial_state_indices: Optional[Tensor] = None) -> Tensor:
    """The decode step over a state pool through the PyPTO kernel, in place (the arguments
    of :func:`pool_step_eager`).

    Runs as the op ``gdr::_pypto_pool_step`` (which mutates ``pool`` and returns ``o``), so
    that ``torch.compile`` records the whole step as one node (its fake gives ``o`` in v's
    shape and dtype) rather than tracing into the host code, which reads index values
    and launches the kernel. With a ``kernel_getter`` (benchmarks, tests) it runs eagerly.
    """
    if kernel_getter is not None:
        return pool_step_eager(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                               cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               state_v_first=state_v_first, validate=validate, kernel_getter=kernel_getter,
                               gating=gating, initial_state_indices=initial_state_indices)
    gating = gating or Gating()
    # the checks that read no index values, before the op: inside it a pool on another
    # device would reach that device's kernel (the fake on "meta") instead of this error
    _pool.check_pool_tensors(q, v, pool, state_v_first)
    return _pool_step_op(q, k, v, g, beta, pool, ssm_state_indices, num_accepted_tokens, cu_seqlens,
                         None if scale is None else float(scale), bool(use_qk_l2norm_in_kernel), bool(state_v_first),
                         bool(validate), *gating, initial_state_indices=initial_state_indices)


_POOL_STEP_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) pool, Tensor ssm_state_indices, "
                     "Tensor? num_accepted_tokens, Tensor? cu_seqlens, float? scale, bool use_qk_l2norm_in_kernel, "
                     "bool state_v_first, bool validate, bool use_gate_in_kernel=False, Tensor? A_log=None, "
                     "Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, bool allow_neg_eigval=False, "
                     "Tensor? initial_state_indices=None) -> Tensor")


def _pool_step_op_impl(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                       ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], cu_seqlens: Optional[Tensor],
                       scale: Optional[float], use_qk_l2norm_in_kernel: bool, state_v_first: bool,
                       validate: bool, use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                       dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                       allow_neg_eigval: bool = False, initial_state_indices: Optional[Tensor] = None) -> Tensor:
    return pool_step_eager(q, k, v, g, beta, scale, pool, ssm_state_indices, num_accepted_tokens,
                           cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           state_v_first=state_v_first, validate=validate,
                           gating=Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                                         allow_neg_eigval), initial_state_indices=initial_state_indices)


_pool_step_op = torch.library.custom_op("gdr::_pypto_pool_step", _pool_step_op_impl, mutates_args=("pool",),
                                        schema=_POOL_STEP_SCHEMA)


@_pool_step_op.register_fake
def _pool_step_fake(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pool: Tensor,
                    ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], cu_seqlens: Optional[Tensor],
                    scale: Optional[float], use_qk_l2norm_in_kernel: bool, state_v_first: bool,
                    validate: bool, use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None,
                    dt_bias: Optional[Tensor] = None, use_beta_sigmoid_in_kernel: bool = False,
                    allow_neg_eigval: bool = False, initial_state_indices: Optional[Tensor] = None) -> Tensor:
    return torch.empty_like(v)


def pool_step_eager(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
                    ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor] = None, *,
                    cu_seqlens: Optional[Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                    state_v_first: bool = False, validate: bool = True,
                    kernel_getter: Optional[KernelGetter] = None, gating: Optional[Gating] = None,
                    initial_state_indices: Optional[Tensor] = None) -> Tensor:
    """The decode step over a state pool through the PyPTO kernel, in place, eagerly.

    Args:
        q, k: ``[B, T, H, K]`` or token-major ``[T, H, K]``; v: ``[B, T, HV, V]`` (``[T, HV,
            V]``); float32, float16 or bfloat16 (q/k in another dtype than v: all read as
            float32). g, beta: ``[B, T, HV]`` (``[T, HV]``), any float dtype.
        scale: factor on q after the l2norm; ``K ** -0.5`` when None.
        pool: ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``),
            float32, bfloat16 or float16; updated in place.
        ssm_state_indices: ``[N]`` or ``[N, S]`` (S <= 16) int32/int64 rows; -1: zeros,
            never written. num_accepted_tokens: ``[N]`` in ``1..S``, or None.
        initial_state_indices: ``[N]`` rows the sequences start from instead (-1: zeros), or None.
        cu_seqlens: ``[N + 1]`` offsets (B = 1), or None (B sequences of T tokens).
        use_qk_l2norm_in_kernel: l2-normalise q and k first.
        validate: check index values also when they live on a device.
        kernel_getter: returns the kernel for a configuration; defaults to the decode
            kernel cache (:func:`.kernel_cache.get_decode_kernel`).
        gating: fla's activations (:class:`torch_gdr._gating.Gating`, checked by the
            caller): g is then the raw gate and/or beta the logits, and the kernel applies
            them (``A_log``/``dt_bias [HV]`` read in float32); None: g and beta as given.

    Returns:
        ``o`` in the shape and dtype of v.
    """
    from .kernel_decode import MAX_BRANCHED_TOKENS, MAX_TOKENS_PER_SEQ, value_heads_per_body

    plan = _pool.check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                                 validate=validate, host_offsets=False, start_indices=initial_state_indices)
    device = q.device
    if device.type not in ("cpu", "npu"):
        raise ValueError(f"q: the PyPTO backend runs on 'npu' or 'cpu' tensors, not {device.type!r}")
    if v.dtype not in _DTYPE_NAMES or q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"q, v: the PyPTO decode kernel reads float32, float16 or bfloat16, got q in {q.dtype}, "
                        f"v in {v.dtype}")
    indices = plan.indices  # [N, S] int64 on the pool's device
    num_seqs, width = indices.shape
    if width > MAX_TOKENS_PER_SEQ:
        raise ValueError(f"ssm_state_indices: the PyPTO decode kernel takes at most {MAX_TOKENS_PER_SEQ} tokens per "
                         f"sequence (S), got S = {width}")
    num_qk_heads, head_k_dim = q.shape[-2], q.shape[-1]
    num_v_heads, head_v_dim = v.shape[-2], v.shape[-1]
    scale = head_k_dim ** -0.5 if scale is None else float(scale)
    num_tokens = v.numel() // (num_v_heads * head_v_dim)
    if num_seqs == 0 or num_tokens == 0:
        return torch.zeros_like(v)

    # Inputs in the kernel's token order [N * S, heads * dim], in one dtype. The common step
    # (B sequences of S tokens, no cu_seqlens) is already in that order; otherwise the
    # tokens are gathered through a slot table built on the device from cu_seqlens.
    in_dtype = v.dtype if q.dtype == v.dtype else torch.float32
    flat = [x if plan.token_major else x.reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta)]
    seq_len = num_tokens if plan.token_major else q.shape[1]
    kernel_width = token_bucket(width)  # S padded to its bucket: few kernels per configuration
    full_width = cu_seqlens is None and seq_len == width == kernel_width
    slots = in_sequence = None
    if not full_width:
        slots, in_sequence = _token_slots(cu_seqlens, num_seqs, seq_len, kernel_width, device)
        flat = [x.index_select(0, slots) for x in flat]

    def packed(x: Tensor, dtype: torch.dtype, row: int) -> Tensor:
        """``x`` as ``[-1, row]`` in ``dtype``: a view where it already is (the common step)."""
        return x.reshape(-1, row).to(dtype).contiguous()

    # one-token kernels read q, k as [T * H, K] and v as [T * HV, V] (a body's heads are
    # adjacent rows), several-token ones [T, H * K], [T, HV * V] (a sequence's tokens are)
    one_token = kernel_width == 1
    q_in, k_in = (packed(x, in_dtype, head_k_dim if one_token else num_qk_heads * head_k_dim) for x in flat[:2])
    v_in = packed(flat[2], in_dtype, head_v_dim if one_token else num_v_heads * head_v_dim)
    g_in, beta_in = (packed(x, torch.float32, num_v_heads) for x in flat[3:])

    # Row tables: where each sequence starts, where each token's state goes (-1: nowhere).
    read_rows = plan.start_rows
    write_rows = indices
    if kernel_width > width:
        write_rows = torch.cat([indices, indices.new_full((num_seqs, kernel_width - width), -1)], 1)
    if in_sequence is not None:
        write_rows = torch.where(in_sequence.to(indices.device), write_rows, torch.full_like(write_rows, -1))

    # The pool the kernel sees: the caller's (packed key-first rows), or a packed key-first
    # copy with one row per (sequence, token) slot, sequence n's start state in its token 0
    # slot (the kernel reads it there, then overwrites it: a sequence may overwrite the row
    # it reads). Shapes follow N and S alone: nothing is read back to the host.
    row_size = num_v_heads * head_k_dim * head_v_dim
    # A kernel of more than MAX_BRANCHED_TOKENS tokens stores every token (no branch per
    # token): through the staging copy, whose slots are all valid rows.
    store_every_token = kernel_width > MAX_BRANCHED_TOKENS
    in_place = not state_v_first and pool.stride(0) == row_size and not store_every_token
    copy_rows = None  # the copy path: the pool row of every slot (-1: not written back)
    if in_place:
        work_pool = pool
    else:
        slot_of = torch.arange(num_seqs * kernel_width, device=indices.device).view(num_seqs, kernel_width)
        work_pool = pool.new_empty(num_seqs * kernel_width, num_v_heads, head_k_dim, head_v_dim)
        work_pool.index_copy_(0, slot_of[:, 0], _pool.pool_gather(pool, read_rows, state_v_first).to(pool.dtype))
        copy_rows = write_rows.flatten()
        read_rows = torch.where(read_rows >= 0, slot_of[:, 0], read_rows)
        write_rows = slot_of if store_every_token else torch.where(write_rows >= 0, slot_of, write_rows)
    read_in = read_rows.to(device=device, dtype=torch.int32).view(-1, 1)
    write_in = write_rows.flatten().to(device=device, dtype=torch.int32)
    gating = gating or Gating()
    heads_per_body = value_heads_per_body(num_seqs, num_qk_heads, num_v_heads, kernel_width, _DTYPE_NAMES[pool.dtype])
    bodies = torch.full((1,), num_seqs * num_v_heads // heads_per_body, dtype=torch.int32, device=device)

    gate_params = []  # [2, HV] fp32: A_log, dt_bias (zeros without one)
    if gating.use_gate_in_kernel:
        assert gating.A_log is not None
        a_log = gating.A_log.to(device=device, dtype=torch.float32)
        bias = torch.zeros_like(a_log) if gating.dt_bias is None else gating.dt_bias.to(device=device,
                                                                                          dtype=torch.float32)
        gate_params = [torch.stack([a_log, bias]).contiguous()]
    getter = kernel_getter if kernel_getter is not None else get_decode_kernel
    kernel = getter(heads_per_body=heads_per_body, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                    head_v_dim=head_v_dim, tokens_per_seq=kernel_width, use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
                    scale=scale, input_dtype=_DTYPE_NAMES[in_dtype], pool_dtype=_DTYPE_NAMES[pool.dtype],
                    on_device=device.type == "npu", gate_in_kernel=gating.use_gate_in_kernel,
                    beta_sigmoid_in_kernel=gating.use_beta_sigmoid_in_kernel,
                    allow_neg_eigval=gating.allow_neg_eigval, store_every_token=store_every_token)
    o = torch.empty(num_seqs * kernel_width, num_v_heads * head_v_dim, dtype=torch.float32, device=device)  # all written
    pool_rows = work_pool.view(-1, head_v_dim)
    shift = len(gate_params)
    interpreter.launch(kernel, [q_in, k_in, v_in, g_in, beta_in, *gate_params, read_in, write_in, bodies, pool_rows, o,
                                pool_rows], [_O_ARG + shift, _POOL_OUT_ARG + shift])
    if copy_rows is not None:
        _write_back(pool, copy_rows, work_pool, state_v_first)

    if slots is None:
        out = o.reshape(v.shape)
    else:  # slots outside a sequence go to a spare row past the tokens, then dropped
        target = torch.where(in_sequence.flatten(), slots, torch.full_like(slots, num_tokens))
        out = torch.zeros(num_tokens + 1, num_v_heads * head_v_dim, dtype=torch.float32, device=device)
        out.index_copy_(0, target, o)
        out = out[:num_tokens].reshape(v.shape)
    return out.to(v.dtype)
