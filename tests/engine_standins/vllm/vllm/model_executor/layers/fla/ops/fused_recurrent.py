"""Stand-in for ``vllm.model_executor.layers.fla.ops.fused_recurrent`` (tests only).

vLLM's decode kernel over a state pool, served by torch_gdr (which takes vLLM's names):

- ``ssm_state_indices [N]`` with one token per sequence, or ``[N, S]`` rows of distinct
  entries: torch_gdr's pool decode, as it stands;
- ``[N]`` with several tokens per sequence, or ``[N, S]`` rows repeating one entry (vLLM's
  kernel then rewrites the row after every token, the last write staying): the sequence
  starts from the row and its final state is written back to it, which is torch_gdr's pool
  prefill (``initial_state_indices = final_state_indices = rows``);
- no indices: ``initial_state [N, HV, K, V]`` per sequence; with ``inplace_final_state`` the
  final states are written back into it, as vLLM's kernel does.
"""

from __future__ import annotations

from typing import Optional

import torch

import torch_gdr

from engine_standins_backend import backend


def _one_row_per_sequence(indices: torch.Tensor) -> Optional[torch.Tensor]:
    """The ``[N]`` rows when every sequence's entries are one row (or the indices are 1-D)."""
    if indices.dim() == 1:
        return indices
    if bool((indices == indices[:, :1]).all()):
        return indices[:, 0].contiguous()
    return None


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                     initial_state: Optional[torch.Tensor] = None, inplace_final_state: bool = True,
                                     cu_seqlens: Optional[torch.Tensor] = None,
                                     ssm_state_indices: Optional[torch.Tensor] = None,
                                     num_accepted_tokens: Optional[torch.Tensor] = None,
                                     use_qk_l2norm_in_kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if beta is None:
        beta = torch.ones_like(g)
    common = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend())
    if ssm_state_indices is None:
        o, final = torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                              output_final_state=True, cu_seqlens=cu_seqlens, **common)
        if inplace_final_state and initial_state is not None:
            initial_state.copy_(final)
            return o, initial_state
        return o, final
    tokens_per_seq = (q.shape[1] if cu_seqlens is None else
                      int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0)
    rows = _one_row_per_sequence(ssm_state_indices) if num_accepted_tokens is None else None
    if rows is not None and tokens_per_seq > 1:
        return torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                initial_state_indices=rows, final_state_indices=rows,
                                                cu_seqlens=cu_seqlens, **common)
    return torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                      ssm_state_indices=ssm_state_indices,
                                                      num_accepted_tokens=num_accepted_tokens,
                                                      inplace_final_state=inplace_final_state, cu_seqlens=cu_seqlens,
                                                      **common)
