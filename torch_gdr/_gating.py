"""fla's in-kernel activations of the gate and of beta, as one differentiable torch step.

fla-core 0.6 lets a caller pass the raw gate and the raw beta and have the kernels apply
the activations (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``,
``allow_neg_eigval``). torch_gdr applies them here, before dispatch, so every backend serves
them and autograd carries the gradients back to the raw gate ``a``, ``A_log``, ``dt_bias``
and the beta logits::

    g    = -exp(A_log) * softplus(a + dt_bias)       (use_gate_in_kernel; dt_bias optional)
    beta = s * sigmoid(beta_logits)                  (use_beta_sigmoid_in_kernel; s = 2 with
                                                      allow_neg_eigval, else 1)

The raw tensors travel through dispatch into the ops (their schemas carry the flags and
``A_log``/``dt_bias``): the ``"cpu"`` kernels and the ``"pypto"`` kernels compute both
activations inside, where they read g and beta, and their gradients inside the backward.
This module holds the checks and the one pure-torch version every other backend uses:
:func:`activate_call` before the backend's forward, :func:`gating_backward` (the chain
rule, written out) after its backward, and the differentiable :func:`gdn_gate` /
:func:`beta_sigmoid` for the steps in plain torch.

As fla does, both are computed in float32 (float64 when an input is float64, so the float64
definition stays exact), whatever the inputs' dtype, with torch's softplus (threshold 20,
the threshold of fla's kernels; above it softplus(x) = x and its derivative is 1). The
results are float32 (float64) tensors the backends read as any g and beta.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch_gdr._layout import GdrCall

Tensor = torch.Tensor

#: torch's (and fla's) softplus threshold: softplus(x) = x above it.
SOFTPLUS_THRESHOLD = 20.0

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Gating(NamedTuple):
    """fla's activation arguments of one call (checked by :func:`check_gating`)."""

    use_gate_in_kernel: bool = False
    A_log: Optional[Tensor] = None
    dt_bias: Optional[Tensor] = None
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False

    @property
    def gated(self) -> bool:
        """g or beta are raw: an activation applies to one of them."""
        return self.use_gate_in_kernel or self.use_beta_sigmoid_in_kernel


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


def gating_of(call: "GdrCall") -> Gating:
    """fla's activation arguments of ``call``, as kernels that apply them take them."""
    return Gating(call.use_gate_in_kernel, call.A_log, call.dt_bias, call.use_beta_sigmoid_in_kernel,
                  call.allow_neg_eigval)


def activate_call(call: "GdrCall") -> "GdrCall":
    """``call`` with its g and beta activated where its flags ask (:func:`apply_gating`) and
    the flags cleared: the call a backend without in-kernel activations computes. Plain
    differentiable torch; returns ``call`` itself when no flag is set."""
    if not call.gated:
        return call
    g, beta = apply_gating(call.g, call.beta, use_gate_in_kernel=call.use_gate_in_kernel, A_log=call.A_log,
                           dt_bias=call.dt_bias, use_beta_sigmoid_in_kernel=call.use_beta_sigmoid_in_kernel,
                           allow_neg_eigval=call.allow_neg_eigval)
    return dataclasses.replace(call, g=g, beta=beta, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                               use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)


def gating_backward(call: "GdrCall", dg: Tensor, dbeta: Tensor
                    ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """The chain rule through the activations of ``call`` (raw g and beta, canonical layout
    ``[B, T, HV]``), from the gradients ``dg``, ``dbeta`` on the activated g and beta.

    With ``x = a + dt_bias``, ``g = -exp(A_log) softplus(x)``::

        da = dg * (-exp(A_log) * sigmoid(x))    (sigmoid(x) taken as 1 above the threshold)
        dA_log[h] = sum over tokens of dg * g,  ddt_bias[h] = sum over tokens of da
        dbeta_logits = dbeta * s * sigmoid(b) * (1 - sigmoid(b))

    Returns ``(da, dbeta_logits, dA_log, ddt_bias)``: da and dbeta in the dtypes of the raw g
    and beta (each as given where its flag is off), dA_log/ddt_bias ``[HV]`` in the dtypes of
    ``A_log``/``dt_bias``, or None where absent.
    """
    d_a_log = d_dt_bias = None
    if call.use_gate_in_kernel:
        assert call.A_log is not None
        dtype = gating_dtype(call.g, call.A_log, call.dt_bias)
        x = call.g.to(dtype)
        if call.dt_bias is not None:
            x = x + call.dt_bias.to(dtype)
        rate = call.A_log.to(dtype).exp()
        slope = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
        dg_ = dg.to(dtype)
        gate = -rate * torch.nn.functional.softplus(x)
        d_a = -dg_ * rate * slope
        lead = tuple(range(d_a.dim() - 1))
        d_a_log = (dg_ * gate).sum(lead).to(call.A_log.dtype)
        if call.dt_bias is not None:
            d_dt_bias = d_a.sum(lead).to(call.dt_bias.dtype)
        dg = d_a.to(call.g.dtype)
    if call.use_beta_sigmoid_in_kernel:
        dtype = gating_dtype(call.beta)
        sig = call.beta.to(dtype).sigmoid()
        slope = sig * (1.0 - sig) * (2.0 if call.allow_neg_eigval else 1.0)
        dbeta = (dbeta.to(dtype) * slope).to(call.beta.dtype)
    return dg, dbeta, d_a_log, d_dt_bias


def _check_gdn_gating_args(A_log: object, a: object, b: object, dt_bias: object, beta: object,
                           threshold: object) -> None:
    """The checks of :func:`fused_gdn_gating`; ``TypeError``/``ValueError`` naming the argument."""
    for name, t in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), "
                            f"got {t.dtype}")
    assert isinstance(a, Tensor) and isinstance(b, Tensor)
    assert isinstance(A_log, Tensor) and isinstance(dt_bias, Tensor)
    if a.dim() not in (2, 3):
        raise ValueError(f"a: expected shape [T, HV] (vLLM's) or [B, T, HV], got {list(a.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"b: expected the shape of a, {list(a.shape)}, got {list(b.shape)}")
    num_heads = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if list(t.shape) != [num_heads]:
            raise ValueError(f"{name}: expected shape [HV] = [{num_heads}] (the last dim of a), got {list(t.shape)}")
    for name, t in (("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if t.device != a.device:
            raise ValueError(f"{name}: expected a tensor on {a.device} (the device of a), got one on {t.device}")
    for name, value in (("beta", beta), ("threshold", threshold)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name}: expected a finite float, got {value!r}")
    if beta <= 0:  # type: ignore[operator]
        raise ValueError(f"beta: expected a positive float (softplus(x) = log(1 + exp(beta * x)) / beta), "
                         f"got {beta!r}")


def fused_gdn_gating(A_log: Tensor, a: Tensor, b: Tensor, dt_bias: Tensor, beta: float = 1.0,
                     threshold: float = 20.0) -> tuple[Tensor, Tensor]:
    """Gated DeltaNet's gate and beta activations, with vLLM's and SGLang's signature::

        g           = -exp(A_log) * softplus(a + dt_bias, beta, threshold)
        beta_output = sigmoid(b)

    where ``softplus(x, beta, threshold) = log(1 + exp(beta * x)) / beta``, and ``x`` where
    ``beta * x > threshold`` (torch's :func:`torch.nn.functional.softplus`; the ``beta`` here is
    softplus's sharpness, not the delta rule's beta).

    Shapes: ``a``, ``b`` ``[T, HV]`` (vLLM's: one row per token) or ``[B, T, HV]``;
    ``A_log``, ``dt_bias`` ``[HV]``; any floating dtypes, one device. Returns ``(g,
    beta_output)``, both ``[1, T, HV]`` for 2-D inputs (as vLLM's, ready for the ops'
    ``[B, T, HV]``), else ``[B, T, HV]``. ``g`` is float32 (float64 when an input is float64);
    ``beta_output`` has the dtype of ``b``, computed in float32 (float64) and rounded once.
    Plain torch: differentiable in ``A_log``, ``a``, ``b`` and ``dt_bias``, and traceable by
    ``torch.compile(fullgraph=True)``. Engines compute the two once per layer step and pass
    them to both :func:`torch_gdr.chunk_gated_delta_rule` and
    :func:`torch_gdr.fused_recurrent_gated_delta_rule`.
    """
    _check_gdn_gating_args(A_log, a, b, dt_bias, beta, threshold)
    dtype = gating_dtype(a, A_log, dt_bias)
    x = a.to(dtype) + dt_bias.to(dtype)
    g = -A_log.to(dtype).exp() * F.softplus(x, beta=float(beta), threshold=float(threshold))
    beta_output = b.to(gating_dtype(b)).sigmoid().to(b.dtype)
    if a.dim() == 2:
        g, beta_output = g.unsqueeze(0), beta_output.unsqueeze(0)
    return g, beta_output
