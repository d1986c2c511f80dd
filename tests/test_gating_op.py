"""``torch_gdr.fused_gdn_gating``: vLLM's and SGLang's gate and beta activations as a public op.

Checked against a float64 formula written here element by element with ``math`` (not torch's
softplus), for vLLM's ``[T, HV]`` rows and the ``[B, T, HV]`` form, the softplus ``beta`` and
``threshold`` arguments, gradients (gradcheck in float64), dtypes, errors and
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_gdr


def _softplus64(x: float, beta: float, threshold: float) -> float:
    return x if beta * x > threshold else math.log1p(math.exp(beta * x)) / beta


def _expected(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    """(g, sigmoid(b)) in float64, one element at a time."""
    a64, b64 = a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1])
    g = torch.empty_like(a64)
    s = torch.empty_like(b64)
    for i in range(a64.shape[0]):
        for h in range(a64.shape[1]):
            x = float(a64[i, h]) + float(dt_bias[h].double())
            g[i, h] = -math.exp(float(A_log[h].double())) * _softplus64(x, beta, threshold)
            s[i, h] = 1.0 / (1.0 + math.exp(-float(b64[i, h])))
    return g.reshape(a.shape), s.reshape(b.shape)


def _inputs(shape, dtype=torch.float32, seed=0, spread=4.0):
    gen = torch.Generator().manual_seed(seed)
    hv = shape[-1]
    a = (torch.randn(shape, generator=gen, dtype=torch.float64) * spread).to(dtype)
    b = (torch.randn(shape, generator=gen, dtype=torch.float64) * spread).to(dtype)
    A_log = (torch.rand(hv, generator=gen, dtype=torch.float64) * 2 - 1).to(torch.float32)
    dt_bias = torch.randn(hv, generator=gen, dtype=torch.float64).to(torch.float32)
    return A_log, a, b, dt_bias


@pytest.mark.parametrize("shape", [(5, 4), (2, 3, 4)], ids=["vllm_T_HV", "B_T_HV"])
@pytest.mark.parametrize("beta, threshold", [(1.0, 20.0), (2.0, 3.0), (0.5, 1.0)])
def test_values_against_float64_formula(shape, beta, threshold) -> None:
    A_log, a, b, dt_bias = _inputs(shape)
    g, beta_out = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias, beta=beta, threshold=threshold)
    g_ref, s_ref = _expected(A_log, a, b, dt_bias, beta, threshold)
    lead = (1,) if len(shape) == 2 else ()
    assert g.shape == (*lead, *shape) and beta_out.shape == (*lead, *shape)
    assert g.dtype == torch.float32 and beta_out.dtype == torch.float32
    torch.testing.assert_close(g.double().reshape(shape), g_ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(beta_out.double().reshape(shape), s_ref, rtol=2e-6, atol=1e-7)


def test_threshold_switches_to_identity() -> None:
    """Above ``beta * x > threshold`` softplus is ``x`` exactly (not log1p(exp) rounded)."""
    A_log = torch.zeros(2)
    dt_bias = torch.zeros(2)
    a = torch.tensor([[3.0, 2.5]])  # beta=2, threshold=5.5: 6 > 5.5 -> x; 5 <= 5.5 -> softplus
    b = torch.zeros(1, 2)
    g, _ = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias, beta=2.0, threshold=5.5)
    assert g[0, 0, 0].item() == -3.0
    assert g[0, 0, 1].item() == pytest.approx(-math.log1p(math.exp(5.0)) / 2.0, rel=1e-6)
    assert g[0, 0, 1].item() != -2.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_float32(dtype) -> None:
    """Half a and b: g is float32 from the half values; beta_output has b's dtype, rounded once."""
    A_log, a, b, dt_bias = _inputs((6, 8), dtype=dtype, seed=1)
    g, beta_out = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias)
    g_ref, s_ref = _expected(A_log, a, b, dt_bias)
    assert g.dtype == torch.float32 and beta_out.dtype == dtype
    torch.testing.assert_close(g[0].double(), g_ref, rtol=2e-6, atol=1e-6)
    assert torch.equal(beta_out[0], s_ref.to(dtype))


def test_float64_gives_float64() -> None:
    A_log, a, b, dt_bias = (t.double() for t in _inputs((3, 2), seed=2))
    g, beta_out = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias)
    g_ref, s_ref = _expected(A_log, a, b, dt_bias)
    assert g.dtype == beta_out.dtype == torch.float64
    torch.testing.assert_close(g[0], g_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(beta_out[0], s_ref, rtol=1e-12, atol=1e-12)


def test_strided_views_as_engines_slice_them() -> None:
    """a and b as column slices of one packed ``[T, 2 * HV]`` projection (vLLM's ``ba``)."""
    gen = torch.Generator().manual_seed(3)
    ba = torch.randn(5, 8, generator=gen)
    b, a = ba[:, :4], ba[:, 4:]
    A_log, dt_bias = torch.rand(4, generator=gen), torch.randn(4, generator=gen)
    g, beta_out = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias)
    g_ref, s_ref = _expected(A_log, a, b, dt_bias)
    torch.testing.assert_close(g[0].double(), g_ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(beta_out[0].double(), s_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("beta, threshold", [(1.0, 20.0), (1.5, 2.0)])
def test_gradcheck_float64(beta, threshold) -> None:
    A_log, a, b, dt_bias = (t.double() for t in _inputs((3, 4), seed=4, spread=1.0))
    # keep every beta * (a + dt_bias) off the threshold, where softplus has a kink
    x = beta * (a + dt_bias)
    a = torch.where((x - threshold).abs() < 0.05, a + 0.2, a)
    args = [t.clone().requires_grad_() for t in (A_log, a, b, dt_bias)]

    def f(A_log_, a_, b_, dt_bias_):
        return torch_gdr.fused_gdn_gating(A_log_, a_, b_, dt_bias_, beta=beta, threshold=threshold)

    assert torch.autograd.gradcheck(f, args)


def test_gradients_against_float64_formula() -> None:
    """The gradients of sum(w_g * g) + sum(w_b * beta) against their closed forms."""
    A_log, a, b, dt_bias = (t.double() for t in _inputs((4, 3), seed=5, spread=3.0))
    beta, threshold = 1.0, 2.0
    args = [t.clone().requires_grad_() for t in (A_log, a, b, dt_bias)]
    g, s = torch_gdr.fused_gdn_gating(*args, beta=beta, threshold=threshold)
    w_g, w_b = torch.randn_like(g), torch.randn_like(s)
    ((g * w_g).sum() + (s * w_b).sum()).backward()
    x = a + dt_bias
    slope = torch.where(beta * x > threshold, torch.ones_like(x), 1.0 / (1.0 + torch.exp(-beta * x)))
    g_ref, s_ref = _expected(A_log, a, b, dt_bias, beta, threshold)
    d_a = w_g[0] * (-A_log.exp()) * slope
    torch.testing.assert_close(args[1].grad, d_a)
    torch.testing.assert_close(args[3].grad, d_a.sum(0))
    torch.testing.assert_close(args[0].grad, (w_g[0] * g_ref).sum(0))
    torch.testing.assert_close(args[2].grad, w_b[0] * s_ref * (1 - s_ref))


def test_feeds_the_ops() -> None:
    """g and beta from the op give the same outputs as the ops' own in-kernel activations."""
    gen = torch.Generator().manual_seed(6)
    T, H, HV, K, V = 6, 1, 2, 8, 8
    q, k = torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    A_log, a, b, dt_bias = _inputs((T, HV), seed=7, spread=1.0)
    g, beta = torch_gdr.fused_gdn_gating(A_log, a, b, dt_bias)
    o, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, backend="torch")
    o_in, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, a[None], b[None], backend="torch", use_gate_in_kernel=True,
                                               A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    torch.testing.assert_close(o, o_in, rtol=1e-5, atol=1e-6)


def test_compiles_fullgraph() -> None:
    A_log, a, b, dt_bias = _inputs((5, 4), seed=8)
    compiled = torch.compile(torch_gdr.fused_gdn_gating, fullgraph=True, backend="aot_eager")
    g, s = compiled(A_log, a, b, dt_bias, 1.0, 20.0)
    g_ref, s_ref = _expected(A_log, a, b, dt_bias)
    torch.testing.assert_close(g[0].double(), g_ref, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(s[0].double(), s_ref, rtol=2e-6, atol=1e-7)


_GOOD = _inputs((3, 4))


@pytest.mark.parametrize("index, bad, exc, words", [
    (1, torch.zeros(3, 4, dtype=torch.int32), TypeError, ["a:", "floating", "int32"]),
    (1, torch.zeros(4), ValueError, ["a:", "[T, HV]", "[4]"]),
    (2, torch.zeros(3, 5), ValueError, ["b:", "[3, 4]", "[3, 5]"]),
    (0, torch.zeros(5), ValueError, ["A_log:", "[HV] = [4]", "[5]"]),
    (3, torch.zeros(1, 4), ValueError, ["dt_bias:", "[HV] = [4]", "[1, 4]"]),
    (3, [0.0] * 4, TypeError, ["dt_bias:", "torch.Tensor", "list"]),
    (0, torch.zeros(4, device="meta"), ValueError, ["A_log:", "device", "meta"]),
])
def test_bad_input_names_the_argument(index, bad, exc, words) -> None:
    args = list(_GOOD)
    args[index] = bad
    with pytest.raises(exc) as info:
        torch_gdr.fused_gdn_gating(*args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(beta=0.0), ValueError, ["beta:", "positive", "0.0"]),
    (dict(beta="1"), TypeError, ["beta:", "float", "str"]),
    (dict(threshold=float("nan")), ValueError, ["threshold:", "finite", "nan"]),
    (dict(threshold=True), TypeError, ["threshold:", "float", "bool"]),
])
def test_bad_softplus_arguments(kwargs, exc, words) -> None:
    with pytest.raises(exc) as info:
        torch_gdr.fused_gdn_gating(*_GOOD, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
