"""The context-parallel plan: which tokens each rank holds and which sequences cross ranks.

Ranks hold contiguous slices of the packed tokens, in rank order: rank ``r`` holds global
tokens ``[slice_bounds[r], slice_bounds[r + 1])``. By default the slices are equal
(``T / world_size`` tokens each, flash-linear-attention's convention, which requires
``T % world_size == 0``); ``slice_bounds`` gives any other split. A sequence may start, end or
pass through any rank, and several may sit on one rank. Of the sequences a rank holds, only
the first can have started on an earlier rank (its *head*) and only the last can go on to a
later rank (its *tail*); head and tail are one sequence when the slice lies inside it.

An empty sequence belongs to the rank whose slice contains its offset (the last rank when
its offset is ``T``), so every sequence, empty or not, has exactly one rank where it starts
and one where it ends.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Bytes and seconds of the collectives made under one context, summed over calls.

    ``bytes_sent`` counts the payload that leaves this rank: ``(world_size - 1) * piece``
    per all-gather (every other rank needs this rank's piece), and the same for the
    reduce-scatter of its backward. ``seconds`` is the wall time of the forward collectives
    (launch to completion). Thread-safe.
    """

    calls: int = 0
    bytes_sent: int = 0
    backward_bytes_sent: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, *, calls: int = 0, bytes_sent: int = 0, backward_bytes_sent: int = 0, seconds: float = 0.0) -> None:
        with self._lock:
            self.calls += calls
            self.bytes_sent += bytes_sent
            self.backward_bytes_sent += backward_bytes_sent
            self.seconds += seconds

    def __getstate__(self) -> dict:  # picklable (the lock is not)
        with self._lock:
            return {name: getattr(self, name) for name in ("calls", "bytes_sent", "backward_bytes_sent", "seconds")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def reset(self) -> None:
        with self._lock:
            self.calls = self.bytes_sent = self.backward_bytes_sent = 0
            self.seconds = 0.0


@dataclass
class CPContext:
    """What one rank needs to run its slice of a packed batch: built by :func:`build_cp_context`.

    Attributes:
        group: the process group (None: the default group).
        world_size: ranks of the group the context was built for.
        rank: this rank's index in the group.
        slice_bounds: ``world_size + 1`` global token offsets; rank r holds
            ``[slice_bounds[r], slice_bounds[r + 1])``.
        global_cu_seqlens: ``[N + 1]`` int64 (CPU), the global offsets.
        cu_seqlens: ``[N_local + 1]`` int64 (CPU), this rank's local offsets: the pieces of the
            sequences it holds, in order (the ``cu_seqlens`` of its local call).
        sequence_ids: ``[N_local]`` int64 (CPU), the global index of each local sequence.
        head_continues: the first local sequence started on an earlier rank.
        tail_continues: the last local sequence goes on to a later rank.
        head_ranks: the earlier ranks the head's state comes through, in order (empty unless
            ``head_continues``).
        head_tokens_before: tokens of the head sequence on earlier ranks.
        any_crossing: some sequence crosses some rank boundary (False: every rank can run
            alone and no collective is made).
        stats: bytes and seconds of the collectives made under this context.
    """

    group: Optional[dist.ProcessGroup]
    world_size: int
    rank: int
    slice_bounds: tuple[int, ...]
    global_cu_seqlens: torch.Tensor
    cu_seqlens: torch.Tensor
    sequence_ids: torch.Tensor
    head_continues: bool
    tail_continues: bool
    head_ranks: tuple[int, ...]
    head_tokens_before: int
    any_crossing: bool
    stats: CommStats = field(default_factory=CommStats)

    @property
    def num_tokens(self) -> int:
        """Tokens of this rank's slice (T_local)."""
        return self.slice_bounds[self.rank + 1] - self.slice_bounds[self.rank]

    @property
    def num_sequences(self) -> int:
        """Local sequences (N_local), the first dim of this rank's initial and final states."""
        return int(self.sequence_ids.numel())

    @property
    def starts_here(self) -> torch.Tensor:
        """``[N_local]`` bool: the local sequence starts on this rank (its initial state row is read)."""
        mask = torch.ones(self.num_sequences, dtype=torch.bool)
        if self.head_continues:
            mask[0] = False
        return mask

    @property
    def ends_here(self) -> torch.Tensor:
        """``[N_local]`` bool: the local sequence ends on this rank (its final state row is the
        sequence's final state; other rows hold the state at this rank's last token)."""
        mask = torch.ones(self.num_sequences, dtype=torch.bool)
        if self.tail_continues:
            mask[-1] = False
        return mask


def _as_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected an integer tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens: expected an int32/int64 tensor, got {cu_seqlens.dtype}")
    offsets = cu_seqlens.detach().to(device="cpu", dtype=torch.int64)
    if offsets.dim() != 1 or offsets.numel() < 2:
        raise ValueError(f"cu_seqlens: expected the global offsets [N + 1] with N >= 1, "
                         f"got shape {list(offsets.shape)}")
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets starting at 0, got {offsets.tolist()}")
    return offsets


def _slice_bounds(total: int, world_size: int, slice_bounds: Optional[Sequence[int]]) -> tuple[int, ...]:
    if slice_bounds is None:
        if total % world_size != 0 or total < world_size:
            raise ValueError(f"cu_seqlens: {total} tokens do not split into {world_size} equal non-empty slices; "
                             "pass slice_bounds to split them otherwise")
        part = total // world_size
        return tuple(part * r for r in range(world_size + 1))
    bounds = tuple(int(b) for b in slice_bounds)
    if len(bounds) != world_size + 1:
        raise ValueError(f"slice_bounds: expected world_size + 1 = {world_size + 1} offsets, got {len(bounds)}")
    if bounds[0] != 0 or bounds[-1] != total or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"slice_bounds: expected strictly increasing offsets from 0 to the {total} tokens of "
                         f"cu_seqlens (non-empty slices that tile the packed batch), got {list(bounds)}")
    return bounds


def _owner(position: int, bounds: tuple[int, ...]) -> int:
    """Rank whose slice contains global token ``position`` (the last rank for ``position == T``)."""
    return min(bisect.bisect_right(bounds, position) - 1, len(bounds) - 2)


def plan_context(cu_seqlens: torch.Tensor, world_size: int, rank: int, slice_bounds: Optional[Sequence[int]] = None,
                 group: Optional[dist.ProcessGroup] = None) -> CPContext:
    """The context of ``rank`` among ``world_size`` ranks, without a process group (pure index
    arithmetic; :func:`build_cp_context` calls it with the group's size and rank)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    offsets = _as_offsets(cu_seqlens)
    bounds = _slice_bounds(int(offsets[-1]), world_size, slice_bounds)
    start, end = bounds[rank], bounds[rank + 1]

    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    local_ids, local_offsets = [], [0]
    for seq, (a, b) in enumerate(zip(starts, ends)):
        holds = (a < end and b > start) if b > a else _owner(a, bounds) == rank
        if holds:
            local_ids.append(seq)
            local_offsets.append(min(b, end) - start)
    head_continues = bool(local_ids) and starts[local_ids[0]] < start
    tail_continues = bool(local_ids) and ends[local_ids[-1]] > end
    head_start = starts[local_ids[0]] if head_continues else start
    head_ranks = tuple(range(_owner(head_start, bounds), rank)) if head_continues else ()
    inner = bounds[1:-1]  # a sequence crosses a boundary when one lies strictly inside it
    any_crossing = any(bisect.bisect_right(inner, a) < bisect.bisect_left(inner, b) for a, b in zip(starts, ends))
    return CPContext(
        group=group, world_size=world_size, rank=rank, slice_bounds=bounds, global_cu_seqlens=offsets,
        cu_seqlens=torch.tensor(local_offsets, dtype=torch.int64),
        sequence_ids=torch.tensor(local_ids, dtype=torch.int64),
        head_continues=head_continues, tail_continues=tail_continues, head_ranks=head_ranks,
        head_tokens_before=start - head_start, any_crossing=any_crossing)


def build_cp_context(cu_seqlens: torch.Tensor, group: Optional[dist.ProcessGroup] = None, *,
                     slice_bounds: Optional[Sequence[int]] = None) -> CPContext:
    """The context-parallel context of this rank (flash-linear-attention's name and call).

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64 GLOBAL offsets of the packed sequences, the same on
            every rank (any device; read on the CPU once, here).
        group: the process group the tokens are split over (None: the default group). Every
            rank of it must build its context from the same arguments.
        slice_bounds: ``world_size + 1`` global token offsets, strictly increasing from 0 to
            ``T``: rank r holds tokens ``[slice_bounds[r], slice_bounds[r + 1])``. None: equal
            slices of ``T / world_size`` tokens (``T % world_size`` must be 0).

    Returns:
        A :class:`CPContext`; pass it as ``cp_context=`` to
        :func:`context_parallel_chunk_gated_delta_rule` (or the public call) and to
        ``nn.GatedDeltaNet``, with this rank's slice of the tokens. Its ``cu_seqlens`` are the
        local offsets, ``sequence_ids`` the global index of each local sequence.

    Every rank of the group must call it (it runs one small all-gather that checks that all
    ranks passed the same ``cu_seqlens`` and slice bounds).

    Raises:
        ValueError: offsets that are not non-decreasing from 0, slices that do not tile the
            ``T`` tokens of ``cu_seqlens`` (or ``T`` not divisible by the group size), no
            initialised process group, a group this process is not in; on every rank, ranks
            that passed different offsets or slice bounds, or a rank whose arguments failed.
        TypeError: non-integer ``cu_seqlens``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialised (call init_process_group first)")
    world_size = dist.get_world_size(group=group)
    rank = dist.get_rank(group=group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    # A rank whose arguments fail here still joins the agreement check below, so that the
    # others learn of it instead of waiting for it in their first collective.
    try:
        context: Optional[CPContext] = plan_context(cu_seqlens, world_size, rank, slice_bounds, group=group)
        local_error: Optional[Exception] = None
    except (TypeError, ValueError) as error:
        context, local_error = None, error
    _check_ranks_agree(context, group, rank, world_size, device=_collective_device(cu_seqlens, group))
    if local_error is not None:
        raise local_error
    assert context is not None
    return context


def _digest(values: Sequence[int]) -> list[int]:
    """Two int64 words of a hash of ``values`` (equal lists give equal words)."""
    raw = hashlib.sha256(torch.tensor(list(values), dtype=torch.int64).numpy().tobytes()).digest()
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)]


def _collective_device(cu_seqlens: object, group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a small tensor of the agreement check must live for the group's backend."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type != "cpu":
        return cu_seqlens.device
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "hccl" in backend:
        return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
    return torch.device("cpu")


def _check_ranks_agree(context: Optional[CPContext], group: Optional[dist.ProcessGroup], rank: int,
                       world_size: int, device: torch.device) -> None:
    """One all-gather of each rank's (ok, hash of the global offsets, hash of the slice bounds):
    ranks that planned from different arguments would each run a consistent-looking plan of
    their own and return results that do not fit together, so every rank raises instead.

    Raises:
        ValueError: on every rank, when the ranks' offsets or slice bounds differ; on the ranks
            whose own arguments were valid, when another rank's were not (that rank raises its
            own error).
    """
    if context is None:
        words = [0, 0, 0, 0, 0]
    else:
        words = [1, *_digest(context.global_cu_seqlens.tolist()), *_digest(context.slice_bounds)]
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).cpu()
    failed = [r for r in range(world_size) if int(table[r, 0]) == 0]
    if failed:
        if context is None:
            return  # this rank raises its own error
        raise ValueError(f"cu_seqlens: rank(s) {failed} of the group could not build their context from their "
                         "arguments (they raised the reason); every rank must pass the same valid GLOBAL offsets")
    for columns, argument in ((slice(1, 3), "cu_seqlens"), (slice(3, 5), "slice_bounds")):
        differ = [r for r in range(world_size) if not torch.equal(table[r, columns], table[rank, columns])]
        if differ:
            what = (f"the global offsets {context.global_cu_seqlens.tolist()}" if argument == "cu_seqlens"
                    else f"the slice bounds {list(context.slice_bounds)}")
            raise ValueError(f"{argument}: the ranks of the group disagree: rank {rank} has {what}, and rank(s) "
                             f"{differ} have others; every rank must build its context from the same cu_seqlens "
                             "and slice_bounds")
