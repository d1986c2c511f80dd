"""``torch.compile(fullgraph=True)`` of calls where the default backend is passed over (float64
inputs, a step that needs a backward, the layer's eval calls with grad enabled) and of a
named backend that cannot serve a call: selection, its reasons and its fallback warning run
while Dynamo traces. Each compiled result is checked against eager and against the float64
recurrence (:mod:`torch_gdr.ref`).

Shapes are tiny and every compile is static (``dynamic=False``) with the ``eager`` or
``aot_eager`` backend: what is tested is the trace, not inductor's code.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import torch_gdr
from torch_gdr import _fallback
from torch_gdr.dispatch import CpuFallbackWarning, FlaBackendError
from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache
from torch_gdr.ops.cpu import kernels as cpu_kernels
from torch_gdr.ref import naive_recurrent_gated_delta_rule
from torch_gdr.testing import make_inputs

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture(autouse=True)
def clean_policy(monkeypatch):
    """No backend named by the environment, no strict mode, every reason unwarned, and no
    compiled code left from another test."""
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_GDR_STRICT", raising=False)
    monkeypatch.setattr(_fallback, "_warned", set())
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(dtype: torch.dtype) -> dict:
    """Two sequences of 5 tokens, 1 q/k head, 2 value heads, K = V = 8, an initial state."""
    x = make_inputs(batch_size=2, seq_len=5, num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                    with_initial_state=True, dtype=dtype)
    x["initial_state"] = x["initial_state"].to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x


def _reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 recurrence on ``x`` (cast up), with the in-kernel l2norm the calls use."""
    return naive_recurrent_gated_delta_rule(*(x[n].detach().double() for n in NAMES[:5]),
                                            initial_state=x["initial_state"].detach().double(),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)


def test_float64_inputs_to_both_public_functions_compile() -> None:
    """float64 passes the default "cpu" backend over (it takes no float64): the chunked call
    and the step compile in one graph and give eager's values and the recurrence's."""

    def both(q, k, v, g, beta, initial_state):
        kwargs = dict(initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (*torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16, **kwargs),
                *torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs))

    x = _inputs(torch.float64)
    args = [x[n] for n in NAMES]
    got = torch.compile(both, fullgraph=True, dynamic=False, backend="eager")(*args)
    want = both(*args)
    ref_o, ref_s = _reference(x)
    for g, w, r in zip(got, want, (ref_o, ref_s, ref_o, ref_s)):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(g, r, atol=1e-10, rtol=1e-10)


def test_step_requiring_grad_compiles_with_its_backward() -> None:
    """float32 inputs that require grad pass the "cpu" step over (it has no backward): the
    compiled step and its backward equal eager's, and the float64 recurrence's gradients."""

    def loss(q, k, v, g, beta, initial_state):
        o, s = torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (o * o).sum() + (s * s).sum()

    x = _inputs(torch.float32)

    def value_and_grads(fn, dtype):
        leaves = [x[n].detach().to(dtype).requires_grad_() for n in NAMES]
        value = fn(*leaves)
        return (value, *torch.autograd.grad(value, leaves))

    got = value_and_grads(torch.compile(loss, fullgraph=True, dynamic=False, backend="aot_eager"), torch.float32)
    want = value_and_grads(loss, torch.float32)

    def reference_loss(q, k, v, g, beta, initial_state):
        o, s = naive_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (o * o).sum() + (s * s).sum()

    reference = value_and_grads(reference_loss, torch.float64)
    for name, g, w, r in zip(("loss",) + NAMES, got, want, reference):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=name)
        torch.testing.assert_close(g.double(), r, atol=2e-4, rtol=2e-4, msg=name)


def _layer(dtype: torch.dtype = torch.float32, backend=None) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, num_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, backend=backend).to(dtype)
    with torch.no_grad():
        layer.A_log.uniform_(-3.0, -1.0)  # mild decays: the carried state matters
    return layer.eval()


def test_layer_eval_with_grad_and_its_decode_compile() -> None:
    """The layer in eval mode with grad enabled runs the token-by-token step (T = 40 is below
    ``recurrent_max_len``) for parameters that require grad, so the "cpu" step is passed
    over; then one decode step on a :class:`GatedDeltaNetCache`. Compiled equals eager, and
    a float64 copy of the layer on the "recurrent" backend (the definition)."""
    layer = _layer()
    x = torch.randn(1, 41, 16, generator=torch.Generator().manual_seed(1))

    def prefill_and_decode(module, inputs):
        cache = GatedDeltaNetCache()
        first = module(inputs[:, :40], cache=cache)
        return first, module(inputs[:, 40:], cache=cache)

    assert torch.is_grad_enabled() and layer.A_log.requires_grad
    got = prefill_and_decode(torch.compile(layer, fullgraph=True, dynamic=False, backend="eager"), x)
    want = prefill_and_decode(layer, x)
    reference_layer = copy.deepcopy(layer).double()
    reference_layer.backend = "recurrent"
    reference = prefill_and_decode(reference_layer, x.double())
    for g, w, r in zip(got, want, reference):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-4)


def test_fla_named_on_cpu_tensors_raises_its_error_under_compile() -> None:
    """``backend="fla"`` on CPU tensors raises :class:`FlaBackendError` with its reason; under
    ``fullgraph=True`` Dynamo may wrap the error, whose message then carries it."""
    x = _inputs(torch.float32)

    def call(q, k, v, g, beta):
        return torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, backend="fla")

    args = [x[n] for n in NAMES[:5]]
    with pytest.raises(FlaBackendError, match=r"backend 'fla' cannot serve .*cuda tensors, not on 'cpu'") as eager:
        call(*args)
    with pytest.raises((FlaBackendError, torch._dynamo.exc.TorchDynamoException)) as compiled:
        torch.compile(call, fullgraph=True, dynamic=False, backend="eager")(*args)
    assert "FlaBackendError" in repr(compiled.value) or "FlaBackendError" in str(compiled.value)
    assert str(eager.value) in str(compiled.value)


def test_fallback_warning_is_raised_once_under_compile(monkeypatch) -> None:
    """With the fused CPU kernels missing, a compiled default call warns once (while Dynamo
    traces), runs "torch" with the recurrence's result, and neither a second compiled call
    nor an eager one warns again for the same reason."""
    reason = "no working C++ compiler (simulated)"
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: reason)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    x = _inputs(torch.float32)

    def call(q, k, v, g, beta, initial_state):
        return torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, chunk_size=16)

    args = [x[n] for n in NAMES]
    compiled = torch.compile(call, fullgraph=True, dynamic=False, backend="eager")
    with pytest.warns(CpuFallbackWarning, match=re.escape(reason)):
        got = compiled(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = compiled(*args)
        want = call(*args)
    ref_o, ref_s = _reference(x)
    for g, a, w, r in zip(got, again, want, (ref_o, ref_s)):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a, w, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-5)
