"""The ``"cpu"`` backend's step with the final state written in place (``inplace_final_state``).

The fused pool kernel (:mod:`.pool`) already reads a sequence's state from a row and writes
the state after a token to a row, in place, straight into a float32 key-first row (through a
float32 buffer for half and value-first rows). The caller's state batch ``[N, HV, K, V]`` is
such a pool with ``N`` rows: sequence n starts from row n and only its last token's state is
written back, to row n (the rows of its earlier tokens are -1: not written). So the step
allocates ``o`` and a few index words, never a state.

``gdr::_cpu_step_inplace`` wraps it as an op that mutates ``state`` and returns ``o``, with a
fake, so a ``torch.compile(fullgraph=True)`` graph holds the step as one node.
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._gating import Gating, gating_of
from torch_gdr._inplace import row_view
from torch_gdr._layout import GdrCall
from torch_gdr.ops.cpu import _build
from torch_gdr.ops.cpu.kernels import _gating_args, _token_view

Tensor = torch.Tensor

_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) state, "
           "bool use_qk_l2norm_in_kernel, Tensor? cu_seqlens, bool state_v_first, bool use_gate_in_kernel=False, "
           "Tensor? A_log=None, Tensor? dt_bias=None, bool use_beta_sigmoid_in_kernel=False, "
           "bool allow_neg_eigval=False) -> Tensor")


def _rows(num_seqs: int, lengths: Optional[list[int]], seq_len: int) -> tuple[Tensor, Tensor]:
    """The pool indices ``[N, width]`` and start rows ``[N]`` that make sequence n read and
    write row n, its earlier tokens' states unwritten."""
    rows = torch.arange(num_seqs, dtype=torch.int64)
    if lengths is None and seq_len == 1:
        return rows.unsqueeze(1), rows
    if lengths is None:
        lengths = [seq_len] * num_seqs
    width = max(1, max(lengths, default=1))
    indices = torch.full((num_seqs, width), -1, dtype=torch.int64)
    last = torch.tensor([max(n - 1, 0) for n in lengths], dtype=torch.int64)
    indices.scatter_(1, last.unsqueeze(1), rows.unsqueeze(1))
    return indices, rows


def _step_inplace(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, state: Tensor,
                  use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[Tensor], state_v_first: bool,
                  use_gate_in_kernel: bool = False, A_log: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                  use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False) -> Tensor:
    """The step on canonical tokens (q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta
    ``[B, T, HV]``, one dtype for q, k, v) from ``state`` (``[N, HV, K, V]``, value-first with
    ``state_v_first``; float32/float16/bfloat16, pool-row layout), which receives the final
    state; returns ``o`` in v's shape and dtype."""
    ext = _build.load()
    if ext is None:
        raise RuntimeError(f"torch_gdr: the fused CPU kernels are unavailable ({_build.unavailable_reason()})")
    dtype = v.dtype
    cu = None if cu_seqlens is None else cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    lengths = None if cu is None else (cu[1:] - cu[:-1]).tolist()
    indices, start_rows = _rows(state.shape[0], lengths, v.shape[1])
    gating = Gating(use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o = ext.pool_recurrent_fwd(_token_view(q, dtype), _token_view(k, dtype), _token_view(v, dtype),
                               _token_view(g, torch.float32), _token_view(beta, torch.float32), float(scale), row_view(state), indices, start_rows,
                               bool(use_qk_l2norm_in_kernel), cu, bool(state_v_first), *_gating_args(gating),
                               None, True, None, None)
    return o.reshape(v.shape)


cpu_step_inplace_op = torch.library.custom_op("gdr::_cpu_step_inplace", _step_inplace, mutates_args=("state",),
                                              schema=_SCHEMA)


@cpu_step_inplace_op.register_fake
def _fake(q, k, v, g, beta, scale, state, use_qk_l2norm_in_kernel, cu_seqlens, state_v_first,
          use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
          allow_neg_eigval=False):
    return v.new_empty(v.shape)


def cpu_step_inplace(call: GdrCall, state: Tensor) -> Tensor:
    """The ``step_inplace`` entry of the ``"cpu"`` backend: ``call`` (canonical, raw g and
    beta with its activation arguments), ``state`` the caller's ``initial_state`` (public
    layout, checked by :mod:`torch_gdr._inplace`); returns ``o``."""
    # eager: the op's body directly (the custom op's Python dispatch costs more than a decode
    # step's kernel at small batches); traced: the op, so Dynamo sees its fake and mutation
    step = cpu_step_inplace_op if torch.compiler.is_compiling() else _step_inplace
    return step(call.q, call.k, call.v, call.g, call.beta, call.scale, state, call.use_qk_l2norm,
                call.cu_seqlens, call.state_v_first, *gating_of(call))
