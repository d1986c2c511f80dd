"""The public call and the registered op: layouts, dtypes, gradients, torch.library checks."""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import make_inputs, rmse_ratio
from torch_gdr.ref import naive_recurrent_gated_delta_rule

DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state")


def _loss_and_grads(fn, inputs: dict, seed: int = 1, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(o * do).sum() + (final_state * dht).sum()`` and its gradients, the usual check."""
    leaves = {n: t.detach().clone().requires_grad_() if n in DIFFERENTIABLE else t for n, t in inputs.items()}
    o, s = fn(**leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
    dht = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.device, s.dtype)
    loss = (o * do).sum() + (s * dht).sum()
    params = [leaves[n] for n in DIFFERENTIABLE if n in leaves]
    return loss, list(torch.autograd.grad(loss, params))


GRAD_CASES = {
    "batch_initial_state": dict(batch_size=2, seq_len=45, with_initial_state=True),
    "gva_varlen": dict(seqlens=[17, 0, 1, 40], num_qk_heads=1, num_v_heads=4, with_initial_state=True),
    "k_ne_v_strong": dict(seq_len=33, head_k_dim=8, head_v_dim=12, gate="strong", with_initial_state=True),
    "zero_decay": dict(seq_len=33, gate="zero"),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_match_recurrence_fp64(case: str) -> None:
    inputs = make_inputs(**GRAD_CASES[case])
    kwargs = dict(use_qk_l2norm_in_kernel=True, chunk_size=16)
    _, expected = _loss_and_grads(naive_recurrent_gated_delta_rule, inputs, use_qk_l2norm_in_kernel=True)
    _, actual = _loss_and_grads(torch_gdr.chunk_gated_delta_rule, inputs, **kwargs)
    for name, e, a in zip(DIFFERENTIABLE, expected, actual):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=1e-9, rtol=1e-9, msg=lambda m: f"d{name}: {m}")


def test_gradcheck_every_input_fp64() -> None:
    inputs = make_inputs(seqlens=[5, 0, 9], num_qk_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3,
                         with_initial_state=True)
    cu_seqlens = inputs.pop("cu_seqlens")
    names = list(DIFFERENTIABLE)
    leaves = [inputs[n].detach().clone().requires_grad_() for n in names]

    def fn(*tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kw = dict(zip(names, tensors))
        return torch_gdr.chunk_gated_delta_rule(**kw, output_final_state=True, cu_seqlens=cu_seqlens,
                                                use_qk_l2norm_in_kernel=True, chunk_size=16)

    assert torch.autograd.gradcheck(fn, leaves, atol=1e-8)


@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("output_final_state", [False, True])
def test_opcheck(state_v_first: bool, output_final_state: bool) -> None:
    inputs = make_inputs(seqlens=[9, 0, 20], num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=4,
                         with_initial_state=True, dtype=torch.float32)
    state = inputs["initial_state"].float()
    if state_v_first:
        state = state.transpose(-1, -2).contiguous()
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None, state.requires_grad_(),
            output_final_state, True, inputs["cu_seqlens"], 16, state_v_first)
    for t in args[:5]:
        t.requires_grad_()
    torch.library.opcheck(torch.ops.gdr.chunked_gated_delta_rule.default, args)


def test_torch_compile_fullgraph_forward_and_backward() -> None:
    inputs = make_inputs(seqlens=[10, 30], num_qk_heads=1, num_v_heads=2, dtype=torch.float32)
    v = inputs.pop("v").requires_grad_()

    def run(v: torch.Tensor) -> torch.Tensor:
        o, s = torch_gdr.chunk_gated_delta_rule(v=v, **inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return (o * o).sum() + s.sum()

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    got = compiled(v)
    (grad_got,) = torch.autograd.grad(got, v)
    want = run(v)
    (grad_want,) = torch.autograd.grad(want, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad_got, grad_want)


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
