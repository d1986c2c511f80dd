"""Extreme inputs: decays down to a full reset (g = -inf) and non-finite values, against the
recurrence."""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import make_inputs
from torch_gdr.ops.cpu import kernels as cpu_kernels
from torch_gdr.ops.pypto import is_pypto_available
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

BACKENDS = ["torch", "recurrent"]
# the fused CPU kernels too, whose containment is skipped where they saw every input finite
CONTAINING_BACKENDS = BACKENDS + [pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_kernels.available(), reason="the fused CPU kernels are unavailable"))]


def _extreme_gates(g: torch.Tensor, big: float) -> torch.Tensor:
    """g = -0.01 everywhere, every 7th token at ``big``: within a chunk, cumulative sums of
    these cancel in float32 when differenced."""
    gates = torch.full_like(g, -0.01)
    gates[:, ::7] = big
    return gates


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("big", [-1e3, -1e4, -1e5, -1e6, float("-inf")])
def test_extreme_decays_keep_the_recurrences_accuracy(big: float, chunk_size: int, backend: str) -> None:
    inputs = make_inputs(seq_len=200, num_qk_heads=1, num_v_heads=2, dtype=torch.float32, with_initial_state=True)
    inputs["g"] = _extreme_gates(inputs["g"], big)
    exact_o, exact_s = naive_recurrent_gated_delta_rule(**{n: t.double() for n, t in inputs.items()},
                                                        use_qk_l2norm_in_kernel=True)
    fp32_o, _ = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            chunk_size=chunk_size, backend=backend)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    recurrence_err = (fp32_o.double() - exact_o).abs().max().item()
    bound = max(4 * recurrence_err, 1e-6)
    assert (o.double() - exact_o).abs().max().item() <= bound
    assert (s.double() - exact_s).abs().max().item() <= 4 * bound


@pytest.mark.parametrize("big", [-1e6, float("-inf")])
def test_gradients_under_extreme_decays(big: float) -> None:
    inputs = make_inputs(seqlens=[100, 37], num_qk_heads=1, num_v_heads=2, with_initial_state=True)
    inputs["g"] = _extreme_gates(inputs["g"], big)
    grads = {}
    for name, fn in (("reference", naive_recurrent_gated_delta_rule), ("torch", torch_gdr.chunk_gated_delta_rule)):
        leaves = {n: (t.clone().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
        o, s = fn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  **({} if name == "reference" else dict(chunk_size=32)))
        (o.sin().sum() + s.square().sum()).backward()
        grads[name] = {n: t.grad for n, t in leaves.items() if t.is_floating_point()}
    for n, expected in grads["reference"].items():
        assert torch.isfinite(grads["torch"][n]).all(), n
        torch.testing.assert_close(grads["torch"][n], expected, atol=1e-10, rtol=1e-10, msg=n)


# name: (tensor, index into [B, T, ...], value)
NONFINITE = {
    "v_nan": ("v", (0, 50, 1, 3), float("nan")),
    "v_inf_second_sequence": ("v", (0, 210, 1, 3), float("inf")),
    "k_inf": ("k", (0, 77, 0, 2), float("inf")),
    "beta_nan": ("beta", (0, 120, 0), float("nan")),
    "g_nan": ("g", (0, 33, 1), float("nan")),
    "g_plus_inf": ("g", (0, 33, 1), float("inf")),
    "q_nan": ("q", (0, 70, 0, 1), float("nan")),
}


@pytest.mark.parametrize("backend", CONTAINING_BACKENDS)
@pytest.mark.parametrize("case", list(NONFINITE))
def test_a_nonfinite_input_spreads_only_as_in_the_recurrence(case: str, backend: str) -> None:
    """Outputs before the bad token stay finite (and right); what the recurrence makes
    non-finite is non-finite, element for element."""
    name, index, value = NONFINITE[case]
    inputs = make_inputs(seqlens=[200, 30], num_qk_heads=1, num_v_heads=2, dtype=torch.float32)
    inputs[name][index] = value
    exact_o, exact_s = naive_recurrent_gated_delta_rule(
        **{n: (t.double() if t.is_floating_point() else t) for n, t in inputs.items()}, use_qk_l2norm_in_kernel=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            backend=backend)
    assert torch.equal(torch.isfinite(o), torch.isfinite(exact_o))
    assert torch.equal(torch.isfinite(s), torch.isfinite(exact_s))
    finite = torch.isfinite(exact_o)
    assert (o.double() - exact_o)[finite].abs().max().item() < 1e-5
    assert torch.isfinite(o[0, : index[1]]).all(), "an output before the bad token is not finite"


@pytest.mark.skipif(not is_pypto_available(), reason="pypto not installed")
@pytest.mark.parametrize("case", ["v_nan", pytest.param("k_inf", marks=pytest.mark.slow),
                                  pytest.param("g_nan", marks=pytest.mark.slow)])
def test_a_nonfinite_input_spreads_only_as_in_the_recurrence_pypto(case: str) -> None:
    """The PyPTO kernel (interpreter) under the same rule, at a head dim it takes."""
    name, index, value = NONFINITE[case]
    inputs = make_inputs(seqlens=[200, 30], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                         dtype=torch.float32)
    inputs[name][index] = value
    exact_o, exact_s = naive_recurrent_gated_delta_rule(
        **{n: (t.double() if t.is_floating_point() else t) for n, t in inputs.items()}, use_qk_l2norm_in_kernel=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            backend="pypto")
    assert torch.equal(torch.isfinite(o), torch.isfinite(exact_o))
    assert torch.equal(torch.isfinite(s), torch.isfinite(exact_s))
    assert (o.double() - exact_o)[torch.isfinite(exact_o)].abs().max().item() < 1e-5


@pytest.mark.skipif(not is_pypto_available(), reason="pypto not installed")
@pytest.mark.parametrize("big", [pytest.param(-1e6, marks=pytest.mark.slow), float("-inf")])
def test_extreme_decays_pypto_forward_and_backward(big: float) -> None:
    """The PyPTO kernels (interpreter) under extreme decays: the forward at the recurrence's
    accuracy, every gradient within the kernel tests' bound of autograd through it."""
    inputs = make_inputs(seqlens=[100, 37], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                         dtype=torch.float32, with_initial_state=True)
    inputs["initial_state"] = inputs["initial_state"].float()
    inputs["g"] = _extreme_gates(inputs["g"], big)
    leaves = {n: (t.clone().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
    exact = {n: (t.double().clone().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
    exact_o, exact_s = naive_recurrent_gated_delta_rule(**exact, use_qk_l2norm_in_kernel=True)
    fp32_o, _ = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            backend="pypto")
    bound = max(4 * (fp32_o.double() - exact_o).abs().max().item(), 1e-6)
    assert (o.double() - exact_o.detach()).abs().max().item() <= bound
    assert (s.double() - exact_s.detach()).abs().max().item() <= 4 * bound
    (o.sum() + s.square().sum()).backward()
    (exact_o.sum() + exact_s.square().sum()).backward()
    for n, t in exact.items():
        if t.is_floating_point():
            err = (leaves[n].grad.double() - t.grad).abs()
            assert (err <= 1e-3 * t.grad.abs() + 1e-4).all(), f"d{n}: max abs err {err.max():.3g}"


def _masks(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.isnan(t), torch.isinf(t)


@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("backend, entry", [("cpu", "chunk"), ("cpu", "step"), ("cpu", "pool_step"),
                                            ("torch", "chunk"), ("torch", "step"), ("torch", "pool_step"),
                                            ("recurrent", "chunk"), ("recurrent", "step")])
def test_g_plus_inf_gives_the_recurrences_nan_and_inf_masks(backend: str, entry: str, with_initial_state: bool) -> None:
    """g = +inf at one token (exp(g) S holds infinities, and 0 * inf where S is 0): the
    outputs and final states are NaN exactly where the recurrence's are, and +-inf exactly
    where it has them (none), on every entry point; the other values as the recurrence's."""
    x = make_inputs(batch_size=2, seq_len=6, num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                    dtype=torch.float32, with_initial_state=True)
    state = x.pop("initial_state").float()
    if not with_initial_state:
        state = torch.zeros_like(state)
    x["g"][0, 2, 1] = float("inf")
    exact_o, exact_s = naive_recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()},
                                                        initial_state=state.double(), use_qk_l2norm_in_kernel=True)
    options = dict(use_qk_l2norm_in_kernel=True, backend=backend)
    if entry == "chunk":
        o, s = torch_gdr.chunk_gated_delta_rule(**x, initial_state=state, output_final_state=True, chunk_size=16,
                                                **options)
    elif entry == "step":
        o, s = torch_gdr.fused_recurrent_gated_delta_rule(**x, initial_state=state, output_final_state=True, **options)
    else:  # one token per call over a pool of 3 rows: sequence n in row n + 1 (row 0 untouched)
        pool = torch.cat([torch.zeros(1, 2, 8, 8), state])
        outputs = []
        for t in range(x["q"].shape[1]):
            token = {n: v[:, t : t + 1] for n, v in x.items()}
            o_t, returned = torch_gdr.fused_recurrent_gated_delta_rule(
                **token, initial_state=pool, ssm_state_indices=torch.tensor([1, 2]), **options)
            assert returned is pool
            outputs.append(o_t)
        o, s = torch.cat(outputs, dim=1), pool[1:]
        assert torch.equal(pool[0], torch.zeros(2, 8, 8))
    assert exact_o.isnan().any() and not exact_o.isinf().any()  # the case is what it claims
    for got, want, name in ((o, exact_o, "o"), (s, exact_s, "final state")):
        for got_mask, want_mask, what in zip(_masks(got), _masks(want), ("NaN", "inf")):
            assert torch.equal(got_mask, want_mask), f"{name}: {what} where the recurrence has none, or not where it has"
        finite = torch.isfinite(want)
        torch.testing.assert_close(got.double()[finite], want[finite], atol=1e-5, rtol=1e-5, msg=name)
