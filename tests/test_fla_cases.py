"""fla-core 0.6's gated delta rule cases (its ``tests/ops/test_gdn.py``), re-expressed on
torch_gdr's default CPU dispatch with fla's shapes, dtypes and error bounds.

Each case runs the public function the way fla's test calls fla's, and compares with the
float64 per-token recurrence on the same rounded inputs, the activations written out by
hand. Shapes of fla's list with thousands of tokens are slow-marked. fla's cases of its own
internals (WY representation, FlashQLA backend, GPU-generation guards) have no counterpart.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr.ref import naive_recurrent_gated_delta_rule
from torch_gdr.testing import make_inputs, rmse_ratio

#: fla's bounds on rms(ref - out) / rms(ref), by output
BOUNDS = {"o": 0.005, "final_state": 0.005, "q": 0.008, "k": 0.008, "v": 0.008, "initial_state": 0.008,
          "beta": 0.02, "g": 0.02, "A_log": 0.02, "dt_bias": 0.02}
#: fla's tighter bounds in its step tests (o and the final state)
STEP_BOUND = 0.002


def _case(entry: str, *, seqlens: Optional[list[int]] = None, B: int = 1, T: int = 0, H: int = 1, HV: int = 1,
          D: int = 64, dtype: torch.dtype = torch.float16, scale: Optional[float] = None, gate: bool = False,
          dt_bias: bool = False, beta_sigmoid: bool = False, neg_eigval: bool = False, l2norm: bool = True,
          v_first: bool = False, grads: bool = True, seed: int = 42):
    """One fla case; returns nothing, asserts fla's bounds."""
    shape = dict(seqlens=seqlens) if seqlens is not None else dict(batch_size=B, seq_len=T)
    x = make_inputs(**shape, num_qk_heads=H, num_v_heads=HV, head_k_dim=D, head_v_dim=D, with_initial_state=True,
                    normalize_qk=not l2norm, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    options: dict = dict(scale=scale, use_qk_l2norm_in_kernel=l2norm, state_v_first=v_first)
    if gate:
        x["g"] = torch.randn(x["g"].shape, generator=gen, dtype=torch.float64)
        x["A_log"] = torch.empty(HV, dtype=torch.float64).uniform_(1, 16, generator=gen).log()
        if dt_bias:
            x["dt_bias"] = torch.randn(HV, generator=gen, dtype=torch.float64)
        options["use_gate_in_kernel"] = True
    if beta_sigmoid:
        x["beta"] = torch.randn(x["beta"].shape, generator=gen, dtype=torch.float64)
        options.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval)
    if v_first:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    # q, k, v in the case's dtype; gates, beta, A_log, dt_bias and the state in float32, as fla's tests
    call = {n: (t.to(dtype) if n in ("q", "k", "v") else t.float() if t.is_floating_point() else t)
            for n, t in x.items()}
    exact = {n: (t.double() if t.is_floating_point() else t) for n, t in call.items()}
    leaves = {n: (t.clone().requires_grad_(grads) if t.is_floating_point() else t) for n, t in call.items()}
    exact_leaves = {n: (t.clone().requires_grad_(grads) if t.is_floating_point() else t) for n, t in exact.items()}

    with torch.set_grad_enabled(grads):
        if entry == "chunk":
            o, s = torch_gdr.chunk_gated_delta_rule(**leaves, output_final_state=True, **options)
        else:
            o, s = torch_gdr.fused_recurrent_gated_delta_rule(**leaves, output_final_state=True, **options)

        g, beta = exact_leaves["g"], exact_leaves["beta"]
        if gate:
            raw = g + exact_leaves["dt_bias"] if dt_bias else g
            g = -exact_leaves["A_log"].exp() * F.softplus(raw)
        if beta_sigmoid:
            beta = beta.sigmoid() * (2.0 if neg_eigval else 1.0)
        h0 = exact_leaves["initial_state"]
        ro, rs = naive_recurrent_gated_delta_rule(
            exact_leaves["q"], exact_leaves["k"], exact_leaves["v"], g, beta, scale=scale,
            initial_state=h0.transpose(-1, -2) if v_first else h0, use_qk_l2norm_in_kernel=l2norm,
            cu_seqlens=x.get("cu_seqlens"))
        if v_first:
            rs = rs.transpose(-1, -2)
    forward_bound = STEP_BOUND if entry == "step" else BOUNDS["o"]
    assert rmse_ratio(ro, o) < forward_bound and rmse_ratio(rs, s) < forward_bound
    if not grads:
        return
    gen = torch.Generator().manual_seed(seed + 2)
    weights = torch.randn(ro.shape, generator=gen, dtype=torch.float64), torch.randn(rs.shape, generator=gen,
                                                                                      dtype=torch.float64)
    ((o.double() * weights[0]).sum() + (s.double() * weights[1]).sum()).backward()
    ((ro * weights[0]).sum() + (rs * weights[1]).sum()).backward()
    for name, leaf in leaves.items():
        if leaf.is_floating_point():
            assert rmse_ratio(exact_leaves[name].grad, leaf.grad) < BOUNDS[name], name


def _slow_when_long(*cases: tuple) -> list:
    """pytest params: cases of more than 600 tokens in all are slow."""
    params = []
    for case in cases:
        tokens = sum(case[0]["seqlens"]) if "seqlens" in case[0] else case[0]["B"] * case[0]["T"]
        params.append(pytest.param(*case, marks=[pytest.mark.slow] if tokens > 600 else []))
    return params


def _varlen(offsets: list[int]) -> list[int]:
    return [b - a for a, b in zip(offsets[:-1], offsets[1:])]


# fla's test_chunk_gate_in_kernel, _gqa and _varlen: (B, T, H, D, scale, dt_bias, l2norm), HV = H or GQA
@pytest.mark.parametrize("shape, options", _slow_when_long(
    (dict(B=2, T=75, H=4, HV=4, D=64), dict(scale=1.0, dt_bias=True, l2norm=True)),
    (dict(B=2, T=500, H=3, HV=3, D=60), dict(scale=1.0, l2norm=False)),
    (dict(B=3, T=1024, H=4, HV=4, D=100), dict(scale=1.0, dt_bias=True, l2norm=True)),
    (dict(B=4, T=1024, H=4, HV=4, D=128), dict(scale=0.1, l2norm=True)),
    (dict(B=2, T=256, H=2, HV=4, D=64), dict(scale=1.0, dt_bias=True)),
    (dict(B=2, T=512, H=2, HV=8, D=64), dict(scale=0.1, dt_bias=True)),
    (dict(seqlens=_varlen([0, 15]), H=4, HV=4, D=60), dict(dt_bias=True)),
    (dict(seqlens=_varlen([0, 256, 500, 1000]), H=4, HV=4, D=64), dict()),
    (dict(seqlens=_varlen([0, 15, 100, 300, 1200, 2000]), H=4, HV=4, D=100), dict(dt_bias=True)),
))
def test_chunk_gate_in_kernel(shape: dict, options: dict) -> None:
    _case("chunk", gate=True, **shape, **options)


# fla's test_chunk_beta_sigmoid_in_kernel: beta logits, with and without allow_neg_eigval
@pytest.mark.parametrize("shape, options", _slow_when_long(
    (dict(B=2, T=75, H=4, HV=4, D=64), dict(neg_eigval=False)),
    (dict(B=2, T=75, H=4, HV=4, D=64), dict(neg_eigval=True, scale=0.1)),
    (dict(B=3, T=1024, H=4, HV=4, D=128), dict(neg_eigval=True, scale=0.1)),
    (dict(B=2, T=256, H=2, HV=4, D=60), dict(neg_eigval=True, l2norm=False)),
))
def test_chunk_beta_sigmoid_in_kernel(shape: dict, options: dict) -> None:
    _case("chunk", beta_sigmoid=True, **shape, **options)


# fla's test_fused_recurrent_gate_in_kernel[_varlen] and _beta_sigmoid_in_kernel: the step,
# inference on the CPU kernels (fla's step cases check the forward)
@pytest.mark.parametrize("shape, options", _slow_when_long(
    (dict(B=1, T=64, H=1, HV=1, D=64, dtype=torch.float32), dict(gate=True, scale=1.0)),
    (dict(B=2, T=256, H=2, HV=2, D=64, dtype=torch.float32), dict(gate=True, dt_bias=True)),
    (dict(B=2, T=512, H=2, HV=4, D=64), dict(gate=True, dt_bias=True, scale=0.1)),
    (dict(B=3, T=1000, H=2, HV=8, D=128), dict(gate=True)),
    (dict(seqlens=_varlen([0, 15, 100, 300]), H=2, HV=4, D=60), dict(gate=True, dt_bias=True)),
    (dict(B=2, T=100, H=2, HV=4, D=100, dtype=torch.float32), dict(beta_sigmoid=True, neg_eigval=True)),
    (dict(B=2, T=100, H=2, HV=2, D=64), dict(beta_sigmoid=True)),
))
def test_fused_recurrent_activations_in_kernel(shape: dict, options: dict) -> None:
    _case("step", grads=False, **shape, **options)


# fla's test_chunk_state_v_first and test_fused_recurrent_state_v_first
@pytest.mark.parametrize("entry", ["chunk", "step"])
@pytest.mark.parametrize("shape", [dict(B=2, T=75, H=2, HV=2, D=64), dict(seqlens=[15, 85], H=1, HV=2, D=60)])
def test_state_v_first(entry: str, shape: dict) -> None:
    _case(entry, v_first=True, grads=entry == "chunk", **shape)


# fla's test_chunk_varlen_prefill: inference over packed prompts, one of 8192 tokens
@pytest.mark.parametrize("shape", _slow_when_long(
    (dict(seqlens=_varlen([0, 15]), H=4, HV=4, D=60),),
    (dict(seqlens=_varlen([0, 256, 500, 1000]), H=4, HV=4, D=64),),
    (dict(seqlens=_varlen([0, 8192]), H=4, HV=4, D=60),),
))
def test_chunk_varlen_prefill(shape: dict) -> None:
    _case("chunk", grads=False, **shape)
