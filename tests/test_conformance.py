"""One conformance suite: every entry point on every backend this machine has, against the
float64 per-token recurrence on the same (rounded) inputs.

Entry points: the chunked call (outputs, final state, every gradient where the backend has a
backward), the token-by-token step, and the public op. Cases vary what a backend may get
wrong: scale, GVA, K != V, varlen with an empty sequence, no initial state, token-major
tensors, value-first states, bfloat16, head sizes from 60 to 256 with K != V. The PyPTO interpreter runs a slow subset (K = V = 64).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import torch_gdr
from torch_gdr.dispatch import BACKENDS, CallSpec, reason_text
from torch_gdr.ref import naive_recurrent_gated_delta_rule
from torch_gdr.testing import make_inputs, rmse_ratio

#: case: (make_inputs arguments, call options)
CASES: dict[str, tuple[dict, dict]] = {
    "batched_gva_scale": (dict(batch_size=2, seq_len=37, num_qk_heads=1, num_v_heads=3, with_initial_state=True),
                          dict(scale=0.3)),
    "varlen_empty_no_h0": (dict(seqlens=[17, 0, 40, 1]), dict()),
    "k_ne_v_l2norm": (dict(seq_len=30, head_k_dim=16, head_v_dim=24, with_initial_state=True),
                      dict(use_qk_l2norm_in_kernel=True)),
    "token_major_v_first": (dict(seqlens=[21, 12], token_major=True, with_initial_state=True),
                            dict(state_v_first=True)),
    # head sizes users run (fla's range is K, V <= 256, K != V; 60 and 100 are fla's test sizes)
    "k256_v256": (dict(seqlens=[9, 14], num_qk_heads=1, num_v_heads=1, head_k_dim=256, head_v_dim=256,
                       with_initial_state=True), dict(use_qk_l2norm_in_kernel=True)),
    "k64_v128": (dict(batch_size=2, seq_len=19, num_qk_heads=1, head_k_dim=64, head_v_dim=128),
                 dict(use_qk_l2norm_in_kernel=True)),
    "k128_v64": (dict(seq_len=21, num_qk_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=64,
                      with_initial_state=True), dict(use_qk_l2norm_in_kernel=True)),
    "k60_v100": (dict(seqlens=[17, 0, 12], num_qk_heads=1, head_k_dim=60, head_v_dim=100, with_initial_state=True),
                 dict(use_qk_l2norm_in_kernel=True, scale=0.2)),
    # K = 1 without the l2norm: its gradient there is zero up to the epsilon, no measure of anything
    "k1_v3": (dict(seq_len=13, num_qk_heads=1, head_k_dim=1, head_v_dim=3, normalize_qk=True), dict()),
}
PYPTO_CASE = (dict(seqlens=[40, 0, 9], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                   with_initial_state=True), dict(use_qk_l2norm_in_kernel=True, scale=0.2, state_v_first=True))

#: rmse ratio against the float64 recurrence on the same rounded inputs, by input dtype
FORWARD_BOUND = {torch.float32: 2e-5, torch.bfloat16: 5e-3}
GRAD_BOUND = {torch.float32: 1e-4, torch.bfloat16: 8e-3}


def _serves(backend: str, entry: str, inputs: dict, grad: bool = False) -> Optional[str]:
    reasons = BACKENDS[backend].unsupported_reasons(CallSpec.of(entry, inputs["q"], inputs["v"], 32, grad))
    return reason_text(reasons) or None


def _params() -> list:
    params = []
    for backend in ("torch", "cpu", "recurrent", "fla"):
        for case in CASES:
            for dtype in (torch.float32, torch.bfloat16):
                params.append(pytest.param(backend, case, dtype, id=f"{backend}-{case}-{str(dtype)[6:]}"))
    params.append(pytest.param("pypto", "pypto", torch.float32, id="pypto-interpreter", marks=pytest.mark.slow))
    return params


def _inputs(case: str, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    """(inputs in ``dtype``, the same values in float64, call options). The initial state is
    float32 (the state's dtype)."""
    spec, options = PYPTO_CASE if case == "pypto" else CASES[case]
    exact = make_inputs(**spec)
    if options.get("state_v_first") and "initial_state" in exact:
        exact["initial_state"] = exact["initial_state"].transpose(-1, -2).contiguous()
    rounded = {n: (t.to(dtype) if n in ("q", "k", "v", "g", "beta") else
                   t.float() if n == "initial_state" else t) for n, t in exact.items()}
    exact = {n: (t.to(dtype).double() if n in ("q", "k", "v", "g", "beta") else
                 t.float().double() if n == "initial_state" else t) for n, t in exact.items()}
    return rounded, exact, dict(options)


def _reference(exact: dict, options: dict, grads: bool):
    """The recurrence in float64 (batched layout, key-first state), outputs in the caller's layouts."""
    token_major = exact["q"].dim() == 3
    x = {n: (t.unsqueeze(0) if token_major and n in ("q", "k", "v", "g", "beta") else t) for n, t in exact.items()}
    v_first = options.get("state_v_first", False)
    if v_first and "initial_state" in x:
        x["initial_state"] = x["initial_state"].transpose(-1, -2)
    o, s = naive_recurrent_gated_delta_rule(**x, scale=options.get("scale"),
                                            use_qk_l2norm_in_kernel=options.get("use_qk_l2norm_in_kernel", False))
    if token_major:
        o = o.squeeze(0)
    return o, (s.transpose(-1, -2) if v_first else s)


def _leaves(x: dict) -> dict:
    return {n: (t.detach().clone().requires_grad_() if t.is_floating_point() else t) for n, t in x.items()}


def _loss(o: torch.Tensor, s: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (o.double() * weights[0]).sum() + (s.double() * weights[1]).sum()


@pytest.mark.parametrize("backend, case, dtype", _params())
def test_chunked_call_forward_and_gradients(backend: str, case: str, dtype: torch.dtype) -> None:
    x, exact, options = _inputs(case, dtype)
    reason = _serves(backend, "chunk", x)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    chunk_size = 32 if case == "pypto" else 16
    leaves = _leaves(x)
    grads = _serves(backend, "chunk", x, grad=True) is None and (backend, case) != ("pypto", "pypto")
    with torch.set_grad_enabled(grads):
        o, s = torch_gdr.chunk_gated_delta_rule(**(leaves if grads else x), output_final_state=True,
                                                chunk_size=chunk_size, backend=backend, **options)
    exact_leaves = _leaves(exact)
    ro, rs = _reference(exact_leaves, options, grads)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape and s.dtype == torch.float32 and s.shape == rs.shape
    assert rmse_ratio(ro, o) < FORWARD_BOUND[dtype] and rmse_ratio(rs, s) < FORWARD_BOUND[dtype]
    if not grads:
        return
    gen = torch.Generator().manual_seed(5)
    weights = (torch.randn(ro.shape, generator=gen, dtype=torch.float64),
               torch.randn(rs.shape, generator=gen, dtype=torch.float64))
    _loss(o, s, weights).backward()
    _loss(ro, rs, weights).backward()
    for name, leaf in leaves.items():
        if leaf.is_floating_point():
            assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
            assert rmse_ratio(exact_leaves[name].grad, leaf.grad) < GRAD_BOUND[dtype], name


@pytest.mark.parametrize("backend, case, dtype", _params())
def test_token_by_token_step(backend: str, case: str, dtype: torch.dtype) -> None:
    x, exact, options = _inputs(case, dtype)
    reason = _serves(backend, "step", x)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    with torch.no_grad():
        o, s = torch_gdr.fused_recurrent_gated_delta_rule(**x, output_final_state=True, backend=backend, **options)
    ro, rs = _reference(exact, options, False)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape and s.shape == rs.shape
    assert rmse_ratio(ro, o) < FORWARD_BOUND[dtype] and rmse_ratio(rs, s) < FORWARD_BOUND[dtype]
    if "initial_state" in x:  # the caller's state is never written
        assert torch.equal(x["initial_state"], exact["initial_state"].float())


@pytest.mark.parametrize("case", list(CASES))
def test_the_public_op(case: str) -> None:
    x, exact, options = _inputs(case, torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], options.get("scale"), x.get("initial_state"), True,
            options.get("use_qk_l2norm_in_kernel", False), x.get("cu_seqlens"), 16,
            options.get("state_v_first", False))
    o, s = torch.ops.gdr.chunked_gated_delta_rule(*args)
    ro, rs = _reference(exact, options, False)
    assert rmse_ratio(ro, o) < FORWARD_BOUND[torch.float32] and rmse_ratio(rs, s) < FORWARD_BOUND[torch.float32]
