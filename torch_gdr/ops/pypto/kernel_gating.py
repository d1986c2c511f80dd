"""fla's gate and beta activations as PyPTO tile operations, shared by the kernels.

The chunked forward (:mod:`.kernel`), the chunked backward (:mod:`.kernel_bwd`) and the
decode step (:mod:`.kernel_decode`) apply the activations of :mod:`torch_gdr._gating`
on chip, to fp32 tiles of any shape (the rows broadcast where a per-head parameter meets
a tile of tokens)::

    g    = rate * softplus(a + dt_bias),  rate = -exp(A_log)
    beta = s * sigmoid(b),                s = 2 with allow_neg_eigval, else 1

with softplus(x) = x above :data:`SOFTPLUS_THRESHOLD` (torch's and fla's threshold), else
``log1p(exp(x))``; and for the backward their derivatives::

    dg/da        = rate * sigmoid(x)      (rate above the threshold)
    dbeta/db     = s * sigmoid(b) (1 - sigmoid(b))

The kernels read A_log and dt_bias as one ``gate_params [2, HV]`` fp32 input (A_log in row
0, dt_bias in row 1, zeros without one): :func:`gate_params`. A tail chunk fills its raw
gate and beta logits past its valid rows with ``-inf`` (:data:`RAW_FILL`): both
activations of ``-inf`` are exactly 0, so the padded rows do nothing, as the zeros of an
activated input do.
"""

# No `from __future__ import annotations`: kept like the kernels' modules.

from typing import Any, Optional

import torch

from torch_gdr._gating import SOFTPLUS_THRESHOLD

from ._env import import_pypto

#: What a tail chunk's raw gate and beta logits are filled with past its valid rows
#: (pypto's fillpad takes 0, inf or -inf): softplus(-inf + dt_bias) = 0 and sigmoid(-inf) = 0.
RAW_FILL = "-inf"


def gate_params(A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], num_v_heads: int,
                device: torch.device) -> torch.Tensor:
    """The kernels' ``gate_params`` input, ``[2, HV]`` fp32 contiguous: ``A_log [HV]`` in row
    0, ``dt_bias [HV]`` in row 1 (zeros where None; A_log zeros where None too, for a call
    that activates beta only)."""
    out = torch.zeros(2, num_v_heads, dtype=torch.float32, device=device)
    if A_log is not None:
        out[0] = A_log.to(device=device, dtype=torch.float32)
    if dt_bias is not None:
        out[1] = dt_bias.to(device=device, dtype=torch.float32)
    return out


def gate_rate(a_log: Any) -> Any:
    """``-exp(A_log)``, a tile of any shape."""
    return import_pypto().exp(a_log) * -1.0


def softplus(x: Any) -> Any:
    """``softplus(x)`` with torch's threshold: ``x`` above it, else ``log1p(exp(x))``."""
    pypto = import_pypto()
    return pypto.where(x > SOFTPLUS_THRESHOLD, x, pypto.log1p(pypto.exp(x)))


def log_decay(raw_gate: Any, rate: Any, bias: Any) -> Any:
    """The log decay ``rate * softplus(raw_gate + bias)`` (``rate``: :func:`gate_rate`;
    ``rate`` and ``bias`` of ``raw_gate``'s shape)."""
    return rate * softplus(raw_gate + bias)


def softplus_slope(x: Any) -> Any:
    """``softplus'(x)``: ``sigmoid(x)``, 1 above the threshold (as torch's softplus backward)."""
    pypto = import_pypto()
    return pypto.where(x > SOFTPLUS_THRESHOLD, 1.0, pypto.sigmoid(x))


def activated_beta(logits: Any, allow_neg_eigval: bool) -> Any:
    """``s * sigmoid(logits)``, ``s = 2`` with ``allow_neg_eigval``."""
    beta = import_pypto().sigmoid(logits)
    return beta * 2.0 if allow_neg_eigval else beta


def beta_and_slope(logits: Any, allow_neg_eigval: bool) -> tuple[Any, Any]:
    """``(beta, d beta / d logits)``: ``s * sigmoid(logits)`` and ``s * sigmoid(logits) *
    (1 - sigmoid(logits))`` from one sigmoid (two, one for each, make pypto 0.2.0's cost
    model fail to simulate the backward kernel at T = 1024, HV = 4: ParseInput BuildFunction)."""
    sig = import_pypto().sigmoid(logits)
    slope = sig - sig * sig
    return (sig * 2.0, slope * 2.0) if allow_neg_eigval else (sig, slope)
