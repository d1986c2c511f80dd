"""The ``"pypto"`` backend's step with the final state written in place (``inplace_final_state``).

The caller's state batch ``[N, HV, K, V]`` is run as a pool of N rows through the PyPTO
decode kernel (:func:`torch_gdr.ops.pypto.decode.pypto_pool_step`): sequence n reads row n and
only its last token's state is written, to row n (its earlier tokens' rows are -1). Calls
with more tokens per sequence than that kernel takes (``spec.MAX_STEP_TOKENS``) run the
chunked step and copy the new state in.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._gating import Gating
from torch_gdr._layout import GdrCall
from torch_gdr.ops.pypto import spec
from torch_gdr.ops.pypto.decode import pypto_pool_step

Tensor = torch.Tensor


def identity_rows(num_seqs: int, lengths: list[int], device: torch.device) -> tuple[Tensor, Optional[Tensor]]:
    """vLLM's ``ssm_state_indices`` (``[N]``, or ``[N, S]`` with S the longest sequence) and
    ``num_accepted_tokens`` (None, or ``[N]``) that make sequence n read row n and write its
    last token's state to row n, nothing else."""
    rows = torch.arange(num_seqs, dtype=torch.int64, device=device)
    width = max(lengths, default=1)
    if width <= 1:
        return rows, None
    last = torch.tensor([max(n, 1) - 1 for n in lengths], dtype=torch.int64, device=device)
    indices = torch.full((num_seqs, width), -1, dtype=torch.int64, device=device)
    indices.scatter_(1, last.unsqueeze(1), rows.unsqueeze(1))
    return indices, last + 1


def pypto_step_inplace(call: GdrCall, state: Tensor) -> Tensor:
    """The ``step_inplace`` entry: ``call`` (canonical, raw g and beta with its activation
    arguments), ``state`` the caller's ``initial_state`` (public layout, checked by
    :mod:`torch_gdr._inplace`); returns ``o`` (canonical layout)."""
    lengths = call.seq_lens
    if max(lengths, default=0) > spec.MAX_STEP_TOKENS:
        from torch_gdr.ops.pypto.op import pypto_step

        o, final_state = pypto_step(call)
        state.copy_(call.public_state(final_state))
        return o
    indices, accepted = identity_rows(call.num_seqs, lengths, call.q.device)
    gating = Gating(call.use_gate_in_kernel, call.A_log, call.dt_bias, call.use_beta_sigmoid_in_kernel,
                    call.allow_neg_eigval)
    return pypto_pool_step(call.q, call.k, call.v, call.g, call.beta, call.scale, state, indices, accepted,
                           cu_seqlens=call.cu_seqlens, use_qk_l2norm_in_kernel=call.use_qk_l2norm,
                           state_v_first=call.state_v_first, validate=False, gating=gating)
