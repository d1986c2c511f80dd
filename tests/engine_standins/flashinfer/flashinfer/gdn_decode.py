"""Stand-in for ``flashinfer.gdn_decode`` (tests only): FlashInfer's pretransposed GDN decode
served by ``torch_gdr.fused_recurrent_gated_delta_rule`` over a pool.

States value-first ``[B or pool, HV, V, K]`` (``state_v_first=True``), updated in place;
the gate and beta activations in the kernel (``use_gate_in_kernel``); ``initial_state`` with
``initial_state_indices`` is a pool read and written at those rows (any row stride). A -1
index gives a zero output (FlashInfer's float32 path; issue 36 item 8: torch_gdr itself
returns the zero state's output). ``output_state_indices`` (a decode that reads one row and
writes another) go to torch_gdr's ``initial_state_indices`` (read rows) and
``ssm_state_indices`` (written rows). ``gated_delta_rule_mtp``'s ``intermediate_states_buffer``
goes to torch_gdr's buffer of the same name (issue 36 item 3). :func:`pool_decode` (one pool
decode of B sequences of T tokens) also serves the ``flashinfer.gdn_kernels`` stand-ins.
"""

from __future__ import annotations

from typing import Optional

import torch

import torch_gdr

from engine_standins_backend import backend


def _as_bf16(*xs: torch.Tensor) -> list[torch.Tensor]:
    """FlashInfer's decode kernels take bf16 operands: fp16 q, k, v, a, b are converted
    (values, not bits), the output stored as bf16 and cast to q's dtype by the caller."""
    return [x.to(torch.bfloat16) if x.dtype == torch.float16 else x for x in xs]


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
    io_dtype = q.dtype
    q, k, v, a, b = _as_bf16(q, k, v, a, b)
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
        o = o.masked_fill((rows < 0).view(-1, 1, 1, 1), 0).to(io_dtype)
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
    """T tokens per sequence (q ``[B, T, H, K]``) from pool row ``initial_state_indices[b]``
    (value-first pool; a negative row: padding, nothing written, its output rows zero or, with
    ``output``, left as the caller's), through torch_gdr's pool decode
    (``fused_recurrent_gated_delta_rule``, ``initial_state_indices`` the start rows):

    - ``ssm_state_indices [B, T]`` (FlashInfer's FLA scatter): the state after token t to row
      ``ssm_state_indices[b, t]`` (unless ``disable_state_update=True``);
    - otherwise the final state to row ``output_state_indices[b]`` (default: the read row)
      unless ``disable_state_update`` (FlashInfer's default: True; with a buffer torch_gdr's
      ``disable_state_update``, without one no row to write: the plain pool step);
    - ``intermediate_states_buffer [B', T', HV, V, K]``: the state after token t of sequence b
      at ``buffer[b, t]``, written in place by torch_gdr (``intermediate_state_indices = b``;
      issue 36 item 3). fp16 operands are converted to bf16 (FlashInfer's kernels are bf16
      inside). torch_gdr writes a padding sequence's zero-state run too: the stand-in
      puts back those buffer rows, which FlashInfer leaves alone.
    """
    rows = initial_state_indices.long()
    padding = rows < 0
    batch, tokens = q.shape[:2]
    io_dtype = q.dtype
    q, k, v, a, b = _as_bf16(q, k, v, a, b)
    disable = bool(disable_state_update is None or disable_state_update)
    if ssm_state_indices is not None:
        per_token, disable = ssm_state_indices.long(), bool(disable_state_update)
    else:
        out_rows = rows if output_state_indices is None else output_state_indices.long().masked_fill(padding, -1)
        per_token = torch.full((batch, tokens), -1, dtype=torch.long, device=q.device)
        if intermediate_states_buffer is None and disable:
            disable = False  # no row to write: the plain pool step (torch_gdr's flag would add a scratch buffer)
        else:
            per_token[:, -1] = out_rows
    o = pool_decode(q, k, v, a, b, initial_state, rows, per_token, scale=scale, use_qk_l2norm=use_qk_l2norm,
                    gating=dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                use_beta_sigmoid_in_kernel=True),
                    buffer=intermediate_states_buffer, disable_state_update=disable).to(io_dtype)
    if output is not None:
        output[~padding] = o[~padding].to(output.dtype)
        o = output
    return o, initial_state


def pool_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                pool: torch.Tensor, read_rows: torch.Tensor, write_rows: torch.Tensor, *, scale: Optional[float],
                use_qk_l2norm: bool, gating: dict, buffer: Optional[torch.Tensor] = None,
                disable_state_update: bool = False) -> torch.Tensor:
    """B sequences of T tokens each through torch_gdr's pool decode, the stand-ins' one call
    for FlashInfer's MTP entry points (this module's and ``gdn_kernels``'): q, k ``[B, T, H,
    K]``, v ``[B, T, HV, V]``, g and beta ``[B, T, HV]`` (raw gate and beta logits with
    ``gating`` torch_gdr's in-kernel activation arguments, or log-decay and beta with
    ``gating={}``); ``pool`` value-first ``[slots, HV, V, K]`` (any strides); sequence n starts
    from row ``read_rows[n]`` (a negative row: padding, a zero start state) and the state after
    its token t goes to row ``write_rows[n, t]`` (-1: none), in place; ``buffer [B', T', HV, V,
    K]`` receives the state after token t of sequence n at ``buffer[n, t]`` (torch_gdr's
    ``intermediate_states_buffer``; a padding sequence's rows are put back as they were,
    FlashInfer leaves them alone). Returns o ``[B, T, HV, V]`` in q's dtype, zero rows for
    padding sequences."""
    padding = read_rows < 0
    batch, tokens = q.shape[:2]
    flat = [x.reshape(1, batch * tokens, *x.shape[2:]) for x in (q, k, v, g, beta)]
    cu = torch.arange(batch + 1, device=q.device) * tokens
    serving: dict = {}
    kept = None
    if buffer is not None:
        serving = dict(intermediate_states_buffer=buffer,
                       intermediate_state_indices=torch.arange(batch, device=q.device))
        if bool(padding.any()):
            kept = buffer[:batch][padding].clone()
    with torch.no_grad():
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            *flat, scale=scale, initial_state=pool, ssm_state_indices=write_rows, initial_state_indices=read_rows,
            disable_state_update=disable_state_update, use_qk_l2norm_in_kernel=use_qk_l2norm, state_v_first=True,
            cu_seqlens=cu, backend=backend(), **gating, **serving)
        if kept is not None:
            buffer[:batch][padding] = kept
    return o.reshape(batch, tokens, *o.shape[2:]).masked_fill(padding.view(-1, 1, 1, 1), 0)
