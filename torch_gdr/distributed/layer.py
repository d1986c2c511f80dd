"""What ``nn.GatedDeltaNet`` needs to run one rank's slice under context parallelism."""

from __future__ import annotations

from typing import Any, Optional

import torch

from torch_gdr.distributed.chunk import check_context
from torch_gdr.distributed.context import CPContext
from torch_gdr.distributed.conv import conv_halo_state


def context_parallel_layer_inputs(cp_context: Any, conv_input: torch.Tensor, kernel_size: int,
                                  cu_seqlens: Optional[torch.Tensor], cache: Any
                                  ) -> tuple[Optional[torch.Tensor], torch.Tensor, CPContext]:
    """The conv's initial state (the halo from earlier ranks), the local ``cu_seqlens`` and the
    checked context to pass to the public call, for a layer given ``cp_context``.

    Args:
        cp_context: a :class:`~torch_gdr.distributed.CPContext` for this group.
        conv_input: ``[1, T_local, C]``, the conv's input on this rank.
        kernel_size: the conv's kernel size.
        cu_seqlens: the layer's ``cu_seqlens`` argument: None or the context's local offsets.
        cache: the layer's ``cache`` argument: must be None.

    Raises:
        ValueError: a cache (decoding is not split over ranks), ``cu_seqlens`` other than the
            context's, hidden states that are not this rank's ``[1, T_local, hidden]`` slice.
    """
    ctx = check_context(cp_context)
    if cache is not None:
        raise ValueError("cache: not supported with cp_context (context parallelism is for training and prefill "
                         "without a decode cache)")
    if cu_seqlens is not None and not torch.equal(cu_seqlens.detach().to(device="cpu", dtype=torch.int64),
                                                  ctx.cu_seqlens):
        raise ValueError(f"cu_seqlens: with cp_context, expected None or the local offsets {ctx.cu_seqlens.tolist()}, "
                         f"got {cu_seqlens.tolist()}")
    if conv_input.shape[0] != 1 or conv_input.shape[1] != ctx.num_tokens:
        raise ValueError(f"hidden_states: with cp_context, expected this rank's slice [1, {ctx.num_tokens}, hidden], "
                         f"got batch {conv_input.shape[0]} and {conv_input.shape[1]} tokens")
    halo = conv_halo_state(conv_input, kernel_size, ctx)
    return halo, ctx.cu_seqlens, ctx
