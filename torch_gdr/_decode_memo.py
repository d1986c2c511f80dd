"""The decode rules of :mod:`torch_gdr._pool` at the cost of a small decode step.

A serving loop calls the decode step over a pool once per layer and token with the same
shapes, strides and dtypes; only the index values change. :func:`check_pool_args` checks
everything every time, which costs more than the fused CPU kernel of a one-sequence step.
This module lets a step skip the checks that read no index values once they have passed
for the same *signature*, and check the index values with a conservative quick test:

- :func:`signature`: a hashable key of every argument the metadata checks read (type,
  shape, strides, dtype, device and ``requires_grad`` of each tensor; the value of each
  scalar; grad mode), or None where an argument is neither a tensor nor a plain scalar.
- :class:`SignatureMemo`: a process-wide, thread-safe, bounded map from such keys to what
  the checks derived (a step's own record). Only calls that passed the full checks are
  stored, so a bad call always meets :func:`check_pool_args` and its error.
- :func:`quick_start_rows`: the value rules of a decode call (rows in ``[-1, slots)``,
  ``num_accepted_tokens`` in ``1..S``, no row written twice, no row written by one sequence
  and read by another) on the index values as Python lists; it returns the row each
  sequence starts from, or None where any rule might fail, and the caller then runs the
  full checks, which raise the error naming the entry (or pass, as the quick test is
  stricter than the rules only in cases the full checks settle).
"""

from __future__ import annotations

import threading
from typing import Callable, Generic, Optional, TypeVar

import torch

Tensor = torch.Tensor
Record = TypeVar("Record")

_SCALARS = (bool, int, float, str)


#: The fused CPU extension's ``decode_signature`` (the same key as bytes, computed in C++),
#: set by :func:`use_native_signature` once the extension is loaded; None before.
_native_signature: Optional[Callable[..., Optional[bytes]]] = None


def use_native_signature(native: Optional[Callable[..., Optional[bytes]]]) -> None:
    """Let :func:`signature` take ``native(*args)`` where it gives a key (plain tensors and
    scalars): the same information as the Python key, at a few C++ reads a tensor instead
    of several Python objects (after a decode step has swept the caches, the Python key of a
    public pool call took ~15 us; bench/RESULTS.md). None: the Python key only."""
    global _native_signature
    _native_signature = native


def signature(*args: object) -> Optional[tuple | bytes]:
    """The key of a call's metadata: per tensor ``(type, shape, strides, dtype, device,
    requires_grad)``, per scalar ``(type, value)``, None as None, and grad mode last; None
    (no key) where an argument is anything else. Computed in C++ (as bytes) where
    :func:`use_native_signature` has set the extension's function and it takes the
    arguments; a native key never equals a Python one, so a memo filled with one kind only
    misses the other."""
    native = _native_signature
    if native is not None:
        key = native(*args)
        if key is not None:
            return key
    return _python_signature(args)


def _python_signature(args: tuple) -> Optional[tuple]:
    """:func:`signature` in Python."""
    key = []
    for arg in args:
        if isinstance(arg, Tensor):
            key.append((type(arg), arg.shape, arg.stride(), arg.dtype, arg.device, arg.requires_grad))
        elif arg is None:
            key.append(None)
        elif type(arg) in _SCALARS:
            key.append((type(arg), arg))
        else:
            return None
    key.append(torch.is_grad_enabled())
    return tuple(key)


class SignatureMemo(Generic[Record]):
    """Signatures whose calls passed the full checks -> a record of what the checks derived.

    Thread-safe (a lock around every update; lookups read one dict entry) and bounded: at
    ``limit`` entries the memo starts over, so a process cycling through many shapes costs
    at most ``limit`` records."""

    def __init__(self, limit: int = 256) -> None:
        self._records: dict[tuple, Record] = {}
        self._lock = threading.Lock()
        self._limit = limit

    def get(self, key: Optional[tuple]) -> Optional[Record]:
        """The record of ``key``, or None (also for a None key)."""
        return None if key is None else self._records.get(key)

    def put(self, key: Optional[tuple], record: Record) -> None:
        """Remember ``record`` for ``key`` (a None key is not remembered)."""
        if key is None:
            return
        with self._lock:
            if len(self._records) >= self._limit:
                self._records.clear()
            self._records[key] = record

    def clear(self) -> None:
        with self._lock:
            self._records.clear()

    def __len__(self) -> int:
        return len(self._records)


def quick_start_rows(indices: list, accepted: Optional[list], starts: Optional[list], seq_len: int,
                     slots: int) -> Optional[list[int]]:
    """The row every sequence starts from, where the value rules surely hold; else None.

    Args:
        indices: ``ssm_state_indices`` as a list: ``[N]`` ints (one token a sequence) or
            ``[N][S]`` lists.
        accepted: ``num_accepted_tokens`` as ``[N]`` ints, or None.
        starts: the decode's ``initial_state_indices`` as ``[N]`` ints (-1: zeros), or None.
        seq_len: the tokens of every sequence (no ``cu_seqlens``), at most S.
        slots: rows of the pool.
    """
    if seq_len < 1 or not indices:
        return None
    if not isinstance(indices[0], list):  # [N]: one token a sequence, written to its row
        if accepted is not None and any(count != 1 for count in accepted):
            return None
        if min(indices) < -1 or max(indices) >= slots:
            return None
        written = [row for row in indices if row >= 0]
        if len(set(written)) != len(written):
            return None
        if starts is None:
            return indices
        return starts if _starts_ok(starts, indices, slots) else None
    width = len(indices[0])
    writer: dict[int, int] = {}
    for seq, table in enumerate(indices):
        if len(table) != width:
            return None
        for row in table[:seq_len]:
            if row < -1 or row >= slots:
                return None
            if row >= 0:
                if row in writer:
                    return None
                writer[row] = seq
        for row in table[seq_len:]:  # never written, but in range all the same
            if row < -1 or row >= slots:
                return None
    if starts is not None:
        if accepted is not None:
            return None
        for seq, row in enumerate(starts):
            if row < -1 or row >= slots or (row >= 0 and writer.get(row, seq) != seq):
                return None
        return starts
    rows = []
    for seq, table in enumerate(indices):
        column = 0 if accepted is None else accepted[seq] - 1
        if not 0 <= column < width:
            return None
        row = table[column]
        if row >= 0 and writer.get(row, seq) != seq:
            return None
        rows.append(row)
    return rows


def _starts_ok(starts: list, written_rows: list, slots: int) -> bool:
    """One token a sequence, each writing ``written_rows[n]``: every start row in range and
    read by no other sequence than the one writing it."""
    writer = {row: seq for seq, row in enumerate(written_rows) if row >= 0}
    return all(-1 <= row < slots and (row < 0 or writer.get(row, seq) == seq) for seq, row in enumerate(starts))
