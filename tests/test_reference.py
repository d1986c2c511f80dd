"""The chunked algorithm against the per-token recurrence, the definition."""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import chunked_reference, make_inputs
from torch_gdr.ref import naive_recurrent_gated_delta_rule

CASES = {
    # name: make_inputs keyword arguments
    "below_chunk": dict(seq_len=40),
    "equal_chunk": dict(seq_len=64),
    "not_multiple": dict(seq_len=150),
    "single_token": dict(seq_len=1),
    "batch": dict(batch_size=3, seq_len=70),
    "gva2": dict(num_qk_heads=2, num_v_heads=4, seq_len=90),
    "gva4": dict(num_qk_heads=1, num_v_heads=4, seq_len=90),
    "k_ne_v": dict(head_k_dim=8, head_v_dim=24, seq_len=80),
    "initial_state": dict(seq_len=100, with_initial_state=True, batch_size=2),
    "varlen": dict(seqlens=[37, 0, 1, 64, 90], with_initial_state=True, num_qk_heads=1, num_v_heads=2),
    "strong_decay": dict(seq_len=130, gate="strong", with_initial_state=True),
    "zero_decay": dict(seq_len=130, gate="zero", with_initial_state=True),
}

TOLERANCE = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-4, rtol=2e-4)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("use_l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_matches_recurrence(case: str, use_l2norm: bool, dtype: torch.dtype) -> None:
    inputs = make_inputs(dtype=dtype, **CASES[case])
    if not use_l2norm:  # keep the state bounded without the norm, as real models do
        inputs["q"], inputs["k"] = inputs["q"] * 0.25, inputs["k"] * 0.25
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=use_l2norm)
    o, s = chunked_reference(inputs, use_qk_l2norm_in_kernel=use_l2norm, chunk_size=32)
    assert o.shape == inputs["v"].shape and o.dtype == dtype
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, expected_o, **TOLERANCE[dtype])
    torch.testing.assert_close(s, expected_s, **TOLERANCE[dtype])


def test_custom_scale_matches_recurrence() -> None:
    inputs = make_inputs(seq_len=50, with_initial_state=True)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, scale=0.3, use_qk_l2norm_in_kernel=True)
    o, s = chunked_reference(inputs, scale=0.3, use_qk_l2norm_in_kernel=True, chunk_size=16)
    torch.testing.assert_close(o, expected_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, expected_s, atol=1e-10, rtol=1e-10)
    default_o, _ = chunked_reference(inputs, use_qk_l2norm_in_kernel=True, chunk_size=16)
    assert not torch.allclose(default_o, o), "scale must change the output"


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_every_chunk_size_gives_the_same_answer(chunk_size: int) -> None:
    inputs = make_inputs(seqlens=[200, 3, 0, 77], with_initial_state=True, num_qk_heads=1, num_v_heads=2)
    expected_o, expected_s = chunked_reference(inputs, use_qk_l2norm_in_kernel=True, chunk_size=64)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                           chunk_size=chunk_size)
    torch.testing.assert_close(o, expected_o, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(s, expected_s, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
def test_split_sequence_continues_from_final_state(backend: str) -> None:
    inputs = make_inputs(batch_size=2, seq_len=150, with_initial_state=True)
    whole_o, whole_s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, backend=backend,
                                                       use_qk_l2norm_in_kernel=True)
    cut = 61
    first = {n: t[:, :cut] for n, t in inputs.items() if n != "initial_state"}
    second = {n: t[:, cut:] for n, t in inputs.items() if n != "initial_state"}
    o1, s1 = torch_gdr.chunk_gated_delta_rule(**first, initial_state=inputs["initial_state"], output_final_state=True,
                                             backend=backend, use_qk_l2norm_in_kernel=True)
    o2, s2 = torch_gdr.chunk_gated_delta_rule(**second, initial_state=s1, output_final_state=True, backend=backend,
                                             use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), whole_o, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(s2, whole_s, atol=1e-11, rtol=1e-11)


def test_zero_length_sequence_keeps_its_initial_state() -> None:
    inputs = make_inputs(seqlens=[5, 0, 9], with_initial_state=True)
    _, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True)
    assert torch.equal(s[1], inputs["initial_state"][1])
    assert not torch.allclose(s[0], inputs["initial_state"][0])


def test_sequences_never_mix() -> None:
    """Changing one packed sequence leaves the outputs and state of the others unchanged."""
    inputs = make_inputs(seqlens=[20, 30, 25], with_initial_state=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True)
    changed = dict(inputs)
    changed["v"] = inputs["v"].clone()
    changed["v"][0, 20:50] += 1.0
    o2, s2 = torch_gdr.chunk_gated_delta_rule(**changed, output_final_state=True)
    assert torch.equal(o[0, :20], o2[0, :20]) and torch.equal(o[0, 50:], o2[0, 50:])
    assert torch.equal(s[0], s2[0]) and torch.equal(s[2], s2[2])
    assert not torch.allclose(o[0, 20:50], o2[0, 20:50])


@pytest.mark.parametrize("poisoned_seq", [0, 1], ids=["first_tokens", "middle"])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_nan_in_one_packed_sequence_stays_there(name: str, poisoned_seq: int) -> None:
    """A NaN in one sequence's tokens reaches neither the outputs, the final states nor the
    gradients of the other sequences (padding positions gather nothing from them)."""
    seqlens = [20, 30, 25, 3]
    inputs = make_inputs(seqlens=seqlens, with_initial_state=True)
    bounds = torch.tensor([0] + seqlens).cumsum(0).tolist()
    span = torch.arange(bounds[poisoned_seq], bounds[poisoned_seq + 1])
    clean = torch.tensor([t for t in range(bounds[-1]) if t not in set(span.tolist())])
    others = [n for n in range(len(seqlens)) if n != poisoned_seq]
    poisoned = {n: (x.clone().requires_grad_() if n in ("q", "k", "v", "g", "beta") else x)
                for n, x in inputs.items()}
    with torch.no_grad():
        poisoned[name][0, span] = float("nan")
    o, s = torch_gdr.chunk_gated_delta_rule(**poisoned, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            chunk_size=16)
    (o[0, clean].sum() + s[others].sum()).backward()
    assert torch.isfinite(o[0, clean]).all() and torch.isfinite(s[others]).all()
    assert torch.isnan(o[0, span]).any()  # the poisoned sequence itself is NaN
    for n in ("q", "k", "v", "g", "beta"):
        assert torch.isfinite(poisoned[n].grad[0, clean]).all(), n


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
@pytest.mark.parametrize("state_v_first", [False, True])
def test_all_sequences_empty_returns_a_copy_of_the_initial_state(backend: str, state_v_first: bool) -> None:
    inputs = make_inputs(seqlens=[0, 0], with_initial_state=True)
    if state_v_first:
        inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, backend=backend,
                                           state_v_first=state_v_first)
    assert o.shape == inputs["v"].shape
    assert torch.equal(s, inputs["initial_state"])
    s.add_(1.0)  # the result is the caller's own tensor, not an alias of the input
    assert not torch.equal(s, inputs["initial_state"])


@pytest.mark.parametrize("gate", [-30.0, 0.5], ids=["strong_decay", "growth"])
def test_pairwise_decay_is_finite_and_masked(gate: float) -> None:
    """Gamma = exp(gamma_r - gamma_s) on and below the diagonal and exactly 0 above it, even
    where the differences above the diagonal would overflow the exp (30 x 63 under strong
    decay), and with positive log decays (growth) below it."""
    from torch_gdr.ops.torch.segment import pairwise_decay

    g = gate + 0.1 * torch.randn(3, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    gamma = g.cumsum(-1)
    decay = pairwise_decay(g)
    rows, cols = torch.tril_indices(64, 64)
    expected = torch.zeros(3, 2, 64, 64, dtype=torch.float64)
    expected[..., rows, cols] = (gamma[..., rows] - gamma[..., cols]).exp()
    assert torch.isfinite(decay).all()
    assert (decay.triu(1) == 0).all()
    # the expected exponents are differences of sums up to ~1900 in size, each good to a few ulps
    # of that (1e-13 relative to exp's result per ulp), subnormals differ in the last bit
    torch.testing.assert_close(decay, expected, rtol=1e-11, atol=1e-300)
