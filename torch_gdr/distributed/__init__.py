"""Context parallelism: one packed batch of long sequences split across ranks of a process group.

    ctx = torch_gdr.distributed.build_cp_context(cu_seqlens_global, group)   # once per batch
    o, _ = torch_gdr.distributed.context_parallel_chunk_gated_delta_rule(
        q_local, k_local, v_local, g_local, beta_local, cp_context=ctx)     # this rank's tokens
    y = layer(x_local, cp_context=ctx)                                      # nn.GatedDeltaNet

Works over ``torch.distributed`` on any backend (gloo, NCCL, HCCL) and with every backend of
the op: it is built on the public call. Per call it makes one all-gather of
``(R - 1) * HV * K * (K + V)`` state elements per rank (the layer adds one of
``(R - 1) * (kernel_size - 1) * conv_dim`` inputs for the conv's halo), independent of T.
"""

from torch_gdr.distributed.chunk import context_parallel_chunk_gated_delta_rule
from torch_gdr.distributed.context import CommStats, CPContext, build_cp_context, plan_context
from torch_gdr.distributed.conv import conv_halo_state

__all__ = ["CPContext", "CommStats", "build_cp_context", "context_parallel_chunk_gated_delta_rule",
           "conv_halo_state", "plan_context"]
