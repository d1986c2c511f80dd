"""Stand-in for ``flashinfer.gdn_decode`` (tests only): FlashInfer's pretransposed GDN decode
served by ``torch_gdr.fused_recurrent_gated_delta_rule`` over a pool.

States value-first ``[B or pool, HV, V, K]`` (``state_v_first=True``), updated in place;
the gate and beta activations in the kernel (``use_gate_in_kernel``); ``initial_state`` with
``initial_state_indices`` is a pool read and written at those rows (any row stride). A -1
index gives a zero output (FlashInfer's float32 path; issue 36 item 8: torch_gdr itself
returns the zero state's output). ``output_state_indices`` (a decode that reads one row and
writes another) go to torch_gdr's ``initial_state_indices`` (read rows) and
``ssm_state_indices`` (written rows).
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
    else:
        if state is None:
            raise ValueError("state: required without initial_state")
        pool, rows = state, torch.arange(q.shape[0], device=q.device)
    batch, tokens = q.shape[:2]
    rows = rows.long()
    # the final state's row: output_state_indices where given (torch_gdr's start rows read
    # one row and write another); a padding slot (-1 read row) writes nothing
    out_rows = rows if output_state_indices is None else output_state_indices.long().masked_fill(rows < 0, -1)
    indices = torch.full((batch, tokens), -1, dtype=torch.long, device=q.device)
    indices[:, -1] = out_rows
    with torch.no_grad():
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, a, b, scale=scale, initial_state=pool, ssm_state_indices=indices,
            initial_state_indices=rows,
            use_qk_l2norm_in_kernel=use_qk_l2norm, state_v_first=True, use_gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, backend=backend())
        o = o.masked_fill((rows < 0).view(-1, 1, 1, 1), 0)
        if output is not None:
            output.copy_(o)
            o = output
    return o, pool


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                            A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor,
                            scale: Optional[float] = None, output: Optional[torch.Tensor] = None,
                            use_qk_l2norm: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The key-first decode: ``state [B, HV, K, V]`` updated in place, one token per row."""
    with torch.no_grad():
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, a, b, scale=scale, initial_state=state, ssm_state_indices=torch.arange(q.shape[0]),
            use_qk_l2norm_in_kernel=use_qk_l2norm, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True, backend=backend())
        if output is not None:
            output.copy_(o)
            o = output
    return o, state


def gated_delta_rule_mtp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor,
                         initial_state_indices: torch.Tensor, A_log: torch.Tensor, a: torch.Tensor,
                         dt_bias: torch.Tensor, b: torch.Tensor, scale: Optional[float] = None,
                         output: Optional[torch.Tensor] = None,
                         intermediate_states_buffer: Optional[torch.Tensor] = None,
                         ssm_state_indices: Optional[torch.Tensor] = None,
                         disable_state_update: Optional[bool] = None, use_qk_l2norm: bool = True,
                         output_state_indices: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens per sequence from pool row ``initial_state_indices[b]`` (value-first pool; a
    negative row: padding, zero output, nothing written); the final state written back to
    that row unless ``disable_state_update`` (FlashInfer's default: True). Not in torch_gdr
    (``NotImplementedError`` naming the issue-36 item): FlashInfer's ``intermediate_states_buffer``
    (item 3; torch_gdr's has another indexing, not mapped here)."""
    if intermediate_states_buffer is not None:
        raise NotImplementedError("intermediate_states_buffer: intermediate states written in place into the "
                                  "caller's buffer are not in torch_gdr's decode (issue 36 item 3)")
    rows = initial_state_indices.long()
    out_rows = rows if output_state_indices is None else output_state_indices.long().masked_fill(rows < 0, -1)
    batch, tokens = q.shape[:2]
    flat = [x.reshape(1, batch * tokens, *x.shape[2:]) for x in (q, k, v, a, b)]
    cu = torch.arange(batch + 1) * tokens
    gating = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    common = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm, state_v_first=True, cu_seqlens=cu,
                  backend=backend(), **gating)
    with torch.no_grad():
        if ssm_state_indices is not None:
            per_token = ssm_state_indices.long()
            o, _ = torch_gdr.fused_recurrent_gated_delta_rule(*flat, initial_state=initial_state,
                                                              ssm_state_indices=per_token,
                                                              initial_state_indices=rows, **common)
        elif disable_state_update is None or disable_state_update:
            o, _ = torch_gdr.fused_recurrent_gated_delta_rule(*flat, initial_state=initial_state,
                                                              ssm_state_indices=rows, inplace_final_state=False,
                                                              **common)
        else:
            o, _ = torch_gdr.chunk_gated_delta_rule(*flat, initial_state=initial_state, initial_state_indices=rows,
                                                    final_state_indices=out_rows, **common)
        o = o.reshape(batch, tokens, *o.shape[2:]).masked_fill((rows < 0).view(-1, 1, 1, 1), 0)
        if output is not None:
            output.copy_(o)
            o = output
    return o, initial_state
