"""The public call and the registered op: layouts, dtypes, aliases, the backend variable.
(Gradients and the torch.library checks of every op: test_backward.py; compile: test_compile.py.)"""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import make_inputs, rmse_ratio
from torch_gdr.ref import naive_recurrent_gated_delta_rule

def test_state_v_first_is_the_transpose() -> None:
    inputs = make_inputs(batch_size=2, seq_len=30, head_k_dim=8, head_v_dim=12, with_initial_state=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True)
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    o_vf, s_vf = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, state_v_first=True)
    assert s_vf.shape == (2, 2, 12, 8)
    torch.testing.assert_close(o_vf, o, atol=0, rtol=0)
    torch.testing.assert_close(s_vf, s.transpose(-1, -2), atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
def test_token_major_layout_equals_batched(backend: str) -> None:
    batched = make_inputs(seqlens=[7, 25], with_initial_state=True)
    token_major = {n: (t.squeeze(0) if n in ("q", "k", "v", "g", "beta") else t) for n, t in batched.items()}
    o, s = torch_gdr.chunk_gated_delta_rule(**batched, output_final_state=True, backend=backend)
    o_tnd, s_tnd = torch_gdr.chunk_gated_delta_rule(**token_major, output_final_state=True, backend=backend)
    assert o_tnd.shape == batched["v"].shape[1:]
    torch.testing.assert_close(o_tnd, o.squeeze(0), atol=0, rtol=0)
    torch.testing.assert_close(s_tnd, s, atol=0, rtol=0)


def test_final_state_only_on_request_and_aliases() -> None:
    inputs = make_inputs(seq_len=20)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs)
    assert s is None and o.shape == inputs["v"].shape
    assert torch_gdr.chunked_gated_delta_rule is torch_gdr.chunk_gated_delta_rule
    o_op, s_op = torch.ops.gdr.chunked_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"],
                                                        inputs["beta"])
    torch.testing.assert_close(o_op, o, atol=0, rtol=0)
    assert s_op.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_within_fla_error(dtype: torch.dtype) -> None:
    inputs = make_inputs(seqlens=[100, 37], num_qk_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32,
                         with_initial_state=True)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    low = {n: (t.to(dtype) if n in ("q", "k", "v", "g", "beta") else t) for n, t in inputs.items()}
    low["initial_state"] = inputs["initial_state"].to(dtype)
    o, s = torch_gdr.chunk_gated_delta_rule(**low, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rmse_ratio(expected_o, o) < 5e-3
    assert rmse_ratio(expected_s, s) < 5e-3


def test_initial_state_gradient_keeps_its_dtype() -> None:
    inputs = make_inputs(seq_len=20, with_initial_state=True, dtype=torch.float32)
    h0 = inputs.pop("initial_state").half().requires_grad_()
    _, s = torch_gdr.chunk_gated_delta_rule(**inputs, initial_state=h0, output_final_state=True)
    s.sum().backward()
    assert h0.grad is not None and h0.grad.dtype == torch.float16 and torch.isfinite(h0.grad).all()


def test_int32_cu_seqlens_equals_int64() -> None:
    inputs = make_inputs(seqlens=[12, 3, 30])
    o64, _ = torch_gdr.chunk_gated_delta_rule(**inputs)
    inputs["cu_seqlens"] = inputs["cu_seqlens"].int()
    o32, _ = torch_gdr.chunk_gated_delta_rule(**inputs)
    torch.testing.assert_close(o32, o64, atol=0, rtol=0)


def test_backend_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = make_inputs(seq_len=10)
    monkeypatch.setenv("TORCH_GDR_BACKEND", "recurrent")
    o_env, _ = torch_gdr.chunk_gated_delta_rule(**inputs)
    o_rec, _ = torch_gdr.chunk_gated_delta_rule(**inputs, backend="recurrent")
    assert torch.equal(o_env, o_rec)
    monkeypatch.setenv("TORCH_GDR_BACKEND", "nope")
    with pytest.raises(ValueError, match="TORCH_GDR_BACKEND"):
        torch_gdr.chunk_gated_delta_rule(**inputs)


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
@pytest.mark.parametrize(("qk_dtype", "v_dtype"), [(torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                                   (torch.bfloat16, torch.float16)], ids=str)
def test_mixed_qk_and_v_dtypes_as_fla_takes_them(qk_dtype: torch.dtype, v_dtype: torch.dtype, backend: str) -> None:
    """q/k in one float dtype, v in another: the result (o in v's dtype) and every gradient
    (each in its input's dtype) equal the call with the inputs converted up front to the
    compute dtype, float32 (up to rounding: the two may run different kernels, e.g. the fused
    CPU kernels take one dtype for q and v)."""
    inputs = make_inputs(seqlens=[30, 0, 17], num_qk_heads=1, num_v_heads=2, with_initial_state=True,
                         dtype=torch.float32)
    mixed = dict(inputs, q=inputs["q"].to(qk_dtype), k=inputs["k"].to(qk_dtype), v=inputs["v"].to(v_dtype))
    up_front = {n: (t.float() if t.is_floating_point() else t) for n, t in mixed.items()}
    results = []
    for case in (mixed, up_front):
        leaves = {n: (t.clone().requires_grad_() if t.is_floating_point() else t) for n, t in case.items()}
        o, s = torch_gdr.chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                chunk_size=16, backend=backend)
        (o.float().sum() + s.sum()).backward()  # linear: the same grad_o whatever o's rounding
        results.append((o, s, {n: leaves[n].grad for n in ("q", "k", "v", "g", "beta", "initial_state")}))
    (o, s, grads), (o_ref, s_ref, grads_ref) = results
    assert o.dtype == v_dtype
    torch.testing.assert_close(o.float(), o_ref.to(v_dtype).float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-6, rtol=1e-6)
    for n, grad in grads.items():
        assert grad.dtype == mixed[n].dtype, n
        torch.testing.assert_close(grad.float(), grads_ref[n].to(grad.dtype).float(), atol=1e-6, rtol=1e-6, msg=n)


@pytest.fixture
def cpu_step_calls(monkeypatch) -> list:
    """Counts the calls of the fused C++ step (``torch_gdr.ops.cpu.kernels.recurrent_fwd``)."""
    from torch_gdr.ops.cpu import kernels

    calls = []
    real = kernels.recurrent_fwd

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "recurrent_fwd", counting)
    return calls


STEP_CASES = {  # make_inputs keyword arguments: decode batches and short prompts, GVA
    "decode_batch": dict(batch_size=3, seq_len=1, num_qk_heads=1, num_v_heads=4),
    "short_prompt": dict(batch_size=2, seq_len=9, num_qk_heads=2, num_v_heads=4),
    "varlen": dict(seqlens=[1, 3, 1, 10], num_qk_heads=1, num_v_heads=2),
}


@pytest.mark.parametrize("state_v_first", [False, True], ids=["key_first", "v_first"])
@pytest.mark.parametrize("use_l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("case", list(STEP_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_exported_fused_recurrent_without_grad_matches_the_recurrence(cpu_step_calls, dtype, case,
                                                                         use_l2norm, state_v_first) -> None:
    """The exported ``fused_recurrent_gated_delta_rule`` as a decode loop calls it: float32 or
    bfloat16 inputs, no autograd (the fused C++ step on the CPU), a scale of the caller's
    and a state in either layout; against the float64 recurrence on the same rounded inputs."""
    inputs = make_inputs(**STEP_CASES[case], with_initial_state=True, initial_state_scale=0.5)
    if not use_l2norm:
        inputs["q"], inputs["k"] = inputs["q"] * 0.25, inputs["k"] * 0.25
    rounded = {n: (t if n == "cu_seqlens" else t.to(torch.float32 if n == "initial_state" else dtype))
               for n, t in inputs.items()}
    expected_o, expected_s = naive_recurrent_gated_delta_rule(
        **{n: (t if n == "cu_seqlens" else t.double()) for n, t in rounded.items()}, scale=0.37,
        use_qk_l2norm_in_kernel=use_l2norm)
    if state_v_first:
        rounded["initial_state"] = rounded["initial_state"].transpose(-1, -2).contiguous()
    with torch.no_grad():
        o, s = torch_gdr.fused_recurrent_gated_delta_rule(**rounded, scale=0.37, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=use_l2norm,
                                                          state_v_first=state_v_first)
    if state_v_first:
        s = s.transpose(-1, -2)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rmse_ratio(expected_o, o) < (1e-6 if dtype == torch.float32 else 5e-3)
    assert rmse_ratio(expected_s, s) < 1e-6
    from torch_gdr.ops.cpu import kernels

    if o.device.type == "cpu" and kernels.available():
        assert cpu_step_calls, "the fused C++ step did not run"


def test_the_exported_fused_recurrent_leaves_empty_sequences_without_a_state_at_zero(cpu_step_calls) -> None:
    """Empty sequences of a varlen call with no initial state: their final state is zeros (the
    state of no tokens), whatever the memory the result was allocated in held before; the
    fused C++ step (float32, no autograd) after calls that left nonzero states behind."""
    with_state = make_inputs(seqlens=[2, 0, 3, 0, 0], num_qk_heads=1, num_v_heads=2, dtype=torch.float32,
                             with_initial_state=True, initial_state_scale=100.0)
    without = {n: t for n, t in with_state.items() if n != "initial_state"}
    expected_o, expected_s = naive_recurrent_gated_delta_rule(
        **{n: (t if n == "cu_seqlens" else t.double()) for n, t in without.items()})
    for _ in range(4):
        with torch.no_grad():
            torch_gdr.fused_recurrent_gated_delta_rule(**dict(with_state, initial_state=with_state["initial_state"]
                                                              .float()), output_final_state=True)
            o, s = torch_gdr.fused_recurrent_gated_delta_rule(**without, output_final_state=True)
        assert torch.equal(s[[1, 3, 4]], torch.zeros_like(s[[1, 3, 4]]))
        assert rmse_ratio(expected_s, s) < 1e-6 and rmse_ratio(expected_o, o) < 1e-6
    from torch_gdr.ops.cpu import kernels

    if kernels.available():
        assert cpu_step_calls, "the fused C++ step did not run"
