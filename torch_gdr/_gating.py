"""fla's in-kernel activations of the gate and of beta, as one differentiable torch step.

fla-core 0.6 lets a caller pass the raw gate and the raw beta and have the kernels apply
the activations (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``,
``allow_neg_eigval``). torch_gdr applies them here, before dispatch, so every backend serves
them and autograd carries the gradients back to the raw gate ``a``, ``A_log``, ``dt_bias``
and the beta logits::

    g    = -exp(A_log) * softplus(a + dt_bias)       (use_gate_in_kernel; dt_bias optional)
    beta = s * sigmoid(beta_logits)                  (use_beta_sigmoid_in_kernel; s = 2 with
                                                      allow_neg_eigval, else 1)

As fla does, both are computed in float32 (float64 when an input is float64, so the float64
definition stays exact), whatever the inputs' dtype, with torch's softplus (threshold 20,
the threshold of fla's kernels). The results are float32 (float64) tensors the backends read
as any g and beta.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def _check_head_param(name: str, param: object, num_v_heads: int, device: torch.device) -> None:
    """A per-value-head parameter: a floating tensor of shape ``[HV]`` on ``device``."""
    if not isinstance(param, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape [HV] = [{num_v_heads}], got "
                        f"{type(param).__name__}")
    if param.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), got {param.dtype}")
    if list(param.shape) != [num_v_heads]:
        raise ValueError(f"{name}: expected shape [HV] = [{num_v_heads}] (one value per value head), got "
                         f"{list(param.shape)}")
    if param.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {param.device}")


def check_gating(num_v_heads: int, device: torch.device, *, use_gate_in_kernel: bool, A_log: Optional[Tensor],
                 dt_bias: Optional[Tensor], use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    """Check the activation arguments of a call with ``HV = num_v_heads`` value heads on
    ``device``; ``ValueError``/``TypeError`` naming the argument.

    Conflicts refused (fla ignores the first two silently; here they would hide a caller's
    mistake): ``A_log`` or ``dt_bias`` without ``use_gate_in_kernel``; ``use_gate_in_kernel``
    without ``A_log``; ``allow_neg_eigval`` without ``use_beta_sigmoid_in_kernel`` (fla's rule).
    """
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel),
                       ("allow_neg_eigval", allow_neg_eigval)):
        _check_flag(name, flag)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True (g is then the raw gate, and "
                             "g = -exp(A_log) * softplus(g + dt_bias)), got None")
        _check_head_param("A_log", A_log, num_v_heads, device)
        if dt_bias is not None:
            _check_head_param("dt_bias", dt_bias, num_v_heads, device)
    else:
        for name, param in (("A_log", A_log), ("dt_bias", dt_bias)):
            if param is not None:
                raise ValueError(f"{name}: only used with use_gate_in_kernel=True (g is then the raw gate), got a "
                                 f"tensor with use_gate_in_kernel=False; pass use_gate_in_kernel=True, or the "
                                 f"activated g and no {name}")
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires use_beta_sigmoid_in_kernel=True (beta = 2 * sigmoid(beta) "
                         "then), got use_beta_sigmoid_in_kernel=False; scale an activated beta yourself instead")


def gating_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    """float64 when one of ``tensors`` is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def gdn_gate(a: Tensor, A_log: Tensor, dt_bias: Optional[Tensor] = None) -> Tensor:
    """``-exp(A_log) * softplus(a + dt_bias)``: raw gate ``a [..., HV]`` (any float dtype),
    ``A_log``, ``dt_bias [HV]``; returns the log decay ``[..., HV]`` in float32 (float64 when
    an input is float64), differentiable in all three."""
    dtype = gating_dtype(a, A_log, dt_bias)
    x = a.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype)
    return -A_log.to(dtype).exp() * F.softplus(x)


def beta_sigmoid(beta_logits: Tensor, allow_neg_eigval: bool = False) -> Tensor:
    """``s * sigmoid(beta_logits)`` with ``s = 2`` for ``allow_neg_eigval`` (range [0, 2]),
    else 1; float32 (float64 for float64 logits), shape of ``beta_logits``."""
    beta = beta_logits.to(gating_dtype(beta_logits)).sigmoid()
    return beta * 2.0 if allow_neg_eigval else beta


def apply_gating(g: Tensor, beta: Tensor, *, use_gate_in_kernel: bool, A_log: Optional[Tensor],
                 dt_bias: Optional[Tensor], use_beta_sigmoid_in_kernel: bool,
                 allow_neg_eigval: bool) -> tuple[Tensor, Tensor]:
    """The g and beta a backend reads, from a checked call's (:func:`check_gating`): each
    activated where its flag asks, else returned as given."""
    if use_gate_in_kernel:
        assert A_log is not None
        g = gdn_gate(g, A_log, dt_bias)
    if use_beta_sigmoid_in_kernel:
        beta = beta_sigmoid(beta, allow_neg_eigval)
    return g, beta
