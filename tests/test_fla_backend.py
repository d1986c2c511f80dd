"""torch_gdr's adapter to fla-core's kernels, with fla absent and with a pure-torch stand-in
in ``sys.modules`` (so that the argument mapping and every fallback reason run on CPUs)."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import torch_gdr
import torch_gdr.ops.fla as fla_backend
from tests import fla_standin
from tests.helpers import make_inputs
from torch_gdr.dispatch import BACKENDS, CallSpec, reason_text, registry
from torch_gdr.ops.fla import FlaRefusal
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule


@pytest.fixture
def no_fla(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    fla_backend.reset()
    yield
    fla_backend.reset()


@pytest.fixture
def standin(monkeypatch):
    """Installs the stand-in; the test may change its behaviour, then call ``install()``."""
    behaviour = fla_standin.Behaviour()

    def install(**overrides):
        modules = fla_standin.build(behaviour)
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        for dotted, value in overrides.items():  # "module:attr" -> value (None deletes)
            name, attr = dotted.split(":")
            if value is None:
                delattr(modules[name], attr)
            else:
                setattr(modules[name], attr, value)
        fla_backend.reset()
        return modules

    install()
    behaviour.install = install
    yield behaviour
    fla_backend.reset()


@pytest.fixture
def any_device(monkeypatch):
    """Let the CPU pass the device check, to reach the reasons behind it."""
    import dataclasses

    fla = BACKENDS["fla"]
    monkeypatch.setattr(fla, "capabilities", dataclasses.replace(fla.capabilities, device_types=("cpu", "cuda")))


def fla_reasons(q, k, v, *, entry: str = "chunk", needs_backward: bool = False):
    """The "fla" backend's reasons for a call, joined, or None when it serves it."""
    return reason_text(BACKENDS["fla"].unsupported_reasons(CallSpec.of(entry, q, v, 64, needs_backward))) or None


def fused_recurrent_gated_delta_rule(*args, **kwargs):
    return torch_gdr.fused_recurrent_gated_delta_rule(*args, **kwargs, backend="torch")


def _inputs(**kw):
    x = {n: t.cpu() for n, t in make_inputs(dtype=torch.float32, **kw).items()}  # the stand-in runs on CPUs
    if "initial_state" in x:
        x["initial_state"] = x["initial_state"].float()
    return x


def _args(x, use_l2norm=True, chunk_size=64):
    scale = x["q"].shape[-1] ** -0.5
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], scale, x.get("initial_state"), True, use_l2norm,
            x.get("cu_seqlens"), chunk_size)


# -- fla absent ----------------------------------------------------------------------------


def test_absent(no_fla, any_device) -> None:
    x = _inputs(seq_len=8)
    assert not fla_backend.available()
    reason = fla_reasons(x["q"], x["k"], x["v"])
    assert "fla-core is not installed" in reason and "torch_gdr[gpu]" in reason
    assert fla_reasons(x["q"], x["k"], x["v"], entry="step") == reason
    assert fla_backend.backward_refusal_reason() is None
    with pytest.raises(FlaRefusal, match="not installed") as info:
        fla_backend.fla_chunk_fwd(*_args(x))
    assert info.value.reason == reason
    with pytest.raises(FlaRefusal, match="not installed"):
        fla_backend.fla_fused_recurrent_fwd(*_args(x)[:-1])


# -- the stand-in: argument mapping ---------------------------------------------------------

MAPPING = {
    "batched": dict(batch_size=2, seq_len=40, with_initial_state=True),
    "varlen_gva": dict(seqlens=[33, 0, 70, 5], num_qk_heads=1, num_v_heads=2, with_initial_state=True),
    "no_initial_state": dict(seq_len=20),
}


@pytest.mark.parametrize("chunk_size", [16, 128])
@pytest.mark.parametrize("use_l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("case", list(MAPPING))
def test_forward_and_backward_map_onto_fla(standin, case, use_l2norm, chunk_size) -> None:
    x = _inputs(**MAPPING[case])
    if not use_l2norm:
        x["q"], x["k"] = x["q"] * 0.25, x["k"] * 0.25
    o, final_state, g_cumsum, A, q_rstd, k_rstd = fla_backend.fla_chunk_fwd(*_args(x, use_l2norm, chunk_size))
    bt = fla_backend.fla_chunk_size(chunk_size)
    assert bt == min(chunk_size, 64)
    assert o.dtype == x["v"].dtype and final_state.dtype == torch.float32
    assert g_cumsum.shape == x["g"].shape and A.shape == x["beta"].shape + (bt,)
    assert q_rstd.shape == (x["q"].shape[:-1] if use_l2norm else (0,)) and k_rstd.shape == q_rstd.shape

    leaves = {n: t.detach().double().requires_grad_() for n, t in x.items() if n != "cu_seqlens"}
    ref_o, ref_s = naive_recurrent_gated_delta_rule(**leaves, cu_seqlens=x.get("cu_seqlens"),
                                                    use_qk_l2norm_in_kernel=use_l2norm)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_state.double(), ref_s, atol=1e-5, rtol=1e-5)

    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(final_state.shape, generator=gen)
    grads = fla_backend.fla_chunk_bwd(do, dht, x["q"], x["k"], x["v"], x["g"], x["beta"], g_cumsum, A, q_rstd,
                                      k_rstd, x["q"].shape[-1] ** -0.5, x.get("initial_state"), use_l2norm,
                                      x.get("cu_seqlens"), chunk_size)
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if "initial_state" in x else [])
    expected = torch.autograd.grad((ref_o * do.double()).sum() + (ref_s * dht.double()).sum(),
                                   [leaves[n] for n in names])
    for name, got, want in zip(names, grads, expected):
        assert got.dtype == x[name].dtype, name
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4, msg=lambda m: f"d{name}: {m}")
    if "initial_state" not in x:
        assert grads[5] is None
    assert standin.calls.count("fwd") == 1 and standin.calls.count("bwd") == 1  # nothing recomputed


def test_backward_without_a_final_state_gradient(standin) -> None:
    x = _inputs(seq_len=9, with_initial_state=True)
    _, _, g_cumsum, A, q_rstd, k_rstd = fla_backend.fla_chunk_fwd(*_args(x))
    do = torch.ones_like(x["v"])
    dq, *_ = fla_backend.fla_chunk_bwd(do, None, x["q"], x["k"], x["v"], x["g"], x["beta"], g_cumsum, A, q_rstd,
                                       k_rstd, 0.25, x["initial_state"], True, None, 64)
    leaves = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    ref_o, _ = naive_recurrent_gated_delta_rule(**dict(leaves, scale=0.25), use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(dq.double(), torch.autograd.grad(ref_o.sum(), leaves["q"])[0], atol=1e-4, rtol=1e-4)


def test_fused_recurrent_maps_onto_fla(standin) -> None:
    x = _inputs(seqlens=[1, 1, 3], num_qk_heads=1, num_v_heads=2, with_initial_state=True)
    x["v"] = x["v"].to(torch.bfloat16)  # q/k and v in different dtypes, as fla takes them
    scale = x["q"].shape[-1] ** -0.5
    o, s = fla_backend.fla_fused_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], scale,
                                               x["initial_state"], True, True, x["cu_seqlens"])
    ref_o, ref_s = fused_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref_o.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=1e-5)


# -- fallback reasons -------------------------------------------------------------------------


def test_available_and_device_reason(standin) -> None:
    x = _inputs(seq_len=4)
    assert fla_backend.available()
    assert "cuda tensors, not on 'cpu'" in fla_reasons(x["q"], x["k"], x["v"])
    assert "cuda tensors" in fla_reasons(x["q"], x["k"], x["v"], entry="step")


@pytest.mark.parametrize("version", ["0.5.2", "0.7.0", "1.0.0"])
def test_untested_version(standin, any_device, version) -> None:
    standin.version = version
    standin.install()
    x = _inputs(seq_len=4)
    reason = fla_reasons(x["q"], x["k"], x["v"])
    assert f"fla-core {version} is outside the tested range >=0.6.0,<0.7" in reason
    assert not fla_backend.available()


def test_missing_function(standin, any_device) -> None:
    standin.install(**{"fla.ops.gated_delta_rule.chunk:chunk_gated_delta_rule_bwd": None})
    x = _inputs(seq_len=4)
    reasons = BACKENDS["fla"].unsupported_reasons(CallSpec.of("chunk", x["q"], x["v"], 64, False))
    assert "has no fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_bwd" in reasons[0].text
    assert reasons[0].kind == "missing"  # installed but broken: a default warns


def test_reasons_behind_the_device_check(standin, any_device) -> None:
    x = _inputs(seq_len=4)
    q, k, v = x["q"], x["k"], x["v"]
    assert fla_reasons(q, k, v) is None
    assert "float64" in fla_reasons(q.double(), k.double(), v.double())
    assert "one dtype for q, k and v" in fla_reasons(q, k, v.half())
    assert fla_reasons(q, k, v.half(), entry="step") is None  # the step takes mixed dtypes
    big = torch.zeros(1, 4, 2, 512)
    assert "K <= 256" in fla_reasons(big, big, v)
    assert "T = 0" in fla_reasons(q[:, :0], k[:, :0], v[:, :0])
    assert "no backward" in fla_reasons(q, k, v, entry="step", needs_backward=True)


@pytest.mark.parametrize("hopper,above_3_4,above_3_7_1,tilelang,refused", [
    (True, True, False, False, True),
    (True, True, False, True, False),   # tilelang serves the kernel
    (True, True, True, False, False),   # a fixed Triton
    (True, False, False, False, False),  # an older Triton
    (False, True, False, False, False),  # not Hopper
])
def test_predicted_backward_refusal(standin, any_device, monkeypatch, hopper, above_3_4, above_3_7_1, tilelang,
                                    refused) -> None:
    standin.install(**{"fla.utils:IS_NVIDIA_HOPPER": hopper, "fla.utils:TRITON_ABOVE_3_4_0": above_3_4,
                       "fla.utils:TRITON_ABOVE_3_7_1": above_3_7_1})
    monkeypatch.setattr(fla_backend, "tilelang_installed", lambda: tilelang)
    x = _inputs(seq_len=4)
    reason = fla_reasons(x["q"], x["k"], x["v"], needs_backward=True)
    assert (reason is not None) == refused
    assert fla_reasons(x["q"], x["k"], x["v"]) is None  # forward-only calls are served
    if refused:
        assert "Hopper" in reason and "3.7.1" in reason


def test_backward_refusal_at_call_time(standin) -> None:
    x = _inputs(seq_len=6)
    saved = fla_backend.fla_chunk_fwd(*_args(x))[2:]
    standin.backward_error = RuntimeError(fla_standin.HOPPER_MESSAGE)
    with pytest.raises(FlaRefusal) as info:
        fla_backend.fla_chunk_bwd(torch.ones_like(x["v"]), None, x["q"], x["k"], x["v"], x["g"], x["beta"], *saved,
                                  0.25, None, True, None, 64)
    assert info.value.reason.startswith("fla refuses the chunked backward on this GPU: Triton >= 3.4.0")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("error,expected", [
    (AssertionError("current kernel does not support head dimension larger than 256."),
     "fla's chunked forward rejects the call (AssertionError: current kernel does not support"),
    (ValueError("bad"), "fla's chunked forward rejects the call (ValueError: bad)"),
    (RuntimeError("CUDA error: an illegal memory access"), "fla's chunked forward failed (RuntimeError: CUDA error"),
    (TypeError("chunk_gated_delta_rule_fwd() got an unexpected keyword argument 'chunk_indices'"),
     "fla-core 0.6.0's chunked forward does not take the arguments of fla-core 0.6"),
])
def test_forward_failures_become_reasons(standin, error, expected) -> None:
    standin.forward_error = error
    x = _inputs(seq_len=6)
    with pytest.raises(FlaRefusal) as info:
        fla_backend.fla_chunk_fwd(*_args(x))
    assert info.value.reason.startswith(expected), info.value.reason


def test_out_of_memory_is_not_a_fallback(standin) -> None:
    standin.forward_error = torch.OutOfMemoryError("CUDA out of memory")
    x = _inputs(seq_len=6)
    with pytest.raises(torch.OutOfMemoryError):
        fla_backend.fla_chunk_fwd(*_args(x))


# -- bench/gpu_check.py's fla section runs (with the stand-in, on the CPU) -------------------


def test_gpu_check_fla_section_runs_with_the_standin(standin, monkeypatch) -> None:
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import fla_compare

    # bound: the stand-in's public call differentiates its l2norm from the unrounded bf16 output,
    # fla's (like the adapter) from the rounded one: dq, dk differ at bf16's rounding
    lines = fla_compare.check_adapter("cpu", bound=1e-2, seq_lens=(20, 1, 9), heads=(1, 2), dim=8, decode_batch=3)
    assert len(lines) == 2 and all(" OK: " in line for line in lines), lines
    lines = fla_compare.check_adapter("cpu", bound=1e-2, seq_lens=(20, 1, 9), heads=(1, 2), dim=8, decode_batch=3,
                                      gated=True)
    assert len(lines) == 1 and " OK: " in lines[0] and "dA_log" in lines[0] and "ddt_bias" in lines[0], lines
    lines = fla_compare.time_against_fla("cpu", lambda fn: (fn(), 1.0)[1], {"tiny": (1, 20, 1, 2, 8)}, (2,),
                                         (1, 2, 8))
    assert sum("1.00x" in line for line in lines) == 4, lines  # fwd, fwd+bwd, two decode rows: all timed
    assert "public chunk" in standin.calls and "fused_recurrent" in standin.calls


# -- the "fla" backend's ops, through the public call (stand-in kernels on the CPU) -------------


@pytest.mark.parametrize("use_l2norm", [True, False])
@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
def test_fla_backend_ops_through_the_public_call(standin, any_device, use_l2norm: bool, varlen: bool) -> None:
    """backend="fla": our forward op on fla's kernels, our autograd on fla's backward with the
    tensors the forward kept (no forward recompute), the same values and gradients as the
    "torch" backend; and opcheck of both ops."""
    spec = dict(seqlens=[20, 0, 37]) if varlen else dict(batch_size=2, seq_len=33)
    inputs = make_inputs(**spec, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, dtype=torch.float32,
                         with_initial_state=True, normalize_qk=not use_l2norm)
    inputs["initial_state"] = inputs["initial_state"].float()
    results = {}
    for backend in ("torch", "fla"):
        leaves = {n: (t.clone().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: fla's forward and backward both ran
            o, s = torch_gdr.chunk_gated_delta_rule(**leaves, output_final_state=True, chunk_size=16,
                                                    use_qk_l2norm_in_kernel=use_l2norm, backend=backend)
            (o.sin().sum() + s.square().sum()).backward()
        results[backend] = [o, s] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]
    for got, want in zip(results["fla"], results["torch"]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
    args = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta"))
    options = (None, inputs["initial_state"], True, use_l2norm, inputs.get("cu_seqlens"), 16, False)
    torch.library.opcheck(torch.ops.gdr._fla_fwd.default, args + options + (True,))
    _, _, saved = torch.ops.gdr._fla_fwd(*args, *options, True)
    grad_o, dht = torch.randn_like(inputs["v"]), torch.randn_like(inputs["initial_state"])
    torch.library.opcheck(torch.ops.gdr._fla_bwd.default,
                          (grad_o, dht) + args + (None, inputs["initial_state"], use_l2norm,
                                                  inputs.get("cu_seqlens"), 16, False, saved))


#: fla's activation arguments: (use_gate_in_kernel, with dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
ACTIVATIONS = {
    "all": (True, True, True, True),
    "gate_without_dt_bias": (True, False, False, False),
    "beta_sigmoid_only": (False, False, True, False),
}


def _raw_activations(inputs: dict, num_v_heads: int, activations: tuple) -> dict:
    """The call's raw gate, beta logits, A_log and dt_bias and flags; one raw gate of 100
    (past softplus's threshold and float32's exp range)."""
    use_gate, with_bias, use_sigmoid, neg_eigval = activations
    gen = torch.Generator().manual_seed(11)
    kwargs = dict(use_beta_sigmoid_in_kernel=use_sigmoid, allow_neg_eigval=neg_eigval)
    if use_gate:
        inputs["g"] = 2.0 * torch.randn(inputs["g"].shape, generator=gen)
        inputs["g"].view(-1)[0] = 100.0
        kwargs.update(use_gate_in_kernel=True, A_log=torch.empty(num_v_heads).uniform_(0.05, 2.0, generator=gen).log(),
                      dt_bias=torch.randn(num_v_heads, generator=gen) if with_bias else None)
    if use_sigmoid:
        inputs["beta"] = 2.0 * torch.randn(inputs["beta"].shape, generator=gen)
    return kwargs


@pytest.mark.parametrize("varlen", [False, True], ids=["batched", "varlen"])
@pytest.mark.parametrize("case", list(ACTIVATIONS))
def test_fla_backend_hands_the_activations_to_fla(standin, any_device, case: str, varlen: bool) -> None:
    """backend="fla" with fla's activation arguments: the raw gate, A_log and dt_bias reach
    fla's forward and backward kernels (which apply them, as fla's own function does), the
    beta logits fla's fused sigmoid kernels; o, the final state and every gradient (raw gate,
    logits, A_log, dt_bias included) as the "torch" backend's, which applies them in torch;
    the step likewise through fla's fused-recurrent kernel."""
    spec = dict(seqlens=[20, 0, 37]) if varlen else dict(batch_size=2, seq_len=33)
    inputs = make_inputs(**spec, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16, dtype=torch.float32,
                         with_initial_state=True)
    inputs["initial_state"] = inputs["initial_state"].float()
    gating = _raw_activations(inputs, 2, ACTIVATIONS[case])
    results = {}
    for backend in ("torch", "fla"):
        leaves = {n: (t.clone().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
        params = {n: (t.clone().requires_grad_() if isinstance(t, torch.Tensor) else t) for n, t in gating.items()}
        standin.calls.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            o, s = torch_gdr.chunk_gated_delta_rule(**leaves, **params, output_final_state=True, chunk_size=16,
                                                    use_qk_l2norm_in_kernel=True, backend=backend)
            (o.sin().sum() + s.square().sum()).backward()
        results[backend] = [o, s] + [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")] + [
            params[n].grad for n in ("A_log", "dt_bias") if isinstance(params.get(n), torch.Tensor)]
        if backend == "fla":
            use_gate, _, use_sigmoid, _ = ACTIVATIONS[case]
            assert ("fwd gate in kernel" in standin.calls) == use_gate
            assert ("bwd gate in kernel" in standin.calls) == use_gate
            assert ("beta sigmoid" in standin.calls) == use_sigmoid
            assert ("beta sigmoid bwd" in standin.calls) == use_sigmoid
    assert len(results["fla"]) == len(results["torch"])
    for got, want in zip(results["fla"], results["torch"]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)
    step = {n: inputs[n][:, :1] if not varlen else inputs[n] for n in ("q", "k", "v", "g", "beta")}
    cu_seqlens = inputs.get("cu_seqlens")
    outs = [torch_gdr.fused_recurrent_gated_delta_rule(**step, initial_state=inputs["initial_state"],
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                       cu_seqlens=cu_seqlens, backend=backend, **gating)
            for backend in ("torch", "fla")]
    assert ("fused_recurrent gate in kernel" in standin.calls) == ACTIVATIONS[case][0]
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("named", [True, False], ids=["named", "default"])
def test_fla_backward_refusal_follows_the_policy(standin, any_device, monkeypatch, named: bool) -> None:
    """A refusal that shows only when fla's backward runs: a named backend raises; the
    default warns once and returns the pure-torch backward's gradients."""
    from torch_gdr import _fallback

    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_GDR_STRICT", raising=False)
    monkeypatch.setitem(registry.DEVICE_ORDERS, ("chunk", "cpu"), ("fla", "torch"))
    inputs = make_inputs(seq_len=20, num_qk_heads=1, num_v_heads=2, dtype=torch.float32, normalize_qk=True)
    grads = {}
    for backend in ("torch", "fla"):
        leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
        o, _ = torch_gdr.chunk_gated_delta_rule(**leaves, chunk_size=16,
                                                backend="torch" if backend == "torch" else ("fla" if named else None))
        if backend == "fla":
            standin.backward_error = RuntimeError(fla_standin.HOPPER_MESSAGE)
            _fallback.reset_warnings()
            if named:
                with pytest.raises(_fallback.FlaBackendError, match="Hopper"):
                    o.sum().backward()
                return
            with pytest.warns(_fallback.FlaFallbackWarning, match="Hopper"):
                o.sum().backward()
        else:
            o.sum().backward()
        grads[backend] = [leaves[n].grad for n in ("q", "k", "v", "g", "beta")]
    for got, want in zip(grads["fla"], grads["torch"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_fla_is_the_default_on_cuda_where_it_imports(standin) -> None:
    from torch_gdr.dispatch import registry

    assert registry.default_backend(torch.device("cpu")) == "cpu"
    assert registry.default_backend(torch.device("cuda")) == "fla"


@pytest.mark.parametrize("named", [True, False], ids=["named", "default"])
def test_fla_under_torch_compile_fullgraph(standin, any_device, monkeypatch, named: bool) -> None:
    """Whether fla imports is decided outside the traced graph: a compiled call through the
    "fla" backend (named, or the device's default) traces without tracing the loader."""
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    monkeypatch.setitem(registry.DEVICE_ORDERS, ("chunk", "cpu"), ("fla", "torch"))
    x = _inputs(batch_size=2, seq_len=20, num_qk_heads=1, num_v_heads=2, with_initial_state=True)

    def call(q, k, v, g, beta, h0):
        return torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                chunk_size=16, backend="fla" if named else None)

    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    torch._dynamo.reset()
    fla_backend.reset()  # the first traced call decides availability afresh
    o, s = torch.compile(call, fullgraph=True)(*args)
    expected = torch_gdr.chunk_gated_delta_rule(*args[:5], initial_state=args[5], output_final_state=True,
                                                chunk_size=16, backend="torch")
    torch.testing.assert_close(o, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, expected[1], atol=1e-5, rtol=1e-5)
    assert "fwd" in standin.calls
