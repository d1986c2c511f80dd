"""fla.ops.gated_delta_rule of the stand-in: fla-core 0.6's two functions, with its
positional order, served by torch_gdr's public functions (keyword arguments pass through)."""

from __future__ import annotations

from typing import Any, Optional

import torch

import torch_gdr

Tensor = torch.Tensor


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: Optional[float] = None,
                           initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: Optional[Tensor] = None, cu_seqlens_cpu: Optional[Tensor] = None,
                           chunk_indices: Optional[Tensor] = None, cp_context: Any = None, **kwargs: Any):
    """fla's ``chunk_gated_delta_rule``; ``use_gate_in_kernel``, ``A_log``, ``dt_bias``,
    ``chunk_size`` and ``transpose_state_layout`` come in ``kwargs`` as in fla."""
    if cp_context is not None:
        raise NotImplementedError("cp_context: fla's context takes another form than torch_gdr's CPContext")
    return torch_gdr.chunk_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, **kwargs)


def fused_recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor] = None,
                                     gk: Optional[Tensor] = None, gv: Optional[Tensor] = None,
                                     beta: Optional[Tensor] = None, scale: Optional[float] = None,
                                     initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: Optional[Tensor] = None,
                                     **kwargs: Any):
    """fla's ``fused_recurrent_gated_delta_rule`` (``transpose_state_layout`` in ``kwargs``)."""
    return torch_gdr.fused_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, gk=gk, gv=gv, **kwargs)


chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule
