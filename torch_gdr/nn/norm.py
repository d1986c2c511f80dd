"""Gated RMSNorm: the output normalisation of a Gated DeltaNet layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedRMSNorm(nn.Module):
    """RMS-normalise ``x`` over its last dim, scale by ``weight``, then gate by ``silu(gate)``.

    ``y = weight * (x / sqrt(mean(x**2) + eps)) * silu(gate)``, normalised before gating
    (the order of Qwen3-Next and flash-linear-attention's ``FusedRMSNormGated``). The
    statistics are taken in float32 and the result has the dtype of ``x``.

    Args:
        hidden_size: size of the normalised (last) dim, the value head dim in Gated DeltaNet.
        eps: added to the mean square.

    Parameters:
        weight: ``[hidden_size]``, initialised to ones.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x, gate [..., hidden_size]`` (any float dtypes) -> ``[..., hidden_size]`` in the dtype of x."""
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
