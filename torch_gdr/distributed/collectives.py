"""The one collective of context parallelism: a differentiable all-gather, with its bytes counted.

It is PyTorch's functional collective ``_c10d_functional::all_gather_into_tensor`` (then
``wait_tensor``), ops whose autograd PyTorch registers through ``torch.library`` (the
all-gather's backward is a sum reduce-scatter, the wait's the identity), so gradients of every rank's use of a
gathered piece flow back to the rank that sent it. It runs on every backend
``torch.distributed`` has (gloo on CPUs, NCCL on GPUs, HCCL on NPUs).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers the collectives' autograd)

from torch_gdr.distributed.context import CPContext


def all_gather_pieces(piece: torch.Tensor, cp_context: CPContext) -> torch.Tensor:
    """Every rank's ``piece`` stacked in rank order: ``[world_size, *piece.shape]``, differentiable.

    Every rank of the group must call it with a piece of the same shape and dtype. Adds the
    payload (``(world_size - 1) * piece bytes`` each way), the call and its wall time to
    ``cp_context.stats``; the backward's bytes are added when it runs.
    """
    world_size = cp_context.world_size
    group = cp_context.group if cp_context.group is not None else dist.group.WORLD
    piece = piece.contiguous()
    payload = (world_size - 1) * piece.numel() * piece.element_size()
    began = time.perf_counter()
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(piece, world_size, group.group_name)
    gathered = torch.ops._c10d_functional.wait_tensor(gathered).view(world_size, *piece.shape)
    cp_context.stats.add(calls=1, bytes_sent=payload, seconds=time.perf_counter() - began)
    if gathered.requires_grad:
        gathered.register_hook(lambda grad: cp_context.stats.add(backward_bytes_sent=payload))
    return gathered
