"""Stand-in for ``flashinfer.gdn_kernels.gdn_decode_bf16_wy_output_only`` (tests only):
FlashInfer's output-only bf16-state MTP decode, served by torch_gdr's pool decode.

FlashInfer's contract at the recorded commit: the signature of
``gdn_decode_bf16_state.gated_delta_rule_mtp``, the pool ``[slots, HV, V, K]`` bf16 only read
(the state is frozen whatever ``disable_state_update`` says), outputs ``[B, T, HV, V]`` bf16
for every token (fp16 operands converted); ``initial_state_indices`` default ``arange(B)``,
int32 or int64. The state-writing features (``recovery_steps``, ``disable_output``, a buffer,
``accepted_steps``, ``ssm_state_indices``, ``output_state_indices``) raise
``NotImplementedError``; softplus ``beta`` other than 1, ``threshold`` other than 20 and
``use_qk_l2norm_in_kernel=False`` fail its asserts. A negative read row gives a zero output.
"""

from __future__ import annotations

from typing import Optional

import torch

from .gdn_decode_bf16_state import _mtp


def _refuse(name: str, given: bool) -> None:
    if given:
        raise NotImplementedError(f"gdn_decode_bf16_wy_output_only: {name} is not supported "
                                  "(this is an output-only / frozen-state kernel)")


def gated_delta_rule_mtp(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float = 1.0,
                         softplus_threshold: float = 20.0, q: Optional[torch.Tensor] = None,
                         k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                         b: Optional[torch.Tensor] = None, initial_state_source: Optional[torch.Tensor] = None,
                         initial_state_indices: Optional[torch.Tensor] = None,
                         output_state_indices: Optional[torch.Tensor] = None,
                         intermediate_states_buffer: Optional[torch.Tensor] = None,
                         accepted_steps: Optional[torch.Tensor] = None,
                         ssm_state_indices: Optional[torch.Tensor] = None, disable_state_update: bool = False,
                         use_qk_l2norm_in_kernel: bool = True, scale: Optional[float] = None,
                         output: Optional[torch.Tensor] = None, disable_output: bool = False,
                         recovery_steps: int = 0) -> torch.Tensor:
    """T tokens per sequence from the frozen pool rows ``initial_state_indices``; returns o
    ``[B, T, HV, V]`` bf16 (or ``output``, bf16, filled)."""
    assert q is not None and k is not None and v is not None, "q, k and v are required"
    assert b is not None and initial_state_source is not None, "b and initial_state_source are required"
    _refuse("recovery_steps>0", recovery_steps != 0)
    _refuse("disable_output=True (state-only mode)", disable_output)
    _refuse("intermediate-state caching", intermediate_states_buffer is not None)
    _refuse("per-request K / FLA-scatter", accepted_steps is not None or ssm_state_indices is not None)
    _refuse("split-pool (output_state_indices)", output_state_indices is not None)
    assert softplus_beta == 1.0, f"softplus_beta={softplus_beta} not supported (the kernel hardcodes beta=1.0)"
    assert softplus_threshold == 20.0, f"softplus_threshold={softplus_threshold} not supported (pass 20.0)"
    assert use_qk_l2norm_in_kernel, "use_qk_l2norm_in_kernel=False is not supported (the kernel always normalizes)"
    assert initial_state_source.dtype == torch.bfloat16, (
        f"initial_state_source must be bf16 (pool, HV, V, K); got {initial_state_source.dtype}")
    assert output is None or output.dtype == torch.bfloat16, f"output must be bf16; got {output.dtype}"
    if initial_state_indices is None:
        initial_state_indices = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    assert initial_state_indices.dtype in (torch.int32, torch.int64), (
        f"initial_state_indices must be int32 or int64; got {initial_state_indices.dtype}")
    return _mtp(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
                initial_state_indices, None, None, None, None, True, True, scale, output, False, 0,
                final_with_buffer=False)
