"""Stand-in for the GDN ops of ``vllm._custom_ops`` on the CPU (tests only), served by
torch_gdr. vLLM's causal-conv1d ops are not torch_gdr's: absent here (the runner leaves
their tests out, with that reason)."""

from __future__ import annotations

from typing import Optional

import torch

import torch_gdr

from engine_standins_backend import backend


def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
                         beta: float = 1.0, threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g [1, T, HV] float32, sigmoid(b) [1, T, HV])`` from ``a``, ``b`` ``[T, HV]``."""
    return torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias, beta=beta, threshold=threshold)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor,
                                               k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                                               initial_state_source: torch.Tensor,
                                               initial_state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
                                               use_qk_l2norm_in_kernel: bool = False,
                                               scale: Optional[float] = None) -> torch.Tensor:
    """The decode step over the pool ``initial_state_source [slots, HV, K, V]`` (updated in
    place) with the gate and beta activations in the kernel; q, k ``[1, T, H, K]``, v ``[1, T,
    HV, V]``, a, b ``[T, HV]``, one token per sequence. Returns o ``[T, 1, HV, V]``."""
    o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
        q, k, v, a.unsqueeze(0), b.unsqueeze(0), scale=scale, initial_state=initial_state_source,
        ssm_state_indices=initial_state_indices, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend())
    return o.transpose(0, 1)


def chunk_gated_delta_rule_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: Optional[torch.Tensor], output_final_state: bool,
                               cu_seqlens: Optional[torch.Tensor], head_first: bool = False,
                               use_qk_l2norm_in_kernel: bool = False,
                               scale: Optional[float] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The chunked prefill, key-first states ``[N, HV, K, V]``; ``head_first`` must be False
    (the ``[B, T, H, K]`` layout)."""
    if head_first:
        raise ValueError("head_first: the stand-in takes the [B, T, H, K] layout (head_first=False), got True")
    return torch_gdr.chunk_gated_delta_rule(query, key, value, g, beta, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, backend=backend())
