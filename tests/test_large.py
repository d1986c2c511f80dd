"""The issue's acceptance shape: long sequence, realistic head sizes (slow: the recurrence is ~10 s)."""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import make_inputs
from torch_gdr.ref import naive_recurrent_gated_delta_rule


@pytest.mark.slow
def test_long_sequence_fp32_agrees_with_recurrence() -> None:
    inputs = make_inputs(seq_len=4096, num_qk_heads=4, num_v_heads=4, head_k_dim=128, head_v_dim=128,
                         dtype=torch.float32, with_initial_state=True)
    inputs["initial_state"] = inputs["initial_state"].float()
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    o, s = torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (o - expected_o).abs().max().item() < 1e-4
    assert (s - expected_s).abs().max().item() < 1e-4
