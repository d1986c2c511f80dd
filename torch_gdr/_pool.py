"""State pools: the serving semantics, independent of any backend, in pure torch.

Serving engines keep every request's recurrent state in one preallocated **pool** and pass
row indices; a call reads rows and updates rows in place. This module holds the rules of
such a call (:func:`check_pool_args`; :func:`check_batched_decode` for a traceable
batched decode), the row gather/scatter a prefill needs
(:func:`pool_gather`, :func:`pool_scatter`) and the prefill over a pool with checkpoints at
arbitrary offsets (:func:`pool_chunk_prefill`). Each backend's decode step lives in its
own folder (the pure-torch one: :func:`torch_gdr.ops.torch.pool.pool_recurrent_step`; the
CPU's fused kernel: :func:`torch_gdr.ops.cpu.pool.pool_recurrent_fwd`) and follows these rules.

**The pool.** ``[slots, HV, K, V]`` key-first, or ``[slots, HV, V, K]`` value-first
(``state_v_first=True``); float32, bfloat16, float16, float8_e4m3fn or float8_e5m2 (fp8:
stored by a plain cast saturating at the largest finite value, NaN staying NaN, no scale;
:func:`store_cast`); on the inputs' device. Any strides
(any view of a larger allocation, as engines carve pools out of one cache buffer), updated
in place; only overlapping elements (a stride 0) are refused. States
are computed in float32 and rounded to the pool's dtype when stored; between the tokens of
one call a sequence carries the unrounded float32 state (as vLLM's and fla's kernels do).

**Decode** (vLLM's ``ssm_state_indices`` / ``num_accepted_tokens``):

- ``ssm_state_indices [N, S]`` (S: the most tokens a sequence may have in the call, the
  speculative width) or ``[N]`` (one token per sequence, as ``[N, 1]``); int32 or int64.
- Sequence n starts from row ``ssm_state_indices[n, 0]``, or, with ``num_accepted_tokens
  [N]`` (values 1..S), from row ``ssm_state_indices[n, num_accepted_tokens[n] - 1]``: the
  row the previous step wrote after the last accepted token; or, with ``initial_state_indices
  [N]`` (the public name; ``start_indices`` here), from row ``initial_state_indices[n]`` (-1:
  zeros), a row that no other sequence of the call writes.
- The state after the sequence's token j (j < its length, at most S) is written to row
  ``ssm_state_indices[n, j]``. Entries at j >= the length are not written.
- A sequence with no tokens reads and writes nothing.

**Prefill**: sequence n starts from row ``initial_state_indices[n]``; its final state is
written to row ``final_state_indices[n]`` (default: the same rows). A sequence with no tokens
copies its initial state to its final row. Checkpoints: see :func:`pool_chunk_prefill`.

**Rules common to both** (``ValueError`` when validated):

- Index -1 reads as a zero state and is never written (outputs are computed normally).
  Every index lies in ``[-1, slots)``.
- No row is written twice in one call (by two sequences, two tokens, or a final state and a
  checkpoint).
- A row one sequence writes is not read by another sequence of the same call (a fork reads
  row a and writes row b). A sequence may overwrite the row it reads.
- Pools are for inference: with grad enabled, an input or the pool requiring grad raises.
- Values are checked when the index tensors live on the CPU (as engines build them), and on
  a device unless ``validate=False`` (checking reads them to the host, a sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from torch_gdr._validate import INDEX_DTYPES, check_inputs, read_cu_seqlens

Tensor = torch.Tensor

#: fp8 pool dtypes: stored by a plain saturating cast (no scale); the fused CPU step stores them
#: itself, other backends run over packed float32 rows (:mod:`torch_gdr.dispatch.pool_serve`).
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)
#: The dtypes of an intermediate-states buffer (and of the pools the fused kernels read).
BUFFER_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
#: The dtypes a pool may hold (computed in float32, rounded on store).
POOL_DTYPES: tuple[torch.dtype, ...] = (*BUFFER_DTYPES, *FP8_DTYPES)


def store_cast(states: Tensor, dtype: torch.dtype) -> Tensor:
    """``states`` rounded to a pool's ``dtype`` as a store does: a plain cast (round to
    nearest even); into an fp8 dtype saturating at its largest finite value (also for
    +-inf), NaN staying NaN."""
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        return states.to(torch.float32).clamp(-limit, limit).to(dtype)
    return states.to(dtype)


@dataclass(frozen=True)
class PoolPlan:
    """A checked pool call.

    Attributes:
        num_seqs: N.
        bos: first token of every sequence in the flattened token axis (``B * T`` tokens);
            None where ``cu_seqlens`` was left unread (``check_pool_args(...,
            host_offsets=False)`` on a device without validation).
        seq_lens: tokens of every sequence; None where ``bos`` is.
        token_major: the inputs came without the batch dim (``[T, ...]``).
        slots: rows of the pool.
        state_v_first: the pool is value-first ``[slots, HV, V, K]``.
        indices: decode: ``[N, S]`` int64 on the pool's device (1-D indices as ``[N, 1]``);
            prefill: None.
        read_pos: decode with ``num_accepted_tokens``: ``[N]`` int64 on the pool's device,
            the column of ``indices`` each sequence starts from; else None (column 0).
        start_rows: decode: ``[N]`` int64 on the pool's device, the row each sequence
            starts from (``initial_state_indices``, or ``indices`` at ``read_pos``); else None.
        initial_rows, final_rows: prefill: ``[N]`` int64 on the pool's device; else None.
        checkpoint_offsets, checkpoint_rows: prefill with checkpoints: ``[N, M]`` int64 on
            the CPU (entries whose row is -1 are padding); else None.
    """

    num_seqs: int
    bos: Optional[tuple[int, ...]]
    seq_lens: Optional[tuple[int, ...]]
    token_major: bool
    slots: int
    state_v_first: bool
    indices: Optional[Tensor] = None
    read_pos: Optional[Tensor] = None
    start_rows: Optional[Tensor] = None
    initial_rows: Optional[Tensor] = None
    final_rows: Optional[Tensor] = None
    checkpoint_offsets: Optional[Tensor] = None
    checkpoint_rows: Optional[Tensor] = None


def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def _refuse_too_many_tokens(idx: Tensor, seq: int, tokens: int) -> None:
    """Raise for sequence ``seq`` having ``tokens`` tokens, more than ``ssm_state_indices``
    (``idx``: ``[N]`` or ``[N, S]``) has rows for."""
    if idx.dim() == 1:
        raise ValueError(f"ssm_state_indices: 1-D indices [N] take at most one token per sequence, but sequence "
                         f"{seq} has {tokens}; pass [N, S] rows, one per token")
    raise ValueError(f"ssm_state_indices: expected at most S = {idx.shape[1]} tokens per sequence (one row each), "
                     f"but sequence {seq} has {tokens}")


def _check_index_tensor(name: str, t: object, device: torch.device, ranks: Sequence[int], layout: str) -> Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected an integer torch.Tensor {layout}, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if t.dim() not in ranks:
        raise ValueError(f"{name}: expected shape {layout}, got {_shape(t)} ({t.dim()}-D)")
    if t.device.type != "cpu" and t.device != device:
        raise ValueError(f"{name}: expected a tensor on the CPU or on {device} (the pool's device), got {t.device}")
    return t


def _check_pool(pool: object, num_v_heads: int, head_k_dim: int, head_v_dim: int, state_v_first: bool,
                device: torch.device) -> None:
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"initial_state: expected the pool as a torch.Tensor, got {type(pool).__name__}")
    if pool.dtype not in POOL_DTYPES:
        raise TypeError(f"initial_state: expected a pool of dtype float32, bfloat16, float16, float8_e4m3fn or "
                        f"float8_e5m2, got {pool.dtype}")
    if state_v_first:
        inner, layout = [num_v_heads, head_v_dim, head_k_dim], "[slots, HV, V, K] (state_v_first=True)"
    else:
        inner, layout = [num_v_heads, head_k_dim, head_v_dim], "[slots, HV, K, V]"
    if pool.dim() != 4 or list(pool.shape[1:]) != inner or pool.shape[0] < 1:
        raise ValueError(f"initial_state: expected a pool of shape {layout} = [slots >= 1, {', '.join(map(str, inner))}]"
                         f", got {_shape(pool)}")
    if pool.device != device:
        raise ValueError(f"initial_state: expected the pool on {device} (the device of q), got {pool.device}")
    if any(stride == 0 and size > 1 for size, stride in zip(pool.shape, pool.stride())):
        raise ValueError(f"initial_state: expected a pool whose elements do not overlap (it is written in place; "
                         f"no stride 0 over a dim longer than 1), got shape {_shape(pool)} with strides "
                         f"{list(pool.stride())}")


def rows_packed(pool: Tensor) -> bool:
    """Whether every row of ``pool [slots, A, B, C]`` is contiguous (:func:`rows_contiguous`)
    and of a dtype every backend's step takes; other pools (any view, fp8) go through
    :mod:`torch_gdr.dispatch.pool_serve` (a backend's own pass, or packed float32 rows)."""
    return pool.dim() != 4 or (pool.dtype not in FP8_DTYPES and rows_contiguous(pool))


def rows_contiguous(pool: Tensor) -> bool:
    """Whether every row of ``pool [slots, A, B, C]`` is contiguous: strides ``[>= A * B * C,
    B * C, C, 1]`` (sizes 1 aside)."""
    if pool.dim() != 4:  # not a pool: its checks say so
        return True
    a, b, c = pool.shape[1:]
    return (pool.stride(3) == 1 or c == 1) and (pool.stride(2) == c or b == 1) and (pool.stride(1) == b * c or a == 1) \
        and pool.stride(0) >= a * b * c


def _host(t: Tensor) -> Tensor:
    return t.detach().to("cpu", torch.int64)


def _values(t: Tensor) -> list:
    """An index tensor's values as (nested) Python ints, read on the host (one copy from a
    device; none on the CPU, where ``tolist`` reads int32 and int64 alike)."""
    return (t if t.device.type == "cpu" else t.detach().to("cpu")).tolist()


def _check_rows_in_range(name: str, table: list, slots: int) -> None:
    """``table``: index values as nested lists (``[N]`` or ``[N, S]``), every one in
    ``[-1, slots)``; else ``ValueError`` naming the first outside, in row-major order.
    (Plain Python: for the few rows of a decode step it costs less than torch's reductions.)"""
    for n, entry in enumerate(table):
        if isinstance(entry, list):
            for j, value in enumerate(entry):
                if not -1 <= value < slots:
                    raise ValueError(f"{name}: expected pool rows in [-1, slots) = [-1, {slots}), got {value} at "
                                     f"{[n, j]}")
        elif not -1 <= entry < slots:
            raise ValueError(f"{name}: expected pool rows in [-1, slots) = [-1, {slots}), got {entry} at {n}")


def _what(what) -> str:
    """An index entry's name: a string, or ``(format, *args)`` formatted when an error needs it."""
    return what if isinstance(what, str) else what[0].format(*what[1:])


def _check_row_conflicts(writes: list[tuple], reads: list[tuple]) -> None:
    """``writes``/``reads``: ``(row, sequence, what)`` with rows >= 0 (``what``: see
    :func:`_what`). No row written twice; no row written by one sequence and read by another."""
    writer: dict[int, tuple] = {}
    for row, seq, what in writes:
        if row in writer:
            other_seq, other = writer[row]
            raise ValueError(f"{_what(what)}: row {row} is written twice in one call (sequence {other_seq}: "
                             f"{_what(other)}; sequence {seq}: {_what(what)}); every written row must be distinct")
        writer[row] = (seq, what)
    for row, seq, what in reads:
        if row in writer and writer[row][0] != seq:
            other_seq, other = writer[row]
            raise ValueError(f"{_what(what)}: row {row} is read by sequence {seq} and written by sequence "
                             f"{other_seq} ({_what(other)}) in the same call; a fork must write a new row")


def check_pool_args(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float], pool: Tensor,
                    *, cu_seqlens: Optional[Tensor] = None, state_v_first: bool = False,
                    ssm_state_indices: Optional[Tensor] = None, num_accepted_tokens: Optional[Tensor] = None,
                    initial_state_indices: Optional[Tensor] = None, final_state_indices: Optional[Tensor] = None,
                    checkpoint_offsets: Optional[Tensor] = None, checkpoint_indices: Optional[Tensor] = None,
                    validate: bool = True, in_place: bool = True, host_offsets: bool = True,
                    start_indices: Optional[Tensor] = None) -> PoolPlan:
    """Check a pool call and return its :class:`PoolPlan`; ``ValueError``/``TypeError``
    naming the argument, what it got and what was expected.

    A decode call passes ``ssm_state_indices`` (and optionally ``num_accepted_tokens``); a
    prefill call ``initial_state_indices`` (and optionally ``final_state_indices``,
    ``checkpoint_offsets`` with ``checkpoint_indices``). Exactly one of the two kinds.

    Args:
        q, k, v, g, beta, scale, cu_seqlens: as :func:`torch_gdr.chunk_gated_delta_rule`
            (batched ``[B, T, ...]`` or token-major ``[T, ...]``).
        pool: ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``), see the
            module docstring.
        ssm_state_indices: ``[N]`` or ``[N, S]`` int32/int64.
        num_accepted_tokens: ``[N]`` int32/int64, values in ``1..S``, or None.
        start_indices: decode: ``[N]`` int32/int64, the row each sequence starts from (the
            public call's ``initial_state_indices`` with ``ssm_state_indices``: -1 reads
            zeros; a row it reads may be written by that sequence only), instead of
            ``ssm_state_indices`` at ``num_accepted_tokens - 1``; or None.
        initial_state_indices, final_state_indices: ``[N]`` int32/int64.
        checkpoint_offsets, checkpoint_indices: ``[N]`` or ``[N, M]`` int32/int64 of one
            shape (see :func:`pool_chunk_prefill`).
        validate: check index values on a device too (index tensors on the CPU are always
            checked).
        in_place: decode: the states are written into the pool's rows (vLLM's
            ``inplace_final_state=True``). False: only the start rows are read from the pool
            (see :func:`token_states_buffer`), so neither the one-row-per-token width nor the
            rules of written rows apply.
        host_offsets: the caller needs the sequences' offsets on the host (``plan.bos``,
            ``plan.seq_lens``). With False (a decode step that computes from ``cu_seqlens`` on
            the device), ``cu_seqlens`` on a device is read only to validate, and then
            ``plan.bos``/``plan.seq_lens`` are None; ``cu_seqlens`` on the CPU is always read.
    """
    check_inputs(q, k, v, g, beta, scale, None, cu_seqlens, 64, state_v_first)
    token_major = q.dim() == 3
    lead_b, lead_t = (1, q.shape[0]) if token_major else (q.shape[0], q.shape[1])
    num_v_heads, head_k_dim, head_v_dim = v.shape[-2], q.shape[-1], v.shape[-1]
    device = q.device
    _check_pool(pool, num_v_heads, head_k_dim, head_v_dim, state_v_first, device)
    check_no_grad(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool)
    bos: Optional[tuple[int, ...]]
    lens: Optional[tuple[int, ...]]
    if cu_seqlens is None:
        bos, lens = tuple(n * lead_t for n in range(lead_b)), (lead_t,) * lead_b
    elif host_offsets or validate or cu_seqlens.device.type == "cpu":
        offsets = read_cu_seqlens(cu_seqlens, lead_b * lead_t)
        bos, lens = tuple(offsets[:-1]), tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))
    else:  # left on the device: the values are not checked (validate=False)
        bos = lens = None
    num_seqs, slots = (cu_seqlens.shape[0] - 1 if lens is None else len(lens)), pool.shape[0]

    decode = ssm_state_indices is not None
    prefill = initial_state_indices is not None
    if decode == prefill:
        raise ValueError("ssm_state_indices / initial_state_indices: expected exactly one of them (decode: "
                         f"ssm_state_indices; prefill: initial_state_indices), got "
                         f"{'both' if decode else 'neither'}")
    common = dict(num_seqs=num_seqs, bos=bos, seq_lens=lens, token_major=token_major, slots=slots,
                  state_v_first=bool(state_v_first))
    if decode:
        for name, value in (("final_state_indices", final_state_indices), ("checkpoint_offsets", checkpoint_offsets),
                            ("checkpoint_indices", checkpoint_indices)):
            if value is not None:
                raise ValueError(f"{name}: is a prefill argument (with initial_state_indices); a decode call with "
                                 "ssm_state_indices takes none")
        return _check_decode(ssm_state_indices, num_accepted_tokens, device, validate, in_place, start_indices,
                             **common)
    if start_indices is not None:
        raise ValueError("start_indices: the start rows of a decode call (with ssm_state_indices); a prefill call "
                         "takes initial_state_indices")
    if lens is None:
        raise ValueError("host_offsets: a prefill call reads cu_seqlens on the host; pass host_offsets=True")
    if num_accepted_tokens is not None:
        raise ValueError("num_accepted_tokens: is a decode argument (with ssm_state_indices); a prefill call takes none")
    return _check_prefill(initial_state_indices, final_state_indices, checkpoint_offsets, checkpoint_indices, device,
                          validate, **common)


def _check_decode(ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], device: torch.device,
                  validate: bool, in_place: bool, start_indices: Optional[Tensor] = None, **common) -> PoolPlan:
    num_seqs, lens, slots = common["num_seqs"], common["seq_lens"], common["slots"]
    idx = _check_index_tensor("ssm_state_indices", ssm_state_indices, device, (1, 2), "[N] or [N, S]")
    if idx.shape[0] != num_seqs or (idx.dim() == 2 and idx.shape[1] < 1):
        raise ValueError(f"ssm_state_indices: expected shape [N] or [N, S >= 1] with N = {num_seqs} sequences, got "
                         f"{_shape(idx)}")
    width = 1 if idx.dim() == 1 else idx.shape[1]
    longest = 0 if lens is None else max(lens, default=0)  # unread offsets: not checked (validate=False)
    if in_place and longest > width:
        _refuse_too_many_tokens(idx, lens.index(longest), longest)
    acc = None
    if num_accepted_tokens is not None:
        acc = _check_index_tensor("num_accepted_tokens", num_accepted_tokens, device, (1,), "[N]")
        if acc.shape[0] != num_seqs:
            raise ValueError(f"num_accepted_tokens: expected shape [N] = [{num_seqs}], got {_shape(acc)}")
    start = _check_start_indices(start_indices, acc, num_seqs, device)
    if any(t is not None and t.device.type == "cpu" for t in (idx, acc, start)) or validate:
        _check_decode_values(idx, acc, lens, slots, in_place, start)
    indices = idx.to(device=device, dtype=torch.int64).reshape(num_seqs, width)
    read_pos = None if acc is None else acc.to(device=device, dtype=torch.int64) - 1
    if start is not None:
        start_rows = start.to(device=device, dtype=torch.int64)
    else:
        start_rows = indices[:, 0] if read_pos is None else indices.gather(1, read_pos.view(-1, 1))[:, 0]
    return PoolPlan(indices=indices, read_pos=read_pos, start_rows=start_rows, **common)


def _check_start_indices(start_indices: Optional[Tensor], acc: Optional[Tensor], num_seqs: int,
                         device: torch.device) -> Optional[Tensor]:
    """The decode's ``initial_state_indices [N]`` (public name), checked without reading values."""
    if start_indices is None:
        return None
    start = _check_index_tensor("initial_state_indices", start_indices, device, (1,), "[N]")
    if start.shape[0] != num_seqs:
        raise ValueError(f"initial_state_indices: expected shape [N] = [{num_seqs}], got {_shape(start)}")
    if acc is not None:
        raise ValueError("initial_state_indices: names the rows the sequences start from, as num_accepted_tokens "
                         "does; expected one of the two, got both")
    return start


def _check_decode_values(idx: Tensor, acc: Optional[Tensor], lens: Optional[Sequence[int]], slots: int,
                         in_place: bool, start: Optional[Tensor] = None) -> None:
    """The decode rules that read index values (on the host): rows in ``[-1, slots)``,
    ``num_accepted_tokens`` in ``1..S``, and, where the lengths ``lens`` are known, no row
    written twice nor written by one sequence and read by another. ``start``: the rows the
    sequences start from (``initial_state_indices``), or None."""
    num_seqs = idx.shape[0]
    width = 1 if idx.dim() == 1 else idx.shape[1]
    values = _values(idx)
    _check_rows_in_range("ssm_state_indices", values, slots)
    table = values if idx.dim() == 2 else [[row] for row in values]
    read = [0] * num_seqs
    if acc is not None:
        counts = _values(acc)
        for n, count in enumerate(counts):
            if not 1 <= count <= width:
                raise ValueError(f"num_accepted_tokens: expected values in 1..S = 1..{width} (at least one token is "
                                 f"always accepted), got {count} at index {n}")
        read = [c - 1 for c in counts]
    starts = None
    if start is not None:
        starts = _values(start)
        _check_rows_in_range("initial_state_indices", starts, slots)
    if lens is not None:  # which entries are written follows the lengths
        entry = "ssm_state_indices[{}, {}]"
        writes = [(table[n][j], n, (entry, n, j)) for n in range(num_seqs)
                  for j in range(lens[n]) if in_place and table[n][j] >= 0]
        if starts is None:
            reads = [(table[n][read[n]], n, (entry, n, read[n])) for n in range(num_seqs)
                     if lens[n] > 0 and table[n][read[n]] >= 0]
        else:
            reads = [(starts[n], n, ("initial_state_indices[{}]", n)) for n in range(num_seqs)
                     if lens[n] > 0 and starts[n] >= 0]
        _check_row_conflicts(writes, reads)


def _check_prefill(initial_state_indices: Tensor, final_state_indices: Optional[Tensor],
                   checkpoint_offsets: Optional[Tensor], checkpoint_indices: Optional[Tensor], device: torch.device,
                   validate: bool, **common) -> PoolPlan:
    num_seqs, lens, slots = common["num_seqs"], common["seq_lens"], common["slots"]
    named = [("initial_state_indices", initial_state_indices)]
    if final_state_indices is not None:
        named.append(("final_state_indices", final_state_indices))
    for name, t in named:
        _check_index_tensor(name, t, device, (1,), "[N]")
        if t.shape[0] != num_seqs:
            raise ValueError(f"{name}: expected shape [N] = [{num_seqs}], got {_shape(t)}")
    if (checkpoint_offsets is None) != (checkpoint_indices is None):
        given, missing = (("checkpoint_offsets", "checkpoint_indices") if checkpoint_indices is None
                          else ("checkpoint_indices", "checkpoint_offsets"))
        raise ValueError(f"{missing}: expected together with {given} (positions and the pool rows to write them "
                         f"to), got None")
    if checkpoint_offsets is not None:
        for name, t in (("checkpoint_offsets", checkpoint_offsets), ("checkpoint_indices", checkpoint_indices)):
            _check_index_tensor(name, t, device, (1, 2), "[N] or [N, M]")
            if t.shape[0] != num_seqs:
                raise ValueError(f"{name}: expected shape [N] or [N, M] with N = {num_seqs} sequences, got {_shape(t)}")
        if checkpoint_offsets.shape != checkpoint_indices.shape:
            raise ValueError(f"checkpoint_indices: expected the shape of checkpoint_offsets "
                             f"{_shape(checkpoint_offsets)}, got {_shape(checkpoint_indices)}")
    tensors = [t for _, t in named] + [t for t in (checkpoint_offsets, checkpoint_indices) if t is not None]
    ck_offsets = ck_rows = None
    if checkpoint_offsets is not None:
        # The offsets decide how the pass is split, so they are read on the host in any case.
        ck_offsets = _host(checkpoint_offsets).reshape(num_seqs, -1)
        ck_rows = _host(checkpoint_indices).reshape(num_seqs, -1)
    if any(t.device.type == "cpu" for t in tensors) or validate:
        initial = _values(initial_state_indices)
        final = initial if final_state_indices is None else _values(final_state_indices)
        _check_rows_in_range("initial_state_indices", initial, slots)
        if final_state_indices is not None:
            _check_rows_in_range("final_state_indices", final, slots)
        writes = [(r, n, f"final_state_indices[{n}]") for n, r in enumerate(final) if r >= 0]
        if ck_rows is not None:
            ck_table = ck_rows.tolist()
            _check_rows_in_range("checkpoint_indices",
                                 ck_table if checkpoint_indices.dim() == 2 else [row[0] for row in ck_table], slots)
            for n, (offs, rows) in enumerate(zip(ck_offsets.tolist(), ck_table)):
                for m, (off, row) in enumerate(zip(offs, rows)):
                    if row < 0:
                        continue
                    where = f"[{n}, {m}]" if checkpoint_indices.dim() == 2 else f"[{n}]"
                    if not 0 <= off <= lens[n]:
                        raise ValueError(f"checkpoint_offsets: expected a position in 0..{lens[n]} (the length of "
                                         f"sequence {n}), got {off} at {where}")
                    writes.append((row, n, f"checkpoint_indices{where}"))
        reads = [(r, n, f"initial_state_indices[{n}]") for n, r in enumerate(initial) if r >= 0]
        _check_row_conflicts(writes, reads)
    initial_rows = initial_state_indices.to(device=device, dtype=torch.int64)
    final_rows = initial_rows if final_state_indices is None else final_state_indices.to(device=device,
                                                                                         dtype=torch.int64)
    return PoolPlan(initial_rows=initial_rows, final_rows=final_rows, checkpoint_offsets=ck_offsets,
                    checkpoint_rows=ck_rows, **common)


# ---------------------------------------------------------------------------------------------
# The batched decode step's checks, traceable: values are read inside an op.


def check_batched_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                         pool: Tensor, ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor], *,
                         state_v_first: bool = False, validate: bool = True,
                         start_indices: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Check a decode call without ``cu_seqlens`` (B sequences of T tokens, or one of T
    token-major) as :func:`check_pool_args` does, in a form ``torch.compile`` traces into one
    graph that a varying batch does not recompile: the checks that read no index values run
    here; those that do (rows in range, ``num_accepted_tokens`` in ``1..S``, no row written
    twice, no row written by one sequence and read by another) run in the eager body of the
    op ``gdr::_pool_decode_rows``, which raises their ``ValueError`` at run time, compiled
    or not. Index values on a device are read (a host sync) unless ``validate=False``.

    Returns:
        ``(indices [N, S] int64, read_rows [N] int64)`` on the pool's device: the rows of
        every token (1-D indices as ``[N, 1]``) and the row each sequence starts from
        (``start_indices[n]``, else ``indices[n, num_accepted_tokens[n] - 1]``, or column 0).
    """
    check_inputs(q, k, v, g, beta, scale, None, None, 64, state_v_first)
    num_v_heads, head_k_dim, head_v_dim = v.shape[-2], q.shape[-1], v.shape[-1]
    _check_pool(pool, num_v_heads, head_k_dim, head_v_dim, state_v_first, q.device)
    check_no_grad(q=q, k=k, v=v, g=g, beta=beta, initial_state=pool)
    num_seqs, seq_len = (1, q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[1])
    idx = _check_index_tensor("ssm_state_indices", ssm_state_indices, q.device, (1, 2), "[N] or [N, S]")
    if idx.shape[0] != num_seqs or (idx.dim() == 2 and idx.shape[1] < 1):
        raise ValueError(f"ssm_state_indices: expected shape [N] or [N, S >= 1] with N = {num_seqs} sequences, got "
                         f"{_shape(idx)}")
    width = 1 if idx.dim() == 1 else idx.shape[1]
    if seq_len > width:
        _refuse_too_many_tokens(idx, 0, seq_len)
    acc = None
    if num_accepted_tokens is not None:
        acc = _check_index_tensor("num_accepted_tokens", num_accepted_tokens, q.device, (1,), "[N]")
        if acc.shape[0] != num_seqs:
            raise ValueError(f"num_accepted_tokens: expected shape [N] = [{num_seqs}], got {_shape(acc)}")
    start = _check_start_indices(start_indices, acc, num_seqs, q.device)
    check = validate or any(t is not None and t.device.type == "cpu" for t in (idx, acc, start))
    indices, read_rows = _decode_rows_op(idx, acc, start, int(pool.shape[0]), seq_len, check)
    return indices.to(pool.device), read_rows.to(pool.device)


def _decode_rows_impl(ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                      start_indices: Optional[Tensor], slots: int, seq_len: int, check: bool) -> tuple[Tensor, Tensor]:
    """The op's eager body: with ``check``, the decode rules on the index values (every
    sequence has ``seq_len`` tokens); then the rows as int64 ``[N, S]`` and the start rows."""
    num_seqs = ssm_state_indices.shape[0]
    if check:
        _check_decode_values(ssm_state_indices, num_accepted_tokens, [seq_len] * num_seqs, slots, True,
                             start_indices)
    indices = ssm_state_indices.to(torch.int64, copy=True).reshape(num_seqs, -1)
    if start_indices is not None:
        return indices, start_indices.to(device=indices.device, dtype=torch.int64, copy=True)
    if num_accepted_tokens is None:
        return indices, indices[:, 0].clone()
    read_pos = num_accepted_tokens.to(device=indices.device, dtype=torch.int64) - 1
    return indices, indices.gather(1, read_pos.view(-1, 1))[:, 0]


_decode_rows_op = torch.library.custom_op("gdr::_pool_decode_rows", _decode_rows_impl, mutates_args=())


@_decode_rows_op.register_fake
def _decode_rows_fake(ssm_state_indices: Tensor, num_accepted_tokens: Optional[Tensor],
                      start_indices: Optional[Tensor], slots: int, seq_len: int, check: bool) -> tuple[Tensor, Tensor]:
    num_seqs = ssm_state_indices.shape[0]
    width = 1 if ssm_state_indices.dim() == 1 else ssm_state_indices.shape[1]
    return (ssm_state_indices.new_empty((num_seqs, width), dtype=torch.int64),
            ssm_state_indices.new_empty((num_seqs,), dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Trees and intermediate states of a decode step.


@dataclass(frozen=True)
class ServePlan:
    """The host tables of a decode step with a token tree and/or an intermediate buffer
    (from :func:`check_serving_extras`).

    Attributes:
        parents: per sequence, the parent of each of its tokens (-1: the start state), or
            None (a chain: token j follows token j - 1).
        buffer_rows: per sequence, its row of the intermediate buffer (``[R, S_buf, ...]``;
            without a buffer, sequence n's row of a float32 scratch buffer, n).
        buffer_width: ``S_buf``, the slots of one buffer row.
    """

    parents: Optional[list[list[int]]]
    buffer_rows: list[int]
    buffer_width: int


def check_serving_extras(plan: PoolPlan, pool: Tensor, retrieve_parent_token: Optional[Tensor],
                         intermediate_states_buffer: Optional[Tensor], intermediate_state_indices: Optional[Tensor],
                         disable_state_update: bool, contiguous_buffer: bool = True) -> ServePlan:
    """The rules of a decode step's tree and intermediate buffer (``ValueError``/``TypeError``
    naming the argument); index values are read on the host.

    Args:
        plan: the step's :class:`PoolPlan` (decode, host offsets read).
        pool: the state pool ``[slots, HV, ...]``.
        retrieve_parent_token: ``[N, P]`` int32/int64 with ``P`` >= the longest sequence: token
            j of sequence n starts from the state after token ``retrieve_parent_token[n, j]``
            of the same sequence (-1: the sequence's start state); a parent comes before its
            child. Entries past a sequence's length are ignored. Or None.
        intermediate_states_buffer: ``[R, S_buf, HV, ...]`` in the pool's layout (its inner
            dims equal the pool's), float32, bfloat16 or float16, on the pool's device,
            ``S_buf`` >= the longest sequence; or None.
        intermediate_state_indices: ``[N]`` int32/int64 in ``[0, R)``, distinct among the
            sequences with tokens: the state after token j of sequence n goes to
            ``buffer[intermediate_state_indices[n], j]``. Given exactly with the buffer.
        disable_state_update: the pool is read, not written.
        contiguous_buffer: the caller's step needs a contiguous buffer (the steps over
            packed rows view it as a pool); the fused CPU step takes any strides.
    """
    lens, num_seqs = plan.seq_lens, plan.num_seqs
    longest = max(lens, default=0)
    if not isinstance(disable_state_update, bool):
        raise TypeError(f"disable_state_update: expected a bool, got {type(disable_state_update).__name__}")
    parents = None
    if retrieve_parent_token is not None:
        t = _check_index_tensor("retrieve_parent_token", retrieve_parent_token, pool.device, (2,), "[N, S]")
        if t.shape[0] != num_seqs or t.shape[1] < max(longest, 1):
            raise ValueError(f"retrieve_parent_token: expected shape [N, S] with N = {num_seqs} sequences and S >= "
                             f"{max(longest, 1)} (the longest sequence), got {_shape(t)}")
        parents = _values(t)
        for n in range(num_seqs):
            for j in range(lens[n]):
                if not -1 <= parents[n][j] < j:
                    raise ValueError(f"retrieve_parent_token: expected a parent before its child (-1: the start "
                                     f"state, or a token in 0..{j - 1}), got {parents[n][j]} at [{n}, {j}]")
    buffer, rows = intermediate_states_buffer, intermediate_state_indices
    if (buffer is None) != (rows is None):
        given, missing = (("intermediate_states_buffer", "intermediate_state_indices") if rows is None
                          else ("intermediate_state_indices", "intermediate_states_buffer"))
        raise ValueError(f"{missing}: expected together with {given}, got None")
    if buffer is None:
        return ServePlan(parents, list(range(num_seqs)), max(longest, 1))
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"intermediate_states_buffer: expected a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype not in BUFFER_DTYPES:
        raise TypeError(f"intermediate_states_buffer: expected dtype float32, bfloat16 or float16, got {buffer.dtype}")
    inner = list(pool.shape[1:])
    if buffer.dim() != 5 or list(buffer.shape[2:]) != inner or buffer.shape[1] < max(longest, 1) or buffer.shape[0] < 1:
        raise ValueError(f"intermediate_states_buffer: expected shape [R, S, {', '.join(map(str, inner))}] (the "
                         f"pool's layout) with S >= {max(longest, 1)} (the longest sequence), got {_shape(buffer)}")
    if buffer.device != pool.device:
        raise ValueError(f"intermediate_states_buffer: expected a tensor on {pool.device} (the pool's device), got "
                         f"{buffer.device}")
    if any(stride == 0 and size > 1 for size, stride in zip(buffer.shape, buffer.stride())):
        raise ValueError(f"intermediate_states_buffer: expected a buffer whose elements do not overlap (it is "
                         f"written), got shape {_shape(buffer)} with strides {list(buffer.stride())}")
    if contiguous_buffer and not buffer.is_contiguous():
        raise ValueError(f"intermediate_states_buffer: expected a contiguous tensor, got strides {list(buffer.stride())}")
    idx = _check_index_tensor("intermediate_state_indices", rows, pool.device, (1,), "[N]")
    if idx.shape[0] != num_seqs:
        raise ValueError(f"intermediate_state_indices: expected shape [N] = [{num_seqs}], got {_shape(idx)}")
    values = _values(idx)
    seen: dict[int, int] = {}
    for n, row in enumerate(values):
        if not 0 <= row < buffer.shape[0]:
            raise ValueError(f"intermediate_state_indices: expected buffer rows in [0, R) = [0, {buffer.shape[0]}), "
                             f"got {row} at {n}")
        if lens[n] == 0:
            continue
        if row in seen:
            raise ValueError(f"intermediate_state_indices: row {row} is written twice in one call (sequences "
                             f"{seen[row]} and {n}); every sequence's buffer row must be distinct")
        seen[row] = n
    return ServePlan(parents, values, buffer.shape[1])


# ---------------------------------------------------------------------------------------------
# Rows in and out of the pool.


def pool_gather(pool: Tensor, initial_state_indices: Tensor, state_v_first: bool = False) -> Tensor:
    """The states of pool rows, key-first float32: ``[N, HV, K, V]``.

    Args:
        pool: ``[slots, HV, K, V]`` (``[slots, HV, V, K]`` with ``state_v_first``).
        initial_state_indices: ``[N]`` integer rows; -1 gives a zero state. Not checked
            here (see :func:`check_pool_args`); no host sync.
    """
    rows = initial_state_indices.to(device=pool.device, dtype=torch.int64)
    states = pool.index_select(0, rows.clamp_min(0)).to(torch.float32)
    if state_v_first:
        states = states.transpose(-1, -2)
    states = torch.where((rows >= 0).view(-1, 1, 1, 1), states, states.new_zeros(()))
    return states.contiguous()


def pool_scatter(pool: Tensor, final_state_indices: Tensor, states: Tensor, state_v_first: bool = False) -> None:
    """Write key-first states ``[N, HV, K, V]`` (any float dtype; rounded to the pool's) into
    rows ``final_state_indices [N]`` of the pool, in place; rows -1 are skipped. Rows must be
    distinct (see :func:`check_pool_args`). The pool's storage is never reallocated.

    Shapes follow N alone (no host read, no boolean mask: ``torch.compile`` traces it): a
    skipped entry writes again what the first written entry writes, or, when none is
    written, row 0 its own contents (the same bits)."""
    rows = final_state_indices.to(device=pool.device, dtype=torch.int64)
    if rows.numel() == 0:
        return
    values = store_cast(states, pool.dtype)
    if state_v_first:
        values = values.transpose(-1, -2)
    if pool.dtype in FP8_DTYPES:  # index_copy_ and where have no fp8 kernels: move the bytes
        pool, values = pool.view(torch.uint8), values.view(torch.uint8)
    written = rows >= 0
    first = torch.argmax(written.to(torch.int32)).view(1)  # the first written entry; 0 when none
    any_written = written.any()
    spare_row = torch.where(any_written, rows.index_select(0, first), torch.zeros_like(first))
    spare_value = torch.where(any_written, values.index_select(0, first), pool[:1])
    targets = torch.where(written, rows, spare_row)
    values = torch.where(written.view(-1, 1, 1, 1), values, spare_value)
    pool.index_copy_(0, targets, values)


def token_states_buffer(pool: Tensor, plan: PoolPlan) -> tuple[Tensor, Tensor]:
    """The decode step without writing the pool (vLLM's ``inplace_final_state=False``), as an
    in-place step over another buffer: the state after every token, at the token's row.

    Returns ``(states, indices)``: ``states [tokens + 1, HV, ...]`` of the pool's dtype and
    layout, where row ``bos[n]`` holds the start state of sequence n (its pool row, read as
    the plan says; zeros for -1) and the last row is scratch; ``indices [N, W]`` int64 on the
    pool's device (W: the longest sequence, at least 1), token j of sequence n at row
    ``bos[n] + j`` and -1 past its length. A decode step run in place over ``states`` with
    ``indices`` (no ``num_accepted_tokens``) leaves the state after flattened token t in row
    t: each sequence's first token reads the start state from the row it then overwrites.
    ``plan``: from :func:`check_pool_args` with ``in_place=False``. No host sync.
    """
    tokens = sum(plan.seq_lens)
    states = pool.new_empty((tokens + 1, *pool.shape[1:]))
    start = plan.start_rows
    start_states = pool.index_select(0, start.clamp_min(0))
    start_states = torch.where((start >= 0).view(-1, 1, 1, 1), start_states, start_states.new_zeros(()))
    # a sequence without tokens has no row: its start state goes to the scratch row
    first_rows = [b if n > 0 else tokens for b, n in zip(plan.bos, plan.seq_lens)]
    states.index_copy_(0, torch.tensor(first_rows, dtype=torch.int64, device=pool.device), start_states)
    width = max(max(plan.seq_lens, default=0), 1)
    table = [[b + j if j < n else -1 for j in range(width)] for b, n in zip(plan.bos, plan.seq_lens)]
    indices = torch.tensor(table, dtype=torch.int64, device=pool.device).reshape(plan.num_seqs, width)
    return states, indices


# ---------------------------------------------------------------------------------------------
# Decode over a pool.


def _flat_tokens(x: Tensor, token_major: bool) -> Tensor:
    """``[B, T, ...]`` or ``[T, ...]`` as ``[B * T, ...]``."""
    return x if token_major else x.reshape(-1, *x.shape[2:])


# ---------------------------------------------------------------------------------------------
# Prefill over a pool, with checkpoints at any offsets.


def _segments(plan: PoolPlan) -> list[list[int]]:
    """Per sequence, its boundaries ``0 = b_0 < b_1 < ... < b_s = L`` (``[0, 0]`` when empty):
    the distinct checkpoint offsets strictly inside it split it into ``s`` segments."""
    bounds = []
    for n, length in enumerate(plan.seq_lens):
        inner: set[int] = set()
        if plan.checkpoint_offsets is not None:
            for off, row in zip(plan.checkpoint_offsets[n].tolist(), plan.checkpoint_rows[n].tolist()):
                if row >= 0 and 0 < off < length:
                    inner.add(off)
        bounds.append([0, *sorted(inner), length])
    return bounds


def check_pool_tensors(q: Tensor, v: Tensor, pool: object, state_v_first: bool) -> None:
    """The checks of ``pool`` that read no index values (type, dtype, shape, strides, device
    against q ``[..., H, K]`` and v ``[..., HV, V]``): safe to run where a host sync is not."""
    _check_pool(pool, v.shape[-2], q.shape[-1], v.shape[-1], state_v_first, q.device)


def check_no_grad(**tensors: Optional[Tensor]) -> None:
    """Pools are for inference: with grad mode on, ``ValueError`` naming the first of
    ``tensors`` (argument name -> tensor or None) that requires grad."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{name}: requires grad, but state pools are for inference (updated in place, no "
                             f"gradient); call under torch.no_grad() or torch.inference_mode()")


def pool_chunk_prefill(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float],
                       pool: Tensor, *, initial_state_indices: Tensor, final_state_indices: Optional[Tensor] = None,
                       checkpoint_offsets: Optional[Tensor] = None, checkpoint_indices: Optional[Tensor] = None,
                       cu_seqlens: Optional[Tensor] = None, state_v_first: bool = False,
                       chunk_call: Callable[..., tuple[Tensor, Tensor]], validate: bool = True) -> Tensor:
    """The chunked op over a pool: read each sequence's initial row, write its final state
    (and its checkpoints) to rows, in place.

    Checkpoints. ``checkpoint_offsets [N, M]`` holds, per sequence, up to M token positions
    (any value in ``0..L_n``, in any order, not only multiples of the chunk) and
    ``checkpoint_indices [N, M]`` the pool row each state goes to: entry ``(n, m)`` writes the
    state of sequence n after its first ``checkpoint_offsets[n, m]`` tokens (0: the initial
    state; ``L_n``: the final one) to row ``checkpoint_indices[n, m]``. Rows -1 are padding
    (their offsets are ignored), so sequences may have different numbers of checkpoints.
    ``[N]`` tensors stand for ``[N, 1]``. Offsets are read on the host.

    How, in one pass over the tokens: each sequence is cut at its distinct inner offsets into
    segments; call ``m`` of :func:`torch_gdr.chunk_gated_delta_rule` runs the ``m``-th segment
    of every sequence that has one, packed as varlen, from the states the call before left
    (a varlen call cannot chain two segments of one sequence, so segments of one sequence
    go to successive calls). Every token is processed once; the number of calls is one more
    than the most inner offsets of one sequence, and each segment's tail chunk is padded.

    Args:
        q, k, v, g, beta, scale, cu_seqlens: as :func:`torch_gdr.chunk_gated_delta_rule`.
        pool: the state pool (module docstring), updated in place.
        initial_state_indices: ``[N]`` rows to start from (-1: zeros).
        final_state_indices: ``[N]`` rows for the final states (-1: not written); None: the
            initial rows.
        checkpoint_offsets, checkpoint_indices: see above, or None.
        state_v_first: the pool is value-first.
        chunk_call: ``chunk_call(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> (o,
            final_state)``, the chunked call on packed ``[1, T, ...]`` pieces with a key-first
            float32 initial state (the caller binds the backend, chunk size and l2norm).
        validate: check index values also when they live on a device.

    Returns:
        ``o`` in the shape and dtype of v.
    """

    plan = check_pool_args(q, k, v, g, beta, scale, pool, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                           initial_state_indices=initial_state_indices, final_state_indices=final_state_indices,
                           checkpoint_offsets=checkpoint_offsets, checkpoint_indices=checkpoint_indices,
                           validate=validate)
    device = v.device
    flat = [_flat_tokens(t, plan.token_major).unsqueeze(0) for t in (q, k, v, g, beta)]  # [1, Ttot, ...]
    states = pool_gather(pool, plan.initial_rows, state_v_first)
    bounds = _segments(plan)

    def run(pieces: list[Tensor], cu: list[int], initial: Tensor) -> tuple[Tensor, Tensor]:
        return chunk_call(*pieces, scale, initial, torch.tensor(cu, dtype=torch.int64))

    def write_checkpoints(seqs: list[int], reached: list[int], seq_states: Tensor, at_start: bool = False) -> None:
        """Write the checkpoints at the positions ``reached`` (one per sequence of ``seqs``,
        whose states are ``seq_states``); position 0 is written at the start only."""
        if plan.checkpoint_rows is None:
            return
        rows, picks = [], []
        for i, (n, pos) in enumerate(zip(seqs, reached)):
            for off, row in zip(plan.checkpoint_offsets[n].tolist(), plan.checkpoint_rows[n].tolist()):
                if row >= 0 and off == pos and (pos > 0 or at_start):
                    rows.append(row)
                    picks.append(i)
        if rows:
            pool_scatter(pool, torch.tensor(rows, dtype=torch.int64, device=device),
                         seq_states[torch.tensor(picks, dtype=torch.int64, device=device)], state_v_first)

    write_checkpoints(list(range(plan.num_seqs)), [0] * plan.num_seqs, states, at_start=True)
    layers = max(len(b) - 1 for b in bounds)
    if layers == 1:  # no inner checkpoint: one call over the packed input as it came
        cu = [*plan.bos, plan.bos[-1] + plan.seq_lens[-1]]
        o, states = run(flat, cu, states)
    else:
        o = torch.empty_like(flat[2])
        for m in range(layers):
            seqs = [n for n in range(plan.num_seqs) if len(bounds[n]) - 1 > m]
            token_ids: list[int] = []
            cu = [0]
            for n in seqs:
                start, end = plan.bos[n] + bounds[n][m], plan.bos[n] + bounds[n][m + 1]
                token_ids.extend(range(start, end))
                cu.append(cu[-1] + end - start)
            ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
            seq_ids = torch.tensor(seqs, dtype=torch.int64, device=device)
            pieces = [t.index_select(1, ids) for t in flat]
            o_m, s_m = run(pieces, cu, states.index_select(0, seq_ids))
            o.index_copy_(1, ids, o_m)
            states.index_copy_(0, seq_ids, s_m.to(states.dtype))
            write_checkpoints(seqs, [bounds[n][m + 1] for n in seqs], s_m)
    if plan.checkpoint_rows is not None and layers == 1:
        write_checkpoints(list(range(plan.num_seqs)), list(plan.seq_lens), states)
    pool_scatter(pool, plan.final_rows, states, state_v_first)
    return o.reshape(v.shape)
