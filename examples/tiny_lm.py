"""A small language model built from torch_gdr.nn.GatedDeltaNet, shared by the examples.

    embed -> [RMSNorm -> GatedDeltaNet -> +residual -> RMSNorm -> SwiGLU MLP -> +residual] x L
          -> RMSNorm -> lm head
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_v_heads: int, head_dim: int, layer_idx: int,
                 backend: Optional[str], chunk_size: int) -> None:
        super().__init__()
        self.mixer_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.mixer = GatedDeltaNet(hidden, num_heads, num_v_heads, head_dim, head_dim, layer_idx=layer_idx,
                                   backend=backend, chunk_size=chunk_size)
        self.mlp_norm = nn.RMSNorm(hidden, eps=1e-6)
        self.mlp = SwiGLU(hidden, 2 * hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                cache: Optional[GatedDeltaNetCache]) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), attention_mask=attention_mask, cu_seqlens=cu_seqlens, cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    """``ids [B, T]`` (or packed ``[1, T]`` with ``cu_seqlens``) -> logits ``[B, T, vocab]``."""

    def __init__(self, vocab: int = 64, hidden: int = 64, num_layers: int = 2, num_heads: int = 2,
                 num_v_heads: int = 4, head_dim: int = 16, backend: Optional[str] = None, chunk_size: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, num_heads, num_v_heads, head_dim, i, backend, chunk_size)
                                    for i in range(num_layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[GatedDeltaNetCache] = None) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, attention_mask, cache)
        return self.head(self.norm(x))
