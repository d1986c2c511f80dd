"""Stand-in for ``flashinfer.gdn_decode`` (tests only): FlashInfer's pretransposed GDN decode
served by ``torch_gdr.fused_recurrent_gated_delta_rule`` over a pool.

States value-first ``[B or pool, HV, V, K]`` (``state_v_first=True``), updated in place;
the gate and beta activations in the kernel (``use_gate_in_kernel``); ``initial_state`` with
``initial_state_indices`` is a pool read and written at those rows (any row stride). A -1
index gives a zero output (FlashInfer's float32 path; issue 36 item 8: torch_gdr itself
returns the zero state's output). ``output_state_indices`` other than the read rows (a
decode that reads one row and writes another, issue 36 item 2) is not in torch_gdr's
decode: ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Optional

import torch

import torch_gdr

from engine_standins_backend import backend


def gated_delta_rule_decode_pretranspose(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                         state: Optional[torch.Tensor], A_log: torch.Tensor, a: torch.Tensor,
                                         dt_bias: torch.Tensor, b: torch.Tensor, scale: Optional[float] = None,
                                         output: Optional[torch.Tensor] = None, use_qk_l2norm: bool = True,
                                         initial_state: Optional[torch.Tensor] = None,
                                         initial_state_indices: Optional[torch.Tensor] = None,
                                         output_state_indices: Optional[torch.Tensor] = None
                                         ) -> tuple[torch.Tensor, torch.Tensor]:
    if initial_state is not None:
        if initial_state_indices is None:
            raise ValueError("initial_state_indices: required with initial_state (the pool)")
        pool, rows = initial_state, initial_state_indices
        if output_state_indices is not None and not torch.equal(output_state_indices.long(), rows.long()):
            raise NotImplementedError("output_state_indices: a decode that reads one row and writes another is "
                                      "not in torch_gdr's decode (issue 36 item 2)")
    else:
        if state is None:
            raise ValueError("state: required without initial_state")
        pool, rows = state, torch.arange(q.shape[0], device=q.device)
    batch, tokens = q.shape[:2]
    indices = rows.long()[:, None] if tokens == 1 else rows.long()[:, None].expand(batch, tokens)
    with torch.no_grad():
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, a, b, scale=scale, initial_state=pool, ssm_state_indices=indices.contiguous(),
            use_qk_l2norm_in_kernel=use_qk_l2norm, state_v_first=True, use_gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend())
        o = o.masked_fill((rows.long() < 0).view(-1, 1, 1, 1), 0)
        if output is not None:
            output.copy_(o)
            o = output
    return o, pool
