"""Stand-in for ``flashinfer.gdn_kernels.gdn_decode_bf16_state`` (tests only): FlashInfer's
bf16-state GDN decode over a state pool, served by torch_gdr's pool decode
(``fused_recurrent_gated_delta_rule`` with ``ssm_state_indices``, ``initial_state_indices``
and ``intermediate_states_buffer``, through :func:`flashinfer.gdn_decode.pool_decode`) and
``torch_gdr.fused_gdn_gating`` for the gates (``softplus_beta``, ``softplus_threshold``).

FlashInfer's contract, as its entry points state it at the recorded commit, mapped:

- pool ``initial_state_source [slots, HV, V, K]`` bf16 (value-first, any strides), rows read
  at ``initial_state_indices [B]`` (required) and the state after the kept tokens written to
  ``output_state_indices [B]`` (default: the read rows), in place, unless
  ``disable_state_update``. Like FlashInfer's kernel the state is carried in float32 across
  the T tokens and stored as bf16 (torch_gdr's bf16 pool: one rounding per store);
- ``intermediate_states_buffer [B, T', HV, V, K]`` bf16 (T' >= T, batch-scoped): the state
  after token t of sequence b at ``buffer[b, t]``;
- ``ssm_state_indices [B, T]`` int32 (FLA scatter): the state after token t to pool row
  ``ssm_state_indices[b, t]``; no final write to a read row, the final state to
  ``output_state_indices`` when those are given (split pool);
- ``accepted_steps [B]`` int32: sequence b keeps the state after ``accepted_steps[b] + 1``
  tokens (written to its output row; FLA scatter writes only those tokens' rows); with
  output and state update both on (FlashInfer's fused recovery + decode) the outputs of the
  later tokens continue from that state and the final state is not written;
- ``recovery_steps`` K > 0: the same with K kept tokens for every sequence;
- ``disable_output``: no output is written (a caller's ``output`` is left alone);
- outputs bf16 ``[B, T, HV, V]`` (fp16 operands converted, as FlashInfer's bf16-only
  kernels do); a negative read row (padding) gives a zero output and writes no row
  (FlashInfer's kernel reads and writes its null slot 0 instead; torch_gdr never writes a
  -1 row, by contract). FlashInfer's argument checks (its ``AssertionError`` s) are kept.

``gated_delta_rule_mtp_wide_vec`` (FlashInfer's wide-vector kernel, ``tile_v`` its tile
width, no effect on the result) skips the final write when a buffer is given, as FlashInfer
documents for it ("the final state is ``buffer[:, T-1]``"); ``gated_delta_rule_mtp`` writes it
(FlashInfer's ILP-4 kernel does; its wide-vector dispatch for large ``B * HV`` does not: the
tests read the pool only where both agree).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import torch_gdr

from ..gdn_decode import _as_bf16, pool_decode


def _check_common(q, k, v, b, pool, initial_state_indices, output, intermediate_states_buffer,
                  accepted_steps, ssm_state_indices, disable_state_update, recovery_steps) -> None:
    """FlashInfer's argument checks of its bf16-state MTP entry points (``AssertionError``)."""
    assert q is not None and k is not None and v is not None, "q, k and v are required"
    assert b is not None and pool is not None, "b and initial_state_source are required"
    assert output is None or output.dtype == torch.bfloat16, f"output must be bf16; got {output.dtype}"
    assert pool.dtype == torch.bfloat16, f"initial_state_source must be bf16, got {pool.dtype}"
    assert initial_state_indices is not None, "Pool mode is required: pass initial_state_indices"
    batch, tokens = q.shape[:2]
    assert 0 <= recovery_steps <= tokens, f"recovery_steps must be in [0, T={tokens}], got {recovery_steps}"
    if recovery_steps > 0:
        assert intermediate_states_buffer is None, "recovery_steps > 0 is incompatible with intermediate state caching"
        assert not disable_state_update, "recovery_steps > 0 requires state writeback (disable_state_update=False)"
    if intermediate_states_buffer is not None:
        assert intermediate_states_buffer.shape[0] == batch, (
            f"intermediate_states_buffer dim 0 ({intermediate_states_buffer.shape[0]}) must equal batch size "
            f"B={batch}; the buffer is batch-scoped, not pool-scoped")
        assert intermediate_states_buffer.shape[1] >= tokens, (
            f"intermediate_states_buffer dim 1 ({intermediate_states_buffer.shape[1]}) must be >= T={tokens}")
        assert intermediate_states_buffer.dtype == torch.bfloat16, "intermediate_states_buffer must be bf16"
    if accepted_steps is not None:
        assert tuple(accepted_steps.shape) == (batch,), (
            f"accepted_steps must have shape [B={batch}], got {tuple(accepted_steps.shape)}")
        assert accepted_steps.dtype == torch.int32, f"accepted_steps must be int32, got {accepted_steps.dtype}"
    if ssm_state_indices is not None:
        assert intermediate_states_buffer is None, (
            "ssm_state_indices and intermediate_states_buffer are mutually exclusive")
        assert not disable_state_update, "ssm_state_indices requires state writes; disable_state_update must be False"
        assert recovery_steps == 0, "ssm_state_indices + recovery_steps>0 not yet supported"
        assert tokens >= 2, f"ssm_state_indices requires T >= 2 (got T={tokens}); for T=1 use output_state_indices"
        assert tuple(ssm_state_indices.shape) == (batch, tokens), (
            f"ssm_state_indices must have shape [B={batch}, T={tokens}], got {tuple(ssm_state_indices.shape)}")
        assert ssm_state_indices.dtype == torch.int32, (
            f"ssm_state_indices must be int32, got {ssm_state_indices.dtype}")


def _mtp(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float,
         softplus_threshold: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
         pool: torch.Tensor, initial_state_indices: torch.Tensor, output_state_indices: Optional[torch.Tensor],
         buffer: Optional[torch.Tensor], accepted_steps: Optional[torch.Tensor],
         ssm_state_indices: Optional[torch.Tensor], disable_state_update: bool, use_qk_l2norm_in_kernel: bool,
         scale: Optional[float], output: Optional[torch.Tensor], disable_output: bool, recovery_steps: int,
         final_with_buffer: bool) -> torch.Tensor:
    """The bf16-state MTP step (arguments checked): which rows get which state, then one pool
    decode. ``final_with_buffer``: write the final state to the pool when a buffer is given."""
    q, k, v, a, b = _as_bf16(q, k, v, a, b)
    batch, tokens = q.shape[:2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    read = initial_state_indices.long()
    padding = read < 0
    same_pool = output_state_indices is None or output_state_indices is initial_state_indices
    write = read if output_state_indices is None else output_state_indices.long()
    # how many tokens' state each sequence keeps (its pool write, FLA scatter's last row)
    if accepted_steps is not None:
        kept = accepted_steps.long() + 1
    else:
        kept = torch.full((batch,), recovery_steps if recovery_steps > 0 else tokens, dtype=torch.long)
    kept = kept.to(q.device)
    steps = torch.arange(tokens, device=q.device)
    seq = torch.arange(batch, device=q.device)
    rows = torch.full((batch, tokens), -1, dtype=torch.long, device=q.device)
    if ssm_state_indices is not None:
        rows = torch.where(steps < kept.unsqueeze(1), ssm_state_indices.long(), rows)
    elif not disable_state_update and (buffer is None or final_with_buffer):
        rows[seq, kept - 1] = write
    rows.masked_fill_(padding.unsqueeze(1), -1)
    later = None
    if buffer is not None and accepted_steps is not None:  # the buffer rows of tokens not kept stay as they were
        later = buffer[:batch, :tokens].clone()
    g, beta = torch_gdr.fused_gdn_gating(A_log, a, b.float(), dt_bias, beta=softplus_beta,
                                         threshold=softplus_threshold)
    o = pool_decode(q, k, v, g, beta, pool, read, rows, scale=scale, use_qk_l2norm=use_qk_l2norm_in_kernel,
                    gating={}, buffer=buffer)
    if later is not None:
        not_kept = steps >= kept.unsqueeze(1)
        buffer[:batch, :tokens][not_kept] = later[not_kept]
    if ssm_state_indices is not None and not same_pool:
        # split pool: the kept state also to the output row (FlashInfer's final write)
        live = seq[~padding]
        with torch.no_grad():
            pool[write[live]] = pool[ssm_state_indices.long()[live, kept[live] - 1]]
    if disable_output:
        return output if output is not None else torch.zeros_like(o)
    if output is not None:
        output[~padding] = o[~padding]
        return output
    return o


def gated_delta_rule_mtp(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float = 1.0,
                         softplus_threshold: float = 20.0, q: Optional[torch.Tensor] = None,
                         k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                         b: Optional[torch.Tensor] = None, initial_state_source: Optional[torch.Tensor] = None,
                         initial_state_indices: Optional[torch.Tensor] = None,
                         output_state_indices: Optional[torch.Tensor] = None,
                         intermediate_states_buffer: Optional[torch.Tensor] = None,
                         accepted_steps: Optional[torch.Tensor] = None,
                         ssm_state_indices: Optional[torch.Tensor] = None, disable_state_update: bool = False,
                         use_qk_l2norm_in_kernel: bool = True, scale: Optional[float] = None,
                         output: Optional[torch.Tensor] = None, disable_output: bool = False,
                         recovery_steps: int = 0) -> torch.Tensor:
    """T tokens per sequence (q ``[B, T, H, K]``, a and b ``[B, T, HV]``, ``A_log`` and
    ``dt_bias`` ``[HV]``) over the bf16 pool; returns o ``[B, T, HV, V]`` bf16 (see the
    module's docstring for each argument)."""
    _check_common(q, k, v, b, initial_state_source, initial_state_indices, output, intermediate_states_buffer,
                  accepted_steps, ssm_state_indices, disable_state_update, recovery_steps)
    return _mtp(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
                initial_state_indices, output_state_indices, intermediate_states_buffer, accepted_steps,
                ssm_state_indices, disable_state_update, use_qk_l2norm_in_kernel, scale, output, disable_output,
                recovery_steps, final_with_buffer=True)


def gated_delta_rule_mtp_wide_vec(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor,
                                  softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
                                  q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None,
                                  v: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
                                  initial_state_source: Optional[torch.Tensor] = None,
                                  initial_state_indices: Optional[torch.Tensor] = None,
                                  output_state_indices: Optional[torch.Tensor] = None,
                                  intermediate_states_buffer: Optional[torch.Tensor] = None,
                                  accepted_steps: Optional[torch.Tensor] = None,
                                  ssm_state_indices: Optional[torch.Tensor] = None,
                                  disable_state_update: bool = False, use_qk_l2norm_in_kernel: bool = True,
                                  scale: Optional[float] = None, output: Optional[torch.Tensor] = None,
                                  tile_v: int = 128, disable_output: bool = False,
                                  recovery_steps: int = 0) -> torch.Tensor:
    """FlashInfer's wide-vector MTP kernel: :func:`gated_delta_rule_mtp`'s contract, ``tile_v``
    (32, 64 or 128) its tile width, and no final pool write when a buffer is given."""
    assert tile_v in (32, 64, 128), f"tile_v must be 32/64/128, got {tile_v}"
    _check_common(q, k, v, b, initial_state_source, initial_state_indices, output, intermediate_states_buffer,
                  accepted_steps, ssm_state_indices, disable_state_update, recovery_steps)
    return _mtp(A_log, a, dt_bias, softplus_beta, softplus_threshold, q, k, v, b, initial_state_source,
                initial_state_indices, output_state_indices, intermediate_states_buffer, accepted_steps,
                ssm_state_indices, disable_state_update, use_qk_l2norm_in_kernel, scale, output, disable_output,
                recovery_steps, final_with_buffer=False)


def gated_delta_rule(A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float = 1.0,
                     softplus_threshold: float = 20.0, q: Optional[torch.Tensor] = None,
                     k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                     b: Optional[torch.Tensor] = None, initial_state_source: Optional[torch.Tensor] = None,
                     initial_state_indices: Optional[torch.Tensor] = None,
                     output_state_indices: Optional[torch.Tensor] = None, output: Optional[torch.Tensor] = None,
                     use_qk_l2norm_in_kernel: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """One token per sequence (q ``[B, 1, H, K]``): the state read at
    ``initial_state_indices`` and written at ``output_state_indices`` (default: the same rows);
    returns o ``[B, 1, HV, V]`` bf16."""
    assert q is not None and q.shape[1] == 1, f"This kernel only supports T=1, got T={None if q is None else q.shape[1]}"
    return gated_delta_rule_mtp(A_log, a, dt_bias, softplus_beta, softplus_threshold, q=q, k=k, v=v, b=b,
                                initial_state_source=initial_state_source,
                                initial_state_indices=initial_state_indices,
                                output_state_indices=output_state_indices, output=output,
                                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, scale=scale)


# FlashInfer's backward-compatible names
gated_delta_rule_bf16state_cooprow = gated_delta_rule
gated_delta_rule_bf16state_cooprow_mtp = gated_delta_rule_mtp
