"""The ``"torch"`` backend: every entry point, every dtype, head size and device."""

from __future__ import annotations

from torch_gdr.ops.torch.pool import pool_recurrent_step
from torch_gdr.ops._backend import ENTRIES, Backend, Capabilities
from torch_gdr.ops.torch.checkpoints import chunk_gated_delta_rule_with_checkpoints
from torch_gdr.ops.torch.op import torch_bwd, torch_fwd, torch_step

BACKEND = Backend(
    name="torch",
    capabilities=Capabilities(entries=frozenset(ENTRIES)),
    forward_op=torch_fwd,
    backward_op=torch_bwd,
    keeps_chunk_states=True,
    step=torch_step,  # inplace_final_state: dispatch copies its new state in (copy_)
    checkpoints=chunk_gated_delta_rule_with_checkpoints,
    pool_step=pool_recurrent_step,
    description="the chunked algorithm in pure torch, any device",
)
