"""Helpers of the pure-torch engine: dtypes, l2norm, GVA head expansion,
triangular masks."""

from __future__ import annotations

import threading

import torch

from torch_gdr._layout import L2NORM_EPS, compute_dtype_for

__all__ = ["L2NORM_EPS", "compute_dtype_for", "l2norm", "lower_mask", "repeat_kv_heads"]


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` along the last dim, in the dtype of ``x``."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def repeat_kv_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Expand q/k heads ``[..., H, D]`` to ``[..., HV, D]``: value head h reads head h // (HV // H)."""
    group = num_v_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


_LOWER_MASKS: dict[tuple[int, bool, torch.device, torch.dtype], torch.Tensor] = {}
_LOWER_MASKS_LOCK = threading.Lock()


def lower_mask(c: int, device: torch.device, dtype: torch.dtype, strict: bool = False) -> torch.Tensor:
    """The lower triangular ``[C, C]`` 0/1 mask (strictly lower with ``strict``), built once
    per size, device and dtype. Masking by a multiply costs a fraction of ``masked_fill_``
    or ``tril_`` on a batch of matrices."""
    key = (c, strict, device, dtype)
    with _LOWER_MASKS_LOCK:
        mask = _LOWER_MASKS.get(key)
        if mask is None:
            mask = _LOWER_MASKS[key] = torch.ones(c, c, dtype=dtype, device=device).tril(-1 if strict else 0)
    return mask
