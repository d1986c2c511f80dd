"""Chunk-state checkpoints for serving: the state every ``checkpoint_every`` tokens.

Prefix caching and speculative decoding keep the recurrent state at fixed token
boundaries, so that a later request sharing a prefix (or a rejected draft) restarts from
there. The convention followed is FlashInfer's GDN prefill ``state_checkpoints`` (also
what vLLM's ``return_intermediate_states`` feeds its prefix cache with):

- per sequence ``n`` of length ``L_n``: ``L_n // checkpoint_every`` checkpoints; checkpoint
  ``j`` (0-based) is the state after the first ``(j + 1) * checkpoint_every`` tokens of the
  sequence, so that the last one equals the final state when ``checkpoint_every``
  divides ``L_n``. No checkpoint for the initial state, none for a partial stretch.
- packed along dim 0 in sequence order: ``[num_checkpoints_total, HV, K, V]`` (value-first
  ``[.., V, K]`` with ``state_v_first``), float32 (float64 for float64 inputs);
- ``checkpoint_offsets [N + 1]`` int64, the cumulative counts (FlashInfer's
  ``checkpoint_cu_starts``): sequence ``n``'s checkpoints are rows
  ``checkpoint_offsets[n]:checkpoint_offsets[n + 1]``.

``checkpoint_every`` is a positive multiple of the chunk size: then every checkpoint is a
state at a chunk boundary, which the chunked forward computes anyway. They are read off the
states the forward keeps for a backward (:mod:`torch_gdr.ops.torch.chunk_states`), so the whole
call is one forward pass plus a gather.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._layout import canonical_call
from torch_gdr.ops.torch.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ops.torch.chunk_layout import layout_for_call
from torch_gdr.ops.torch.chunk_states import ChunkStates

Tensor = torch.Tensor


def check_checkpoint_every(checkpoint_every: object, chunk_size: int) -> int:
    """``checkpoint_every`` as an int; ``TypeError``/``ValueError`` unless it is a positive
    multiple of ``chunk_size``."""
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise TypeError(f"checkpoint_every: expected an int, got {type(checkpoint_every).__name__}")
    if checkpoint_every <= 0 or checkpoint_every % chunk_size != 0:
        raise ValueError(f"checkpoint_every: expected a positive multiple of chunk_size = {chunk_size}, "
                         f"got {checkpoint_every}")
    return checkpoint_every


def checkpoint_offsets_for(seq_lens: list[int], checkpoint_every: int, device: torch.device) -> Tensor:
    """``[N + 1]`` int64 cumulative checkpoint counts ``L_n // checkpoint_every``."""
    counts = [0] + [n // checkpoint_every for n in seq_lens]
    return torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0)


def gather_checkpoints(states: ChunkStates, layout, final_state: Tensor, seq_lens: list[int],
                       checkpoint_every: int) -> Tensor:
    """The checkpoints of a forward's kept chunk states, key-first ``[total, HV, K, V]``.

    Args:
        states: the forward's :class:`ChunkStates` (``keep=True``) of ``layout``.
        layout: the call's :class:`~torch_gdr.ops.torch.chunk_layout.ChunkLayout`.
        final_state: ``[N, HV, K, V]`` in the caller's order of sequences.
        seq_lens: ``L_n`` in the caller's order.
        checkpoint_every: a multiple of ``layout.chunk_size``.
    """
    hv, c = layout.num_v_heads, layout.chunk_size
    # sorted position of every sequence (varlen layouts order sequences by length)
    position = list(range(layout.num_seqs))
    if layout.varlen:
        for s, n in enumerate(layout.order.tolist()):
            position[n] = s
    spans = states.segments
    by_chunk: dict[int, list[int]] = {}  # chunk -> the spans covering it (one per group of sequences)
    for i, span in enumerate(spans):
        for chunk in range(span.c0, span.c1):
            by_chunk.setdefault(chunk, []).append(i)
    pieces = []
    for n, length in enumerate(seq_lens):
        s = position[n]
        for j in range(length // checkpoint_every):
            tokens = (j + 1) * checkpoint_every
            if tokens == length:  # the state after the last token: the final state
                pieces.append(final_state[n])
                continue
            chunk = tokens // c  # the chunk this state enters
            i = next(i for i in by_chunk[chunk] if spans[i].n0 <= s < spans[i].n1)
            row = (s - spans[i].n0) * hv
            pieces.append(states.block(i)[chunk - spans[i].c0, row:row + hv])
    shape = (0,) + tuple(final_state.shape[1:])
    return torch.stack(pieces) if pieces else final_state.new_empty(shape)


def chunk_gated_delta_rule_with_checkpoints(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    checkpoint_every: int,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    chunk_size: int = 64,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunked forward that also returns the state every ``checkpoint_every`` tokens.

    Arguments as :func:`torch_gdr.chunk_gated_delta_rule` (any public layout, checked by the
    caller), plus ``checkpoint_every``, a positive multiple of ``chunk_size`` (checked by the
    caller with :func:`check_checkpoint_every`). For inference: nothing returned carries
    autograd history.

    Returns:
        ``o`` (shape and dtype of v), the final state ``[N, HV, K, V]``, the checkpoints
        ``[num_checkpoints_total, HV, K, V]`` (both value-first with ``state_v_first``;
        float32, float64 for float64 inputs) and ``checkpoint_offsets [N + 1]`` int64 on
        the inputs' device; see the module docstring for the convention.

    """
    call = canonical_call(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, chunk_size,
                          state_v_first)
    with torch.no_grad():
        o, final_state, storage = chunk_gated_delta_rule_fwd(call, save_states=True)
        layout = layout_for_call(call.v, call.offsets, chunk_size)
        states = ChunkStates(layout, None, q.shape[-1], v.shape[-1], keep=True, storage=storage)
        checkpoints = gather_checkpoints(states, layout, final_state, call.seq_lens, checkpoint_every)
    o, final_state = call.public_outputs(o, final_state)
    return (o, final_state, call.public_state(checkpoints).contiguous(),
            checkpoint_offsets_for(call.seq_lens, checkpoint_every, q.device))
