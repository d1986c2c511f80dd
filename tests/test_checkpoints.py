"""Chunk-state checkpoints equal the final states of the same inputs cut at those points."""

from __future__ import annotations

import pytest
import torch

import torch_gdr

from tests.helpers import make_inputs
from torch_gdr.ops.torch.checkpoints import chunk_gated_delta_rule_with_checkpoints
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

CASES = {
    # name: (make_inputs kwargs, checkpoint_every, chunk_size)
    "batched": (dict(batch_size=2, seq_len=100, with_initial_state=True), 32, 16),
    "batched_exact": (dict(batch_size=2, seq_len=96), 32, 32),  # the last checkpoint is the final state
    "every_chunk": (dict(seq_len=70, with_initial_state=True), 16, 16),
    "varlen": (dict(seqlens=[70, 0, 16, 33, 64, 5], with_initial_state=True), 16, 16),
    "varlen_coarse": (dict(seqlens=[130, 64, 7, 128], with_initial_state=True), 64, 32),
    "gva": (dict(seqlens=[50, 90], num_qk_heads=1, num_v_heads=4, with_initial_state=True), 32, 32),
    "long_segments": (dict(seq_len=640, head_k_dim=8, head_v_dim=8), 128, 16),  # more chunks than a segment
    # more sequences than a segment holds: chunks split into groups of sequences
    "many_seqs": (dict(seqlens=[(17 * i) % 50 + 10 for i in range(30)], head_k_dim=8, head_v_dim=8), 16, 16),
}


def _sequences(inputs: dict) -> list[tuple[dict, int]]:
    """Per sequence: its own batched inputs [1, L, ...] with its initial state, and L."""
    names = ("q", "k", "v", "g", "beta")
    out = []
    if "cu_seqlens" in inputs:
        bounds = inputs["cu_seqlens"].tolist()
        for n in range(len(bounds) - 1):
            piece = {m: inputs[m][:, bounds[n]:bounds[n + 1]] for m in names}
            if "initial_state" in inputs:
                piece["initial_state"] = inputs["initial_state"][n:n + 1]
            out.append((piece, bounds[n + 1] - bounds[n]))
    else:
        for n in range(inputs["q"].shape[0]):
            piece = {m: inputs[m][n:n + 1] for m in names}
            if "initial_state" in inputs:
                piece["initial_state"] = inputs["initial_state"][n:n + 1]
            out.append((piece, inputs["q"].shape[1]))
    return out


def _expected_checkpoints(inputs: dict, every: int) -> tuple[list[torch.Tensor], list[int]]:
    states, counts = [], []
    for piece, length in _sequences(inputs):
        counts.append(length // every)
        for j in range(length // every):
            cut = {m: (t[:, :(j + 1) * every] if m != "initial_state" else t) for m, t in piece.items()}
            _, s = naive_recurrent_gated_delta_rule(**cut, use_qk_l2norm_in_kernel=True)
            states.append(s[0])
    return states, counts


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoints_equal_final_states_of_cut_inputs(case: str) -> None:
    kwargs, every, chunk_size = CASES[case]
    inputs = make_inputs(**kwargs)
    o, final_state, checkpoints, offsets = chunk_gated_delta_rule_with_checkpoints(
        **inputs, checkpoint_every=every, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    expected, counts = _expected_checkpoints(inputs, every)
    assert offsets.dtype == torch.int64 and offsets.tolist() == [0] + torch.tensor(counts).cumsum(0).tolist()
    assert checkpoints.shape == (len(expected),) + tuple(final_state.shape[1:])
    if expected:
        torch.testing.assert_close(checkpoints, torch.stack(expected), atol=1e-10, rtol=1e-10)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, expected_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final_state, expected_s, atol=1e-10, rtol=1e-10)


def test_state_v_first_and_token_major() -> None:
    inputs = make_inputs(seqlens=[40, 33], with_initial_state=True, head_k_dim=8, head_v_dim=12)
    _, s, ckpt, offsets = chunk_gated_delta_rule_with_checkpoints(**inputs, checkpoint_every=16,
                                                                  chunk_size=16)
    tnd = {n: (t.squeeze(0) if n in ("q", "k", "v", "g", "beta") else t) for n, t in inputs.items()}
    tnd["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    o_vf, s_vf, ckpt_vf, offsets_vf = chunk_gated_delta_rule_with_checkpoints(
        **tnd, checkpoint_every=16, chunk_size=16, state_v_first=True)
    assert o_vf.dim() == 3 and ckpt_vf.shape == (4, 2, 12, 8) and ckpt_vf.is_contiguous()
    assert torch.equal(offsets_vf, offsets) and offsets.tolist() == [0, 2, 4]
    torch.testing.assert_close(ckpt_vf, ckpt.transpose(-1, -2), atol=0, rtol=0)
    torch.testing.assert_close(s_vf, s.transpose(-1, -2), atol=0, rtol=0)


def test_float32_checkpoints_stay_close() -> None:
    inputs = make_inputs(seqlens=[100, 64], dtype=torch.float32, with_initial_state=True)
    _, _, ckpt, _ = chunk_gated_delta_rule_with_checkpoints(**inputs, checkpoint_every=32, chunk_size=32,
                                                            use_qk_l2norm_in_kernel=True)
    expected, _ = _expected_checkpoints(make_inputs(seqlens=[100, 64], with_initial_state=True), 32)
    assert ckpt.dtype == torch.float32
    torch.testing.assert_close(ckpt.double(), torch.stack(expected), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("every,error", [(24, ValueError), (0, ValueError), (-16, ValueError),
                                         (16.0, TypeError), (True, TypeError)])
def test_bad_checkpoint_every(every, error) -> None:
    inputs = make_inputs(seq_len=32)
    with pytest.raises(error, match="checkpoint_every"):
        torch_gdr.chunk_gated_delta_rule(**inputs, checkpoint_every=every, chunk_size=16)


def test_the_public_call_returns_checkpoints_for_inference() -> None:
    inputs = make_inputs(seqlens=[70, 0, 33], num_qk_heads=1, num_v_heads=2, with_initial_state=True)
    expected = chunk_gated_delta_rule_with_checkpoints(**inputs, checkpoint_every=32, chunk_size=16)
    o, final_state, checkpoints, offsets = torch_gdr.chunk_gated_delta_rule(
        **inputs, output_final_state=True, chunk_size=16, checkpoint_every=32)
    for got, want in zip((o, final_state, checkpoints, offsets), expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    leaves = {n: (t.requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
    with pytest.raises(ValueError, match="checkpoint_every: checkpoints are for inference"):
        torch_gdr.chunk_gated_delta_rule(**leaves, chunk_size=16, checkpoint_every=32)
