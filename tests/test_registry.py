"""The backend registry: one select() for every entry point, the fallback policy, and the
compiled paths through the "cpu" backend's ops."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torch_gdr
from torch_gdr import _fallback
from torch_gdr.dispatch import (BACKENDS, BackendError, CallSpec, CpuBackendError, CpuFallbackWarning,
                                FlaBackendError, NoBackendError, PyptoBackendError, registry)
from torch_gdr.ops.cpu import kernels as cpu_kernels
from torch_gdr.ref import naive_recurrent_gated_delta_rule
from torch_gdr.testing import make_inputs

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the fused CPU kernels are not built")


@pytest.fixture(autouse=True)
def clean_policy(monkeypatch):
    """No backend named by the environment, no strict mode, every reason unwarned."""
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_GDR_STRICT", raising=False)
    monkeypatch.setattr(_fallback, "_warned", set())


def _inputs(dtype=torch.float32, **spec) -> dict:
    spec = dict(dict(seqlens=[9, 0, 21], num_qk_heads=1, num_v_heads=2, with_initial_state=True), **spec)
    x = make_inputs(dtype=dtype, **spec)
    x["initial_state"] = x["initial_state"].float()
    return x


# named backend, call changes, entry, error, message regex
NAMED_REFUSALS = {
    "cpu_float64": ("cpu", dict(dtype=torch.float64), "chunk", CpuBackendError, r"float32/float16/bfloat16"),
    "cpu_step_with_grad": ("cpu", dict(requires_grad=True), "step", CpuBackendError, r"step has no backward"),
    "cpu_checkpoints": ("cpu", {}, "checkpoints", CpuBackendError, r"no checkpoints"),
    "fla_on_cpu": ("fla", {}, "chunk", FlaBackendError, r"cuda tensors, not on 'cpu'"),
    "pypto_head_dim": ("pypto", dict(head_k_dim=32, head_v_dim=32), "chunk", PyptoBackendError, r"head dims"),
    "pypto_head_v_dim_96": ("pypto", dict(head_k_dim=256, head_v_dim=96), "step", PyptoBackendError,
                            r"head dims K, V in \[64, 128, 256\], got K = 256, V = 96"),
    "recurrent_checkpoints": ("recurrent", {}, "checkpoints", BackendError, r"no checkpoints"),
}


def _call(entry: str, x: dict, backend):
    if entry == "step":
        return torch_gdr.fused_recurrent_gated_delta_rule(**x, backend=backend)
    if entry == "checkpoints":
        with torch.no_grad():
            return torch_gdr.chunk_gated_delta_rule(**x, chunk_size=16, checkpoint_every=16, backend=backend)
    return torch_gdr.chunk_gated_delta_rule(**x, backend=backend)


@pytest.mark.parametrize("case", list(NAMED_REFUSALS))
def test_a_named_backend_that_cannot_serve_raises_its_reasons(case: str) -> None:
    name, changes, entry, error, message = NAMED_REFUSALS[case]
    x = _inputs(**changes)
    with pytest.raises(error, match=rf"backend '{name}' cannot serve .*{message}"):
        _call(entry, x, name)


@pytest.mark.parametrize("entry", ["chunk", "step", "checkpoints"])
def test_an_unknown_backend_is_a_value_error_on_every_entry(entry: str) -> None:
    with pytest.raises(ValueError, match=r"backend: expected one of \['cpu', 'fla', 'pypto', 'recurrent', 'torch'\]"):
        _call(entry, _inputs(), "nonsense")


def test_checkpoint_every_with_cp_context_is_refused() -> None:
    with pytest.raises(ValueError, match=r"checkpoint_every: not available with cp_context"):
        torch_gdr.chunk_gated_delta_rule(**_inputs(), checkpoint_every=16, chunk_size=16, cp_context=object())


@pytest.mark.parametrize("entry", ["chunk", "step"])
def test_the_default_passes_over_cpu_silently_for_calls_it_does_not_take(entry: str) -> None:
    """float64 (the reference's dtype) and mixed q/v dtypes run "torch" without a word."""
    for x in (_inputs(dtype=torch.float64), dict(_inputs(), v=_inputs()["v"].double())):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _call(entry, x, None)
        expected = _call(entry, x, "torch")
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


def _kernels_missing(monkeypatch) -> str:
    reason = "no working C++ compiler (simulated)"
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: reason)
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    return reason


@pytest.mark.parametrize("entry", ["chunk", "step"])
def test_missing_kernels_warn_once_then_run_torch(monkeypatch, entry: str) -> None:
    reason = _kernels_missing(monkeypatch)
    x = _inputs()
    expected = _call(entry, x, "torch")
    with pytest.warns(CpuFallbackWarning, match=re.escape(reason)):
        got = _call(entry, x, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason warns once
        _call(entry, x, None)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("entry", ["chunk", "step"])
def test_missing_kernels_raise_in_strict_mode_and_when_named(monkeypatch, entry: str) -> None:
    reason = _kernels_missing(monkeypatch)
    with pytest.raises(CpuBackendError, match=re.escape(reason)):
        _call(entry, _inputs(), "cpu")
    monkeypatch.setenv("TORCH_GDR_STRICT", "1")
    with pytest.raises(CpuBackendError, match=re.escape(reason)):
        _call(entry, _inputs(), None)


def test_no_backend_lists_every_backends_reasons(monkeypatch) -> None:
    monkeypatch.setitem(registry.DEVICE_ORDERS, ("chunk", "cpu"), ("cpu",))
    with pytest.raises(NoBackendError, match=r"no backend can serve") as info:
        torch_gdr.chunk_gated_delta_rule(**_inputs(dtype=torch.float64))
    for name in BACKENDS:
        assert re.search(rf"^  {name}: ", str(info.value), re.M), name


def test_the_public_op_selects_like_the_function(monkeypatch) -> None:
    """The op's body goes through select() too: with the "cpu" backend missing it warns and
    runs "torch"; strict mode makes that an error."""
    _kernels_missing(monkeypatch)
    x = _inputs()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, False, x["cu_seqlens"])
    with pytest.warns(CpuFallbackWarning):
        o, s = torch.ops.gdr.chunked_gated_delta_rule(*args)
    ref = make_inputs(seqlens=[9, 0, 21], num_qk_heads=1, num_v_heads=2, with_initial_state=True)
    ro, rs = naive_recurrent_gated_delta_rule(**ref)
    torch.testing.assert_close(o.double(), ro, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("TORCH_GDR_STRICT", "1")
    monkeypatch.setattr(_fallback, "_warned", set())
    with pytest.raises(CpuBackendError):
        torch.ops.gdr.chunked_gated_delta_rule(*args)


def test_select_reads_no_tensor_data() -> None:
    """Selection works on meta tensors: shapes, dtypes and devices only."""
    q = torch.empty(1, 5, 2, 64, device="meta")
    assert registry.select(CallSpec.of("chunk", q, q, 64, False)).backend.name == "torch"


# -- torch.compile through the "cpu" backend's ops ------------------------------------------


@needs_cpu_kernels
def test_compiled_fused_recurrent_on_cpu_tensors_runs_the_cpu_step() -> None:
    x = _inputs(seqlens=None, batch_size=3, seq_len=1)

    def step(q, k, v, g, beta, h0):
        return torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    torch._dynamo.reset()
    o, s = torch.compile(step, fullgraph=True)(*args)
    eo, es = torch_gdr.fused_recurrent_gated_delta_rule(*args[:4], beta=args[4], initial_state=args[5],
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                        backend="torch")
    torch.testing.assert_close(o, eo, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, es, atol=1e-5, rtol=1e-5)


@needs_cpu_kernels
def test_compiled_chunk_call_through_cpu_forward_and_backward() -> None:
    x = _inputs(seqlens=None, batch_size=2, seq_len=40)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    eager = {n: t.clone().requires_grad_() for n, t in x.items()}

    def loss(xs):
        o, s = torch_gdr.chunk_gated_delta_rule(**xs, output_final_state=True, chunk_size=16, backend="cpu")
        return o.square().sum() + s.sum()

    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(leaves).backward()
    loss(eager).backward()
    for n in leaves:
        torch.testing.assert_close(leaves[n].grad, eager[n].grad, atol=1e-5, rtol=1e-5, msg=n)


@needs_cpu_kernels
def test_compiled_eval_layer_decode() -> None:
    from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, num_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16).eval()
    prompt, token = torch.randn(2, 7, 32), torch.randn(2, 1, 32)
    with torch.no_grad():
        cache, eager_cache = GatedDeltaNetCache(), GatedDeltaNetCache()
        layer(prompt, cache=cache)
        layer(prompt, cache=eager_cache)
        torch._dynamo.reset()
        compiled = torch.compile(lambda h: layer(h, cache=cache), fullgraph=True)
        y = compiled(token)
        expected = layer(token, cache=eager_cache)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend, error", [("recurrent", BackendError), ("fla", FlaBackendError)])
def test_pool_steps_only_on_backends_that_have_one(backend: str, error: type) -> None:
    x = make_inputs(batch_size=2, seq_len=1, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                    dtype=torch.float32)
    pool = torch.zeros(4, 2, 16, 16)
    with pytest.raises(error, match=rf"backend '{backend}' cannot serve this step over a state pool: .*"
                                    r"no step over a state pool"):
        torch_gdr.fused_recurrent_gated_delta_rule(**x, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]),
                                                   backend=backend)


def test_pypto_pool_step_refuses_head_dims_its_kernel_lacks() -> None:
    """"pypto" has a pool step (its decode kernel), for K and V in 64, 128 or 256 only."""
    x = make_inputs(batch_size=2, seq_len=1, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                    dtype=torch.float32)
    pool = torch.zeros(4, 2, 16, 16)
    with pytest.raises(PyptoBackendError, match=r"backend 'pypto' cannot serve this step over a state pool: .*"
                                                r"head dims"):
        torch_gdr.fused_recurrent_gated_delta_rule(**x, initial_state=pool, ssm_state_indices=torch.tensor([0, 1]),
                                                   backend="pypto")


def test_pool_step_without_kernels_warns_once_and_runs_torch(monkeypatch) -> None:
    reason = _kernels_missing(monkeypatch)
    x = make_inputs(batch_size=2, seq_len=1, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                    dtype=torch.float32)
    pools = [torch.randn(4, 2, 16, 16, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    pools[1] = pools[0].clone()
    rows = torch.tensor([2, 0])
    expected, _ = torch_gdr.fused_recurrent_gated_delta_rule(**x, initial_state=pools[0], ssm_state_indices=rows,
                                                             backend="torch")
    with pytest.warns(CpuFallbackWarning, match=re.escape(reason)):
        got, pool = torch_gdr.fused_recurrent_gated_delta_rule(**x, initial_state=pools[1], ssm_state_indices=rows)
    assert pool is pools[1]
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(pools[1], pools[0], atol=0, rtol=0)
