"""Chunk states are stored per segment, for the matrices a segment computes: memory follows
the tokens of a call, not sequences x longest sequence."""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from tests.helpers import canonical, make_inputs
from torch_gdr.ops.torch.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ops.torch.chunk_layout import ChunkLayout
from torch_gdr.ops.torch.chunk_states import ChunkStates
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule


def _skewed_lengths(chunk: int) -> list[int]:
    """One long document packed with many one-token ones: the shape of packed training."""
    return [40 * chunk] + [1] * 200


def test_storage_follows_the_tokens_for_skewed_packing() -> None:
    chunk, heads = 16, 2
    lengths = _skewed_lengths(chunk)
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    v = torch.zeros(1, sum(lengths), heads, 8)
    layout = ChunkLayout(v, tuple(cu_seqlens.tolist()), chunk)
    states = ChunkStates(layout, None, 8, 8, keep=True)
    real = sum(-(-n // chunk) for n in lengths) * heads  # (chunk, sequence, head) matrices with tokens
    dense = (layout.num_chunks + 1) * len(lengths) * heads  # [NC + 1, N * HV]
    assert states.storage.shape[0] <= 2 * real
    assert states.storage.shape[0] * 20 < dense


def _assert_matches_recurrence(inputs: dict, chunk_size: int) -> None:
    """Outputs, final states and every gradient of the public call (fp64) against the
    recurrence, with a loss on o and on the final state."""
    leaves = {n: x.clone().requires_grad_() for n, x in inputs.items() if isinstance(x, torch.Tensor)
              and x.is_floating_point()}
    o, final = torch_gdr.chunk_gated_delta_rule(**dict(inputs, **leaves), output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    (o.sum() + final.square().sum()).backward()
    ref_leaves = {n: x.detach().clone().requires_grad_() for n, x in leaves.items()}
    ref_o, ref_final = naive_recurrent_gated_delta_rule(**dict(inputs, **ref_leaves), output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True)
    (ref_o.sum() + ref_final.square().sum()).backward()
    torch.testing.assert_close(o, ref_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, ref_final, atol=1e-10, rtol=1e-10)
    for n, x in ref_leaves.items():
        torch.testing.assert_close(leaves[n].grad, x.grad, atol=1e-8, rtol=1e-8, msg=n)


def test_skewed_packing_matches_the_recurrence_with_gradients() -> None:
    chunk = 16
    inputs = make_inputs(seqlens=_skewed_lengths(chunk)[:30], num_qk_heads=1, num_v_heads=2, head_k_dim=8,
                         head_v_dim=8, with_initial_state=True, dtype=torch.float64)
    _assert_matches_recurrence(inputs, chunk)


def test_saved_storage_must_match_the_layout() -> None:
    v = torch.zeros(1, 64, 2, 8)
    layout = ChunkLayout(v, None, 16)
    with pytest.raises(ValueError, match=r"chunk_states: expected shape \[8, 8, 8\].*got \[3, 8, 8\]"):
        ChunkStates(layout, None, 8, 8, keep=True, storage=torch.zeros(3, 8, 8))


def test_forward_saves_what_the_backward_reads() -> None:
    inputs = make_inputs(seqlens=[50, 0, 3, 33], num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                         with_initial_state=True, dtype=torch.float64)
    call = canonical(inputs, chunk_size=16)
    o, final, nothing = chunk_gated_delta_rule_fwd(call)
    o_saved, final_saved, storage = chunk_gated_delta_rule_fwd(call, save_states=True)
    assert nothing is None
    torch.testing.assert_close(o_saved, o, atol=0, rtol=0)
    torch.testing.assert_close(final_saved, final, atol=0, rtol=0)
    layout = ChunkLayout(inputs["v"], call.offsets, 16)
    assert storage.shape[0] == ChunkStates(layout, None, 8, 8, keep=True).storage.shape[0]


def test_scratch_stays_bounded_with_many_packed_sequences() -> None:
    """One chunk of every sequence would be 2000 matrices: the layout splits that chunk into
    groups of sequences, so no segment (and no workspace) exceeds twice the target."""
    lengths = [3] * 1000 + [100]
    cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    v = torch.zeros(1, sum(lengths), 2, 8)
    layout = ChunkLayout(v, tuple(cu_seqlens.tolist()), 16, segment_matrices=24)
    assert layout.segment_capacity <= 2 * 24
    covered = {}
    for span in layout.segments():  # every (chunk, sequence) with tokens is in exactly one span
        for c in range(span.c0, span.c1):
            for n in range(span.n0, span.n1):
                covered[(c, n)] = covered.get((c, n), 0) + 1
    expected = {(c, n) for n, chunks in enumerate(layout.seq_chunks) for c in range(chunks)}
    assert expected <= set(covered) and set(covered.values()) == {1}


def test_many_packed_sequences_match_the_recurrence(monkeypatch) -> None:
    """Spans of a few sequences each (segment target 4 matrices, 2 value heads)."""
    import torch_gdr.ops.torch.chunk_layout as chunk_layout

    monkeypatch.setattr(chunk_layout, "SEGMENT_MATRICES", 4)
    inputs = make_inputs(seqlens=[5, 40, 0, 17, 3, 33, 1, 20], num_qk_heads=1, num_v_heads=2, head_k_dim=8,
                         head_v_dim=8, with_initial_state=True, dtype=torch.float64)
    _assert_matches_recurrence(inputs, 16)


def test_varlen_layouts_are_shared_by_calls_of_one_packing(monkeypatch) -> None:
    """A call's backward and every layer of a model see the same cu_seqlens: they share one
    layout (its segments and gather indices), keyed by everything the layout depends on."""
    import torch_gdr.ops.torch.chunk_layout as chunk_layout

    monkeypatch.setattr(chunk_layout, "_SHARED", type(chunk_layout._SHARED)())
    v = torch.zeros(1, 50, 2, 8)
    cu_seqlens = (0, 20, 20, 50)
    layout = chunk_layout.layout_for_call(v, cu_seqlens, 16)
    assert chunk_layout.layout_for_call(v.clone(), list(cu_seqlens), 16) is layout
    others = [
        chunk_layout.layout_for_call(v, (0, 21, 21, 50), 16),  # another packing
        chunk_layout.layout_for_call(v, cu_seqlens, 32),  # another chunk size
        chunk_layout.layout_for_call(torch.zeros(1, 50, 4, 8), cu_seqlens, 16),  # more value heads
        chunk_layout.layout_for_call(v.double(), cu_seqlens, 16),  # another compute dtype
    ]
    monkeypatch.setattr(chunk_layout, "SEGMENT_MATRICES", 3)
    others.append(chunk_layout.layout_for_call(v, cu_seqlens, 16))  # another segment size
    assert all(other is not layout for other in others)
    assert len({id(other) for other in others}) == len(others)
    recent = [chunk_layout.layout_for_call(v, (0, n, 50), 16)
              for n in range(2 * chunk_layout.SHARED_LAYOUTS)]  # only the most recent packings are kept
    assert len(chunk_layout._SHARED) == chunk_layout.SHARED_LAYOUTS
    assert chunk_layout.layout_for_call(v, (0, 0, 50), 16) is not recent[0]
    assert chunk_layout.layout_for_call(v, (0, 15, 50), 16) is recent[15]
