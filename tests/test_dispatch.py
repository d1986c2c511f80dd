"""Backend choice, the PyPTO backend's fallbacks, NPU detection and the kernel cache."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import torch_gdr
from tests.helpers import TEST_DEVICE, make_inputs
from torch_gdr import _fallback
from torch_gdr._fallback import PyptoBackendError, PyptoFallbackWarning
from torch_gdr.dispatch import BACKENDS, CallSpec, registry
from torch_gdr.ops.pypto import is_pypto_available, kernel_cache

needs_pypto = pytest.mark.skipif(not is_pypto_available(), reason="pypto==0.2.0 is not installed")
# PyPTO serves CPU (its interpreter) and NPU tensors; on others (TORCH_GDR_TEST_DEVICE=cuda)
# every call's reason is the device itself, so the table of other reasons does not apply.
on_pypto_device = pytest.mark.skipif(TEST_DEVICE.type != "cpu",
                                     reason=f"on {TEST_DEVICE.type} tensors PyPTO's only reason is the device")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _inputs(**overrides) -> dict:
    spec = dict(seqlens=[40, 0, 9], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                with_initial_state=True, dtype=torch.float32)
    spec.update(overrides)
    inputs = make_inputs(**spec)
    inputs["initial_state"] = inputs["initial_state"].to(spec["dtype"])
    return inputs


@pytest.fixture
def npu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make CPU tensors take the default backend of an NPU device ("pypto", may fall back)."""
    monkeypatch.setitem(registry.DEVICE_ORDERS, ("chunk", "cpu"), ("pypto", "torch"))
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_GDR_STRICT", raising=False)
    monkeypatch.setattr(_fallback, "_warned", set())


def _no_pypto(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_gdr.ops.pypto._env as pypto_env

    monkeypatch.setattr(pypto_env, "is_pypto_available", lambda: False)


def _broken_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(**config):
        raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(kernel_cache, "_default_builder", fail)
    kernel_cache.cache_clear()


# reason: (changes to the inputs, monkeypatch to apply, text the reason must contain)
FALLBACKS = {
    "head_dim": (dict(head_k_dim=32, head_v_dim=32), None, "head dims"),
    "float64": (dict(dtype=torch.float64), None, "float64"),
    "chunk_size": (dict(chunk_size=16), None, "chunk sizes"),
    "pypto_absent": ({}, _no_pypto, "pip install 'torch_gdr[npu]'"),
    "compile_failure": ({}, _broken_build, "simulated compile failure"),
}


def _split(changes: dict) -> tuple[dict, dict]:
    call = {k: v for k, v in changes.items() if k == "chunk_size"}
    return {k: v for k, v in changes.items() if k != "chunk_size"}, call


@on_pypto_device
@pytest.mark.parametrize("reason", list(FALLBACKS))
def test_default_backend_falls_back_with_one_warning(reason: str, npu_host, monkeypatch: pytest.MonkeyPatch) -> None:
    changes, patch, text = FALLBACKS[reason]
    if patch is not None:
        patch(monkeypatch)
    spec, call = _split(changes)
    inputs = _inputs(**spec)
    expected = torch_gdr.chunk_gated_delta_rule(**inputs, **call, output_final_state=True, backend="torch")
    with pytest.warns(PyptoFallbackWarning, match=re.escape(text)):
        got = torch_gdr.chunk_gated_delta_rule(**inputs, **call, output_final_state=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason warns once only
        torch_gdr.chunk_gated_delta_rule(**inputs, **call, output_final_state=True)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


@on_pypto_device
def test_training_fallback_keeps_the_chunk_states(npu_host, recompute_passes: list) -> None:
    """Where the kernel cannot serve a training call, the fallback is the "torch" backend's
    own path: the same gradients, and a backward that reads the kept chunk states instead of
    recomputing them (no load_segment call with states_only)."""
    inputs = _inputs(head_k_dim=32, head_v_dim=32)  # head dims the kernel does not take
    grads = {}
    for backend in ("torch", None):
        leaves = {n: (t.detach().clone().requires_grad_() if t.is_floating_point() else t)
                  for n, t in inputs.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PyptoFallbackWarning)
            o, final = torch_gdr.chunk_gated_delta_rule(**leaves, output_final_state=True, backend=backend)
        recompute_passes.clear()
        (o.square().sum() + final.sum()).backward()
        assert recompute_passes and not any(recompute_passes), backend
        grads[backend] = [leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")]
    for ours, expected in zip(grads[None], grads["torch"]):
        torch.testing.assert_close(ours, expected, atol=0, rtol=0)


@on_pypto_device
@pytest.mark.parametrize("reason", list(FALLBACKS))
def test_named_backend_raises_instead(reason: str, npu_host, monkeypatch: pytest.MonkeyPatch) -> None:
    changes, patch, text = FALLBACKS[reason]
    if patch is not None:
        patch(monkeypatch)
    spec, call = _split(changes)
    with pytest.raises(PyptoBackendError, match=re.escape(text)):
        torch_gdr.chunk_gated_delta_rule(**_inputs(**spec), **call, backend="pypto")


@on_pypto_device
@pytest.mark.parametrize("reason", ["head_dim", "pypto_absent"])
def test_strict_mode_turns_fallbacks_into_errors(reason: str, npu_host, monkeypatch: pytest.MonkeyPatch) -> None:
    changes, patch, text = FALLBACKS[reason]
    if patch is not None:
        patch(monkeypatch)
    monkeypatch.setenv("TORCH_GDR_STRICT", "1")
    with pytest.raises(PyptoBackendError, match="cannot serve"):
        torch_gdr.chunk_gated_delta_rule(**_inputs(**changes))


def test_device_orders_and_pypto_refuses_other_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    assert registry.resolve_backend(None, torch.device("cpu")) == "cpu"
    assert registry.device_order("chunk", torch.device("cpu")) == ("cpu", "torch")
    assert registry.default_backend(torch.device("cuda")) == "fla"
    assert registry.device_order("chunk", torch.device("meta")) == ("torch",)
    for npu_type in ("npu", "privateuseone"):
        assert registry.default_backend(SimpleNamespace(type=npu_type)) == "pypto"
    q = torch.empty(1, 1, 1, 64, device="meta")
    reasons = BACKENDS["pypto"].unsupported_reasons(CallSpec.of("chunk", q, q, 64, False))
    assert any("not on 'meta'" in r.text for r in reasons)


def test_broken_torch_npu_means_no_npu_and_never_loads_at_import(tmp_path: Path) -> None:
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('Failed to load the backend extension: libhccl.so')\n")
    script = textwrap.dedent("""
        import sys
        import torch_gdr
        assert "torch_npu" not in sys.modules, "torch_npu imported at package import"
        from torch_gdr.dispatch import npu_available
        assert npu_available() is False
        print("ok")
    """)
    env_path = f"{tmp_path}:{REPO_ROOT}"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@needs_pypto
@on_pypto_device
def test_pypto_public_call_matches_reference_and_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched (non-varlen) fp16 input, value-first state: the layout work around the kernel."""
    kernel_cache.cache_clear()
    inputs = make_inputs(batch_size=2, seq_len=70, num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                         with_initial_state=True, dtype=torch.float16)
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).float().contiguous()
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True, scale=0.2)
    expected_o, expected_s = torch_gdr.chunk_gated_delta_rule(**inputs, **kwargs, backend="torch")
    for _ in range(2):
        o, s = torch_gdr.chunk_gated_delta_rule(**inputs, **kwargs, backend="pypto")
        assert o.dtype == torch.float16 and s.shape == expected_s.shape
        torch.testing.assert_close(o.float(), expected_o.float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(s, expected_s, atol=1e-4, rtol=1e-3)
    info = kernel_cache.cache_info()
    assert (info.misses, info.hits, len(info.keys)) == (1, 1, 1)
    assert info.keys[0].num_seqs == 2 and info.keys[0].num_v_heads == 2 and info.keys[0].chunk_size == 64


def _kernel_failing_at_run_time(monkeypatch: pytest.MonkeyPatch) -> str:
    """The "pypto" backend (``may_fail``) serves every call it takes, and its chunked kernel
    raises inside the call: a failure at run time, not a reason found at selection."""
    message = "simulated kernel failure at run time"

    def failing_forward(*args):
        raise RuntimeError(message)

    monkeypatch.setattr(BACKENDS["pypto"], "extra_reasons", None)  # installed or not: served
    monkeypatch.setattr(BACKENDS["pypto"], "forward_op", failing_forward)
    return message


@on_pypto_device
def test_strict_mode_raises_for_a_kernel_failing_at_run_time(npu_host, monkeypatch: pytest.MonkeyPatch) -> None:
    """A may_fail backend chosen by default whose kernel fails inside the call: in strict
    mode the call raises the backend's error (with the failure as its cause); without it, one
    warning and the "torch" backend's result, the recurrence's."""
    from torch_gdr.ref import naive_recurrent_gated_delta_rule

    message = _kernel_failing_at_run_time(monkeypatch)
    inputs = _inputs(seqlens=[5, 3], head_k_dim=64, head_v_dim=64)
    monkeypatch.setenv("TORCH_GDR_STRICT", "1")
    with pytest.raises(PyptoBackendError, match=rf"backend 'pypto' cannot serve .*RuntimeError: {message}") as info:
        torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True)
    assert isinstance(info.value.__cause__, RuntimeError)
    monkeypatch.delenv("TORCH_GDR_STRICT")
    with pytest.warns(PyptoFallbackWarning, match=re.escape(message)):
        o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True)
    exact_o, exact_s = naive_recurrent_gated_delta_rule(
        **{n: (t.double() if t.is_floating_point() else t) for n, t in inputs.items()})
    torch.testing.assert_close(o.double(), exact_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), exact_s, atol=1e-5, rtol=1e-5)
    with pytest.raises(PyptoBackendError, match=re.escape(message)):  # named: an error too
        torch_gdr.chunk_gated_delta_rule(**inputs, backend="pypto")
