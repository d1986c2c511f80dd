"""fla.ops.gated_delta_rule.naive of the stand-in: the per-token recurrence (torch_gdr's
definition) with fla's argument order and float32 arithmetic."""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule as _definition


def naive_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                                     g: torch.Tensor, scale: Optional[float] = None,
                                     initial_state: Optional[torch.Tensor] = None,
                                     output_final_state: bool = False):
    """q, k, v ``[B, T, H, *]`` (one q/k head per value head), beta, g ``[B, T, H]``; o in v's
    dtype, the final state float32 (None unless ``output_final_state``)."""
    o, final_state = _definition(q.float(), k.float(), v.float(), g.float(), beta.float(), scale=scale,
                                 initial_state=None if initial_state is None else initial_state.float())
    return o.to(v.dtype), (final_state if output_final_state else None)
