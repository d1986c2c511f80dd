"""Batch invariance (issue 36): at a fixed thread count, a request's outputs and states are
bit-identical whether it runs alone or packed with other requests, in prefill (``cu_seqlens``,
plain and over a pool) and in the pool decode, on the ``cpu`` and ``torch`` backends, at 1
and 2 threads.

The request under test sits at a different place in each batch (first, middle, last), and
the others have lengths that move its tokens off the chunk grid it has alone; the packed run
must still give ``torch.equal`` results (no tolerance).
"""

from __future__ import annotations

import pytest
import torch

import torch_gdr

H, HV, K, V = 2, 4, 16, 16
SLOTS = 12


def _tokens(n: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(1, n, H, K, generator=gen), k=torch.randn(1, n, H, K, generator=gen),
                v=torch.randn(1, n, HV, V, generator=gen),
                g=torch.nn.functional.logsigmoid(torch.randn(1, n, HV, generator=gen)),
                beta=torch.rand(1, n, HV, generator=gen))


def _pack(parts: list[dict]) -> tuple[dict, torch.Tensor]:
    packed = {name: torch.cat([p[name] for p in parts], 1) for name in parts[0]}
    lengths = [p["v"].shape[1] for p in parts]
    cu = torch.tensor([0] + lengths).cumsum(0)
    return packed, cu


def _pool(seed: int) -> torch.Tensor:
    return torch.randn(SLOTS, HV, K, V, generator=torch.Generator().manual_seed(seed)) * 0.1


#: (the request's length, the others' lengths, where the request goes among them)
PREFILL_CASES = {
    "first": (37, [5, 70], 0),
    "middle": (37, [5, 70], 1),
    "last": (70, [1, 33, 64], 3),
}

BACKENDS = ["cpu", "torch"]
THREADS = [1, 2]


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_alone_equals_packed(torch_threads, backend: str, case: str, threads: int) -> None:
    torch_threads(threads)
    length, others, place = PREFILL_CASES[case]
    request = _tokens(length, seed=1)
    parts = [_tokens(n, seed=10 + i) for i, n in enumerate(others)]
    parts.insert(place, request)
    packed, cu = _pack(parts)
    initial = torch.randn(len(parts), HV, K, V, generator=torch.Generator().manual_seed(2)) * 0.1
    with torch.no_grad():
        o_alone, s_alone = torch_gdr.chunk_gated_delta_rule(
            **request, initial_state=initial[place:place + 1], output_final_state=True,
            cu_seqlens=torch.tensor([0, length]), use_qk_l2norm_in_kernel=True, backend=backend)
        o_packed, s_packed = torch_gdr.chunk_gated_delta_rule(
            **packed, initial_state=initial, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, backend=backend)
    start = int(cu[place])
    assert torch.equal(o_packed[:, start:start + length], o_alone)
    assert torch.equal(s_packed[place], s_alone[0])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_prefill_alone_equals_packed(torch_threads, backend: str, threads: int) -> None:
    torch_threads(threads)
    request = _tokens(41, seed=3)
    parts = [_tokens(9, seed=4), request, _tokens(66, seed=5)]
    packed, cu = _pack(parts)
    with torch.no_grad():
        alone_pool = _pool(6)
        o_alone, _ = torch_gdr.chunk_gated_delta_rule(
            **request, initial_state=alone_pool, initial_state_indices=torch.tensor([7]),
            final_state_indices=torch.tensor([2]), cu_seqlens=torch.tensor([0, 41]),
            use_qk_l2norm_in_kernel=True, backend=backend)
        packed_pool = _pool(6)
        o_packed, _ = torch_gdr.chunk_gated_delta_rule(
            **packed, initial_state=packed_pool, initial_state_indices=torch.tensor([0, 7, 5]),
            final_state_indices=torch.tensor([1, 2, 3]), cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
            backend=backend)
    assert torch.equal(o_packed[:, 9:50], o_alone)
    assert torch.equal(packed_pool[2], alone_pool[2])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1, 3], ids=["decode", "speculative"])
def test_pool_decode_alone_equals_packed(torch_threads, backend: str, width: int, threads: int) -> None:
    """One request's decode step (one token, or three draft tokens) alone, then packed with
    four others at the batch's middle; its output and the rows it writes are identical."""
    torch_threads(threads)
    rows = torch.tensor([[0, 5, 6], [1, 7, 8], [2, 9, 10], [3, 11, -1], [4, -1, -1]])[:, :width]
    place = 2
    request = _tokens(width, seed=20)
    parts = [_tokens(width, seed=30 + i) for i in range(4)]
    parts.insert(place, request)
    packed, cu = _pack(parts)
    with torch.no_grad():
        alone_pool = _pool(8)
        o_alone, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            **request, initial_state=alone_pool, ssm_state_indices=rows[place:place + 1],
            cu_seqlens=torch.tensor([0, width]), use_qk_l2norm_in_kernel=True, backend=backend)
        packed_pool = _pool(8)
        o_packed, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            **packed, initial_state=packed_pool, ssm_state_indices=rows, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, backend=backend)
    start = int(cu[place])
    assert torch.equal(o_packed[:, start:start + width], o_alone)
    written = rows[place][rows[place] >= 0]
    assert torch.equal(packed_pool[written], alone_pool[written])


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_step_into_a_buffer_over_an_fp8_pool_alone_equals_packed(torch_threads, backend: str,
                                                                      threads: int) -> None:
    """The serving extras together: a token tree (``retrieve_parent_token``) whose states go
    to an intermediate buffer, over an fp8 pool; the request alone and packed with four
    others gives identical outputs, buffer slots and pool rows."""
    torch_threads(threads)
    width, place = 3, 2
    rows = torch.tensor([[0, 5, 6], [1, 7, 8], [2, 9, 10], [3, 11, -1], [4, -1, -1]])
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1], [-1, -1, 1], [-1, 0, 1], [-1, 0, 0]])
    buffer_rows = torch.tensor([4, 0, 3, 1, 2])
    request = _tokens(width, seed=40)
    parts = [_tokens(width, seed=50 + i) for i in range(4)]
    parts.insert(place, request)
    packed, cu = _pack(parts)

    def run(tokens: dict, cu_seqlens: torch.Tensor, which: slice):
        pool = _pool(9).to(torch.float8_e4m3fn)
        buffer = torch.zeros(5, width, HV, K, V)
        with torch.no_grad():
            o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
                **tokens, initial_state=pool, ssm_state_indices=rows[which], cu_seqlens=cu_seqlens,
                retrieve_parent_token=parents[which], intermediate_states_buffer=buffer,
                intermediate_state_indices=buffer_rows[which], use_qk_l2norm_in_kernel=True, backend=backend)
        return o, pool, buffer

    o_alone, pool_alone, buffer_alone = run(request, torch.tensor([0, width]), slice(place, place + 1))
    o_packed, pool_packed, buffer_packed = run(packed, cu, slice(None))
    start = int(cu[place])
    assert torch.equal(o_packed[:, start:start + width], o_alone)
    written = rows[place][rows[place] >= 0]
    assert torch.equal(pool_packed[written].view(torch.uint8), pool_alone[written].view(torch.uint8))
    slot = int(buffer_rows[place])
    assert torch.equal(buffer_packed[slot], buffer_alone[slot])
    assert buffer_alone[slot].abs().sum() > 0  # the states were written
