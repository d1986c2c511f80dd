"""Stand-in for ``sgl_kernel``'s CPU GDN ops (tests only), served by torch_gdr.

Registers ``torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu``,
``fused_gdn_gating_cpu`` and ``fused_sigmoid_gating_delta_rule_update_cpu`` with SGLang's
argument names: key-first states ``[N, HV, K, V]``; the decode step updates the pool
``initial_state_source`` in place and returns o ``[T, 1, HV, V]``.
"""

from __future__ import annotations

from typing import Optional

import torch

import torch_gdr

from engine_standins_backend import backend


@torch.library.custom_op("sgl_kernel::chunk_gated_delta_rule_cpu", mutates_args=())
def chunk_gated_delta_rule_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor], output_final_state: bool,
                               cu_seqlens: Optional[torch.Tensor], head_first: bool,
                               use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if head_first:
        raise ValueError("head_first: the stand-in takes the [B, T, H, K] layout (head_first=False), got True")
    o, final = torch_gdr.chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                                output_final_state=True, cu_seqlens=cu_seqlens,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend())
    return o, final


@torch.library.custom_op("sgl_kernel::fused_gdn_gating_cpu", mutates_args=())
def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias)


@torch.library.custom_op("sgl_kernel::fused_sigmoid_gating_delta_rule_update_cpu",
                         mutates_args=("initial_state_source",))
def fused_sigmoid_gating_delta_rule_update_cpu(A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor,
                                               k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                               initial_state_source: torch.Tensor,
                                               initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
                                               use_qk_l2norm_in_kernel: bool, softplus_beta: float = 1.0,
                                               softplus_threshold: float = 20.0) -> torch.Tensor:
    g, beta = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias, beta=softplus_beta, threshold=softplus_threshold)
    o, _ = torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state_source,
                                                      ssm_state_indices=initial_state_indices, cu_seqlens=cu_seqlens,
                                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                      backend=backend())
    return o.transpose(0, 1).contiguous()
