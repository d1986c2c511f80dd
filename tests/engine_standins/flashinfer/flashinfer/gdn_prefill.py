"""Stand-in for ``flashinfer.gdn_prefill`` (tests only): FlashInfer's GDN prefill served by
``torch_gdr.chunk_gated_delta_rule``.

FlashInfer's conventions, mapped: token-major q, k, v ``[T, H, K]``; ``g`` is the decay
factor alpha (torch_gdr takes its log); states value-first ``[N, HV, V, K]``
(``state_v_first=True``); ``state_indices`` names pool rows read and written in place
(torch_gdr's pool prefill); ``checkpoint_every_n_tokens`` fills ``state_checkpoints`` (torch_gdr's pool prefill with
checkpoints at those offsets); ``use_qk_l2norm_in_kernel`` is accepted and not applied, as
FlashInfer's prefill does at the recorded commit; a sequence with no tokens leaves its
``output_state`` row untouched, as FlashInfer's. GQA (more query than
value heads, which torch_gdr does not take) is run with k, v, repeated to the query heads.
``use_cp`` (FlashInfer's context-parallel kernel choice) does not change the result.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import torch

import torch_gdr

from engine_standins_backend import backend


_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def _checkpoints_over_a_pool(q, k, v, g_log, beta, initial_state, cu_seqlens, every, common):
    """FlashInfer's checkpoints (every ``every`` tokens of each sequence) through torch_gdr's
    pool prefill on the stand-ins' backend: a scratch pool holds the final states (rows
    0..N-1) and the checkpoints (rows N...), written within the one pass."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    counts = [n // every for n in lengths]
    num, total, width = len(lengths), sum(counts), max(counts + [1])
    heads, dim_k, dim_v = q.shape[1], q.shape[-1], v.shape[-1]
    pool = torch.zeros(num + total, heads, dim_v, dim_k, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        pool[:num] = initial_state.float()
    offsets = torch.zeros(num, width, dtype=torch.int64)
    rows = torch.full((num, width), -1, dtype=torch.int64)
    start = num
    for n, c in enumerate(counts):
        offsets[n, :c] = torch.arange(1, c + 1) * every
        rows[n, :c] = torch.arange(start, start + c)
        start += c
    first = torch.arange(num) if initial_state is not None else torch.full((num,), -1, dtype=torch.int64)
    o, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g_log, beta, initial_state=pool, initial_state_indices=first,
                                            final_state_indices=torch.arange(num), checkpoint_offsets=offsets,
                                            checkpoint_indices=rows, backend=backend(), **common)
    return o, pool[:num], pool[num:]


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None,
                           beta: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
                           cu_seqlens: Optional[torch.Tensor] = None, use_qk_l2norm_in_kernel: bool = False,
                           output: Optional[torch.Tensor] = None, output_state: Optional[torch.Tensor] = None,
                           state_checkpoints: Optional[torch.Tensor] = None,
                           checkpoint_cu_starts: Optional[torch.Tensor] = None, checkpoint_every_n_tokens: int = 0,
                           use_cp: Union[Literal["auto"], bool] = "auto", state_indices: Optional[torch.Tensor] = None,
                           _cp_chunk_len: Optional[int] = None) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    if use_cp not in ("auto", True, False):
        raise ValueError(f'use_cp must be "auto", True, or False, got {use_cp!r}')
    if checkpoint_every_n_tokens < 0:
        raise ValueError(f"checkpoint_every_n_tokens must be non-negative, got {checkpoint_every_n_tokens}")
    if checkpoint_every_n_tokens > 0:
        if checkpoint_every_n_tokens % 64 != 0:
            raise ValueError(f"checkpoint_every_n_tokens must be a multiple of the chunk size (64), "
                             f"got {checkpoint_every_n_tokens}")
        if state_checkpoints is None or checkpoint_cu_starts is None:
            raise ValueError("state_checkpoints and checkpoint_cu_starts must both be provided "
                             "when checkpoint_every_n_tokens > 0")
        if state_checkpoints.dtype not in _STATE_DTYPES:
            raise ValueError(f"state_checkpoints must have dtype float32, bfloat16, float16, float8_e4m3fn or "
                             f"float8_e5m2, got {state_checkpoints.dtype}")
        if checkpoint_cu_starts.dim() != 1 or checkpoint_cu_starts.numel() != cu_seqlens.numel():
            raise ValueError(f"checkpoint_cu_starts must have {cu_seqlens.numel()} elements, "
                             f"got {checkpoint_cu_starts.numel()}")
    elif state_checkpoints is not None or checkpoint_cu_starts is not None:
        raise ValueError("state_checkpoints and checkpoint_cu_starts must be None when checkpoint_every_n_tokens == 0")
    assert cu_seqlens is not None, "cu_seqlens is required for varlen mode"
    heads = max(q.shape[1], v.shape[1])
    q, k, v = _expand(q, heads), _expand(k, heads), _expand(v, heads)
    total = q.shape[0]
    g_log = (torch.zeros(total, heads, dtype=torch.float32, device=q.device) if g is None
             else g.to(torch.float32).log())
    beta = torch.ones(total, heads, dtype=torch.float32, device=q.device) if beta is None else beta
    # FlashInfer's prefill takes use_qk_l2norm_in_kernel and does not apply it (at the recorded
    # commit the flag is documented and unused): its tests' references normalize no q
    common = dict(scale=scale, cu_seqlens=cu_seqlens, state_v_first=True)
    with torch.no_grad():
        if state_indices is not None:
            if output_final_state and output_state is None:
                raise ValueError("state_indices requires an explicit output_state pool sized like the initial_state "
                                 "pool (output_state: got None)")
            if output_state is initial_state:
                o, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g_log, beta, initial_state=initial_state,
                                                        initial_state_indices=state_indices, backend=backend(),
                                                        **common)
            else:
                rows = state_indices.long()
                start = None if initial_state is None else initial_state[rows].float()
                o, final = torch_gdr.chunk_gated_delta_rule(q, k, v, g_log, beta, initial_state=start,
                                                            output_final_state=True, backend=backend(), **common)
                if output_state is not None:
                    output_state[rows] = final.to(output_state.dtype)
            final_state = output_state
        elif checkpoint_every_n_tokens > 0:
            o, final, checkpoints = _checkpoints_over_a_pool(q, k, v, g_log, beta, initial_state, cu_seqlens,
                                                             checkpoint_every_n_tokens, common)
            state_checkpoints[:checkpoints.shape[0]] = checkpoints.to(state_checkpoints.dtype)
            final_state = final
        else:
            o, final_state = torch_gdr.chunk_gated_delta_rule(
                q, k, v, g_log, beta, initial_state=None if initial_state is None else initial_state.float(),
                output_final_state=True, backend=backend(), **common)
        if output_state is not None and state_indices is None:
            # FlashInfer writes no state for a sequence without tokens: its row stays as it was
            filled = (cu_seqlens[1:] - cu_seqlens[:-1]) > 0
            output_state[filled] = final_state[filled].to(output_state.dtype)
            final_state = output_state
        if output is not None:
            output.copy_(o)
            o = output
    return (o, final_state) if output_final_state else o
