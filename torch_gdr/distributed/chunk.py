r"""Context-parallel chunked gated delta rule: each rank runs its slice, one all-gather joins them.

The math. A span of tokens of one sequence maps the state entering it, ``S [K, V]``, to
``M S + E``: ``E`` is the span's final state from a zero start and ``M [K, K]`` (per value
head) the product of its per-token transitions, ``M = A_n ... A_2 A_1`` with
``A_t = exp(g_t) (I - beta_t k_t k_t^T)``. The recurrence is linear in the state and its
value columns evolve independently, so one call of the op with ``K`` extra value columns
(``v`` padded with zeros, the initial state padded with the identity ``I [K, K]``) returns
``[E | M]`` as its final state, and, as the extra columns of its output,
``Y_t = P_t^T (scale q_t)`` with ``P_t`` the product of the transitions up to token t. A
rank whose first sequence began on an earlier rank gets the entering state ``S_in`` by
chaining the ``(M, E)`` of the ranks before it (``S <- M_j S + E_j``, in float32, float64
for float64 inputs), then corrects that sequence's outputs and final state exactly:
``o_t += S_in^T Y_t``, ``S_final = M S_in + E``.

Autograd does the backward: through the chain (the reverse chain of ``dS``), through the
all-gather (PyTorch registers its autograd: a sum reduce-scatter brings every rank's
gradient of ``(M, E)`` back to the rank that computed it) and through the op's own backward.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from torch_gdr.dispatch.run import needs_grad, run_chunk
from torch_gdr.ops._backend import OpArgs
from torch_gdr.distributed.collectives import all_gather_pieces
from torch_gdr.distributed.context import CPContext


def _zero_edge(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as ``like`` that autograd sees as depending on ``x`` (a zero gradient, never
    NaN): it keeps every rank's collectives in its autograd graph, so the backward's
    collectives run on all ranks, in the same order."""
    never = torch.zeros((), dtype=torch.bool, device=x.device)
    return like.new_zeros(like.shape) + torch.where(never, x.sum(), 0).to(like.dtype)


class LocalPass(NamedTuple):
    """What one rank computes on its own (see :func:`local_pass`)."""

    o: torch.Tensor  # [1, T_local, HV, V], outputs with a zero state entering the head
    final: torch.Tensor  # [N_local, HV, K, V], final states, likewise
    head_y: Optional[torch.Tensor]  # [1, head_len, HV, K]: Y_t = P_t^T (scale q_t) on the head's tokens
    head_transition: Optional[torch.Tensor]  # [HV, K, K]: M of the head's local part
    tail_piece: Optional[torch.Tensor]  # [HV, K, V + K]: [E | M] of the tail's local part (E with its h0)


def _segments(ctx: CPContext) -> list[tuple[int, int, bool]]:
    """The local sequences in up to three runs ``(first, stop, with_transition)``: the head if it
    continues from an earlier rank, the middle, the tail if it goes on to a later rank (one
    run when head and tail are one sequence). Only head and tail carry the extra columns."""
    num_seqs = ctx.num_sequences
    if ctx.head_continues and ctx.tail_continues and num_seqs == 1:
        return [(0, 1, True)]
    first = 1 if ctx.head_continues else 0
    stop = num_seqs - 1 if ctx.tail_continues else num_seqs
    runs = [(0, 1, True)] if ctx.head_continues else []
    if stop > first:
        runs.append((first, stop, False))
    if ctx.tail_continues:
        runs.append((num_seqs - 1, num_seqs, True))
    return runs


def local_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               scale: Optional[float], h0: Optional[torch.Tensor], ctx: CPContext, **op_kwargs) -> LocalPass:
    """This rank's part: the public op on its slice, with ``K`` extra value columns (zero values,
    identity initial state) on the head and tail sequences only.

    Args:
        q, k, v, g, beta: ``[1, T_local, ...]``, this rank's slice.
        scale: as for the public call.
        h0: ``[N_local, HV, K, V]`` key-first initial states in the state dtype (the head's row
            zero), or None.
        ctx: this rank's context.
        op_kwargs: ``use_qk_l2norm_in_kernel``, ``chunk_size``, ``backend`` of the public call.
    """
    key_dim, value_dim, value_heads = q.shape[-1], v.shape[-1], v.shape[-2]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    offsets = ctx.cu_seqlens.tolist()
    outputs, finals = [], []
    head_y = head_transition = tail_piece = None
    for first, stop, with_transition in _segments(ctx):
        lo, hi = offsets[first], offsets[stop]
        rows = (h0[first:stop] if h0 is not None else
                q.new_zeros((stop - first, value_heads, key_dim, value_dim), dtype=state_dtype))
        if hi == lo:  # empty sequences only: the final state is the initial state
            finals.append(rows)
            continue
        xs = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        if with_transition:
            eye = torch.eye(key_dim, dtype=state_dtype, device=q.device).expand(stop - first, value_heads, -1, -1)
            rows = torch.cat([rows, eye], dim=-1)
            xs[2] = torch.cat([xs[2], xs[2].new_zeros(xs[2].shape[:-1] + (key_dim,))], dim=-1)
        elif h0 is None:
            rows = None
        cu_seqlens = torch.tensor(offsets[first:stop + 1], dtype=torch.int64) - lo
        o, final = _local_call(*xs, scale, rows, cu_seqlens, **op_kwargs)
        if with_transition:
            if first == 0 and ctx.head_continues:
                head_y = o[:, offsets[0]:offsets[1], :, value_dim:]
                head_transition = final[0, ..., value_dim:]
            if stop == ctx.num_sequences and ctx.tail_continues:
                tail_piece = final[-1]
            o, final = o[..., :value_dim], final[..., :value_dim]
        outputs.append(o)
        finals.append(final.to(state_dtype))
    return LocalPass(torch.cat(outputs, dim=1), torch.cat(finals), head_y, head_transition, tail_piece)


def _local_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                scale: Optional[float], initial_state: Optional[torch.Tensor], cu_seqlens: torch.Tensor, *,
                use_qk_l2norm_in_kernel: bool, chunk_size: int, backend: Optional[str]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One local span through the backend dispatch picks (checked by the caller), with its
    final state."""
    args = OpArgs(q, k, v, g, beta, scale, initial_state, True, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                  False)
    return run_chunk(args, needs_grad(q, k, v, g, beta, initial_state), backend)


def check_context(cp_context: object, argument: str = "cp_context") -> CPContext:
    """``cp_context`` as a :class:`CPContext` built for this process's group size and rank."""
    if not isinstance(cp_context, CPContext):
        raise TypeError(f"{argument}: expected a CPContext from torch_gdr.distributed.build_cp_context, "
                        f"got {type(cp_context).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{argument}: torch.distributed is not initialised in this process")
    world_size = dist.get_world_size(group=cp_context.group)
    rank = dist.get_rank(group=cp_context.group)
    if (world_size, rank) != (cp_context.world_size, cp_context.rank):
        raise ValueError(f"{argument}: built for rank {cp_context.rank} of a group of {cp_context.world_size} "
                         f"ranks, but this process is rank {rank} of a group of {world_size}")
    return cp_context


def context_parallel_chunk_gated_delta_rule(
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
    cp_context: CPContext,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    r""":func:`torch_gdr.chunk_gated_delta_rule` on this rank's slice of a packed batch split over ranks.

    Every rank of ``cp_context.group`` calls it with its own slice of the tokens (rank r:
    global tokens ``cp_context.slice_bounds[r]`` to ``[r + 1]``); each gets exactly the
    outputs the single-process call gives for its tokens, and its share of every gradient.

    Args:
        q, k: ``[1, T_local, H, K]`` (or token-major ``[T_local, H, K]``), this rank's tokens.
        v: ``[1, T_local, HV, V]``; g, beta: ``[1, T_local, HV]``. Dtypes as for the public call.
        scale: as for the public call (``K ** -0.5`` when None).
        initial_state: ``[N_local, HV, K, V]`` (``[N_local, HV, V, K]`` with ``state_v_first``),
            one row per local sequence (``cp_context.sequence_ids``); a row is read only on
            the rank where its sequence starts (``cp_context.starts_here``): the state
            entering a sequence that began on an earlier rank comes from that rank, and the
            row of this rank gets a zero gradient. Zeros when None.
        output_final_state: return the local final states.
        use_qk_l2norm_in_kernel, chunk_size, state_v_first, backend: as for the public call.
        cu_seqlens: the LOCAL offsets (``cp_context.cu_seqlens``), or None to take them from
            the context.
        cp_context: from :func:`torch_gdr.distributed.build_cp_context` for this group.

    Returns:
        ``o`` in the shape and dtype of v, and (with ``output_final_state``) the final states
        ``[N_local, HV, K, V]`` (float32; float64 for float64 inputs): row i is the state after
        the local part of sequence i, which is the sequence's final state on the rank where it
        ends (``cp_context.ends_here``) and its state at this rank's last token otherwise.

    Communication: one all-gather per call when some sequence crosses a rank boundary (none
    otherwise), of one ``[HV, K, K + V]`` piece per rank: the ``(M, E)`` of the rank's last
    sequence if it goes on to a later rank (zeros otherwise). Each rank sends (and receives)
    ``(R - 1) * HV * K * (K + V) * b`` bytes per forward, R ranks, ``b = 4`` (8 for float64),
    and the same in the backward's reduce-scatter: O(R x crossing sequences x HV x (K x K +
    K x V)), independent of T, since a rank's piece serves the one sequence it passes on.
    Compute: the public op on the slice, in up to three calls (the head sequence, the middle,
    the tail sequence); the head's and the tail's carry ``K`` extra value columns, so a slice
    inside one sequence costs about what the plain op costs with ``V + K`` value columns.

    Every rank must make the call (the same number of times, in the same order), with grad
    mode alike, and, when training, backpropagate through its ``o``: the backward's
    reduce-scatter is a collective too.

    Raises:
        ValueError: a context built for another group size or rank, a slice length other than
            the context's, local ``cu_seqlens`` other than the context's, ``initial_state``
            for another number of sequences, B != 1; and everything the public call raises.
        TypeError: ``cp_context`` that is not a :class:`CPContext`.
    """
    ctx = check_context(cp_context)
    token_major = q.dim() == 3
    if q.dim() not in (3, 4) or (not token_major and q.shape[0] != 1):
        raise ValueError(f"q: context parallelism takes this rank's slice as [1, T_local, H, K] or [T_local, H, K], "
                         f"got shape {list(q.shape)}")
    num_tokens = q.shape[-3]
    if num_tokens != ctx.num_tokens:
        raise ValueError(f"q: cp_context gives rank {ctx.rank} the {ctx.num_tokens} tokens "
                         f"[{ctx.slice_bounds[ctx.rank]}, {ctx.slice_bounds[ctx.rank + 1]}), got {num_tokens}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or not torch.equal(
            cu_seqlens.detach().to(device="cpu", dtype=torch.int64), ctx.cu_seqlens)):
        raise ValueError(f"cu_seqlens: expected this rank's local offsets {ctx.cu_seqlens.tolist()} "
                         f"(cp_context.cu_seqlens) or None, got {cu_seqlens.tolist()}")
    num_seqs = ctx.num_sequences
    if initial_state is not None and (initial_state.dim() != 4 or initial_state.shape[0] != num_seqs):
        raise ValueError(f"initial_state: expected one row per local sequence, [N_local = {num_seqs}, HV, K, V] "
                         f"(cp_context.sequence_ids), got shape {list(initial_state.shape)}")

    if token_major:
        q, k, v, g, beta = (x.unsqueeze(0) for x in (q, k, v, g, beta))
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    h0 = None
    if initial_state is not None:
        h0 = (initial_state.transpose(-1, -2) if state_v_first else initial_state).to(state_dtype)
        if ctx.head_continues:  # the head's entering state comes from the earlier ranks
            h0 = torch.cat([torch.zeros_like(h0[:1]), h0[1:]])

    parts = local_pass(q, k, v, g, beta, scale, h0, ctx, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       chunk_size=chunk_size, backend=backend)
    o, final = parts.o, parts.final
    if ctx.any_crossing:
        piece = parts.tail_piece if parts.tail_piece is not None else _zero_edge(
            final, final.new_empty((v.shape[-2], key_dim, value_dim + key_dim)))
        gathered = all_gather_pieces(piece, ctx)  # [R, HV, K, V + K]
        if ctx.head_continues:
            assert parts.head_y is not None and parts.head_transition is not None
            entering = torch.zeros_like(final[0])
            for source in ctx.head_ranks:
                entering = gathered[source, ..., value_dim:] @ entering + gathered[source, ..., :value_dim]
            head_len = parts.head_y.shape[1]
            correction = torch.einsum("bthk,hkv->bthv", parts.head_y.to(state_dtype), entering)
            head_o = (o[:, :head_len].to(state_dtype) + correction).to(o.dtype)
            o = torch.cat([head_o, o[:, head_len:]], dim=1)
            final = torch.cat([(final[0] + parts.head_transition @ entering).unsqueeze(0), final[1:]])
        else:
            o = o + _zero_edge(gathered, o.new_empty(()))

    if token_major:
        o = o.squeeze(0)
    if not output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if state_v_first else final)
