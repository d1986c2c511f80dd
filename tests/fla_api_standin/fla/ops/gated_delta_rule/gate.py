"""fla.ops.gated_delta_rule.gate of the stand-in: the GDN gate, fused (torch_gdr's) and plain."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from torch_gdr._gating import gdn_gate


def naive_gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor] = None,
                   output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``-exp(A_log) * softplus(g + dt_bias)`` written out in float32, the reference."""
    x = g.float() if dt_bias is None else g.float() + dt_bias.float()
    return (-torch.exp(A_log.float()) * F.softplus(x)).to(output_dtype)


def fused_gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor] = None,
                   output_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The gate as torch_gdr applies it for ``use_gate_in_kernel``."""
    return gdn_gate(g, A_log, dt_bias).to(output_dtype)
