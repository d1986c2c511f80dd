"""Helpers shared by the reference implementations: dtypes, l2norm, varlen packing."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Accumulation and state dtype: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` along the last dim, in the dtype of ``x``."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def repeat_kv_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Expand q/k heads ``[..., H, D]`` to ``[..., HV, D]``: value head h reads head h // (HV // H)."""
    group = num_v_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


class SequencePadding:
    """Maps tokens of a batch or a packed varlen batch onto ``[N, NC * C, ...]``.

    Every sequence starts a fresh chunk and is zero-padded to a whole number of chunks
    (and, in varlen, to the longest sequence's number of chunks). Zero padding
    (k = v = beta = 0, g = 0) leaves outputs and final states exact.

    Args:
        batch_size: B of the ``[B, T, ...]`` input (1 when ``cu_seqlens`` is given).
        seq_len: T.
        cu_seqlens: ``[N + 1]`` integer offsets, or None for B equal-length sequences.
        chunk_size: C.
    """

    def __init__(self, batch_size: int, seq_len: int, cu_seqlens: Optional[torch.Tensor], chunk_size: int,
                 device: torch.device) -> None:
        self.chunk_size = chunk_size
        self.cu_seqlens = cu_seqlens
        if cu_seqlens is None:
            self.num_seqs = batch_size
            max_len = seq_len
        else:
            offsets = cu_seqlens.to(device=device, dtype=torch.int64)
            lengths = offsets[1:] - offsets[:-1]
            self.num_seqs = lengths.shape[0]
            max_len = int(lengths.max().item()) if self.num_seqs > 0 else 0
        self.num_chunks = -(-max_len // chunk_size)
        self.padded_len = self.num_chunks * chunk_size
        self.seq_len = seq_len
        if cu_seqlens is not None:
            positions = torch.arange(self.padded_len, device=device)
            self.valid = positions[None, :] < lengths[:, None]  # [N, NC * C]
            self.token_index = torch.where(self.valid, offsets[:-1, None] + positions[None, :], 0)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, T, *rest]`` -> ``[N, NC * C, *rest]``, zeros past each sequence's end."""
        if self.cu_seqlens is None:
            extra = self.padded_len - self.seq_len
            if extra == 0:
                return x
            return F.pad(x, [0, 0] * (x.dim() - 2) + [0, extra])
        gathered = x[0][self.token_index]
        mask = self.valid.view(self.valid.shape + (1,) * (x.dim() - 2))
        return torch.where(mask, gathered, gathered.new_zeros(()))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, NC * C, *rest]`` -> ``[B, T, *rest]`` (``[1, T, *rest]`` in varlen)."""
        if self.cu_seqlens is None:
            return x[:, : self.seq_len]
        return x[self.valid].unsqueeze(0)
