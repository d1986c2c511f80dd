"""Property test: random shapes and random packings agree with the recurrence."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_gdr
from tests.helpers import make_inputs
from torch_gdr.ref import naive_recurrent_gated_delta_rule


@st.composite
def problems(draw: st.DrawFn) -> dict:
    num_qk_heads = draw(st.integers(1, 2))
    return dict(
        seqlens=draw(st.lists(st.integers(0, 40), min_size=1, max_size=4)),
        num_qk_heads=num_qk_heads,
        num_v_heads=num_qk_heads * draw(st.sampled_from([1, 2, 4])),
        head_k_dim=draw(st.sampled_from([1, 4, 8])),
        head_v_dim=draw(st.sampled_from([1, 3, 8])),
        with_initial_state=draw(st.booleans()),
        gate=draw(st.sampled_from(["logsigmoid", "strong", "zero"])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=40, deadline=None)
@given(problem=problems(), chunk_size=st.sampled_from([16, 32, 64]), use_l2norm=st.booleans())
def test_random_packings_match_recurrence(problem: dict, chunk_size: int, use_l2norm: bool) -> None:
    inputs = make_inputs(**problem)
    if not use_l2norm:  # bound the state: unnormalised keys make the recurrence itself blow up
        inputs["k"] = torch.nn.functional.normalize(inputs["k"], dim=-1)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=use_l2norm)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=chunk_size,
                                           use_qk_l2norm_in_kernel=use_l2norm)
    assert o.shape == inputs["v"].shape
    assert s.shape == (len(problem["seqlens"]), problem["num_v_heads"], problem["head_k_dim"], problem["head_v_dim"])
    torch.testing.assert_close(o, expected_o, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(s, expected_s, atol=1e-9, rtol=1e-9)
