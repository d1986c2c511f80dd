"""State pools of any strides (issue 36 item 4): a pool carved out of a larger allocation with
its inner dims in another order is read and written in place by the decode step and the
prefill, and a :class:`~torch_gdr.nn.GatedDeltaNetPoolCache` serves from a caller's pool.

Checked against the float64 recurrence run on each request alone; every element of the
allocation outside the written rows is left bit for bit.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import torch_gdr
from torch_gdr.nn import GatedDeltaNetPoolCache
from torch_gdr.testing import make_inputs, rmse_ratio
from tests.test_nn import inputs, make_layer
from tests.test_nn_pool_cache import alone, close, make_stack, run_stack
from tests.test_pool import FIELDS, reference_tokens

TOL = dict(rtol=1e-4, atol=1e-5)
DIMS = {"cpu": (8, 40), "torch": (8, 6)}
HV = 2


def carved_pool(slots: int, dk: int, dv: int, dtype: torch.dtype, v_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool, allocation)``: a ``[slots, HV, K, V]`` (``[slots, HV, V, K]``) view of a larger
    random allocation ``[slots + 1, K + 3, HV, V + 5]`` with its dims permuted and padded (no
    row contiguous, every stride odd)."""
    gen = torch.Generator().manual_seed(7)
    allocation = (torch.randn(slots + 1, dk + 3, HV, dv + 5, generator=gen) * 0.5).to(dtype)
    pool = allocation[1:, 1:dk + 1, :, 2:dv + 2].permute(0, 2, 1, 3)  # [slots, HV, K, V]
    if v_first:
        pool = pool.transpose(-1, -2)
    return pool, allocation


def _key_first(state: torch.Tensor, v_first: bool) -> torch.Tensor:
    return state.transpose(-1, -2) if v_first else state


@pytest.mark.parametrize("case", ["fp32", "v_first", "bf16", "speculative"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_decode_over_a_strided_pool(backend: str, case: str) -> None:
    dk, dv = DIMS[backend]
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    v_first = case == "v_first"
    pool, allocation = carved_pool(10, dk, dv, dtype, v_first)
    assert not pool.is_contiguous()
    before, before_alloc, pointer = pool.clone(), allocation.clone(), pool.data_ptr()
    width = 2 if case == "speculative" else 1
    x = make_inputs(seqlens=[width] * 3, num_qk_heads=1, num_v_heads=HV, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32, seed=2)
    x.pop("cu_seqlens")
    x = {f: x[f].reshape(3, width, *x[f].shape[2:]) for f in FIELDS}
    rows = [[4, 6], [1, -1], [9, 2]] if width == 2 else [[4], [-1], [9]]
    acc = torch.tensor([2, 1, 1]) if width == 2 else None
    with torch.no_grad():
        o, returned = torch_gdr.fused_recurrent_gated_delta_rule(
            *(x[f] for f in FIELDS[:4]), beta=x["beta"], initial_state=pool,
            ssm_state_indices=torch.tensor(rows if width == 2 else [r[0] for r in rows]), num_accepted_tokens=acc,
            use_qk_l2norm_in_kernel=True, state_v_first=v_first, backend=backend)
    assert returned is pool and pool.data_ptr() == pointer
    written = set()
    for n in range(3):
        start = rows[n][(int(acc[n]) - 1) if acc is not None else 0]
        state = torch.zeros(HV, dk, dv, dtype=torch.float64) if start < 0 else _key_first(before[start], v_first).double()
        outs, states = reference_tokens(x, [n * width + j for j in range(width)], state, None, True)
        for j in range(width):
            got_o, got_s = o[n, j].double(), None
            if rows[n][j] >= 0:
                written.add(rows[n][j])
                got_s = _key_first(pool[rows[n][j]], v_first).double()
            if dtype == torch.float32:
                assert torch.allclose(got_o, outs[j], **TOL)
                assert got_s is None or torch.allclose(got_s, states[j], **TOL)
            else:
                assert rmse_ratio(outs[j], got_o) < 0.005
                assert got_s is None or rmse_ratio(states[j].to(dtype).double(), got_s) < 0.005
    # the allocation outside the written rows' elements is unchanged, bit for bit
    mask = torch.ones(allocation.shape, dtype=torch.bool)
    view_mask = mask[1:, 1:dk + 1, :, 2:dv + 2].permute(0, 2, 1, 3)
    if v_first:
        view_mask = view_mask.transpose(-1, -2)
    for row in written:
        view_mask[row] = False
    assert torch.equal(allocation[mask].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       before_alloc[mask].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prefill_over_a_strided_pool(backend: str) -> None:
    """chunk_gated_delta_rule with initial/final rows over the same carved pool, in place."""
    dk, dv = DIMS[backend]
    pool, _ = carved_pool(8, dk, dv, torch.float32, False)
    before, pointer = pool.clone(), pool.data_ptr()
    x = make_inputs(seqlens=[7, 3], num_qk_heads=1, num_v_heads=HV, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32, seed=5)
    cu = x.pop("cu_seqlens")
    with torch.no_grad():
        o, _ = torch_gdr.chunk_gated_delta_rule(*(x[f] for f in FIELDS[:4]), beta=x["beta"], initial_state=pool,
                                                initial_state_indices=torch.tensor([2, -1]),
                                                final_state_indices=torch.tensor([5, 6]), cu_seqlens=cu,
                                                use_qk_l2norm_in_kernel=True, backend=backend)
    assert pool.data_ptr() == pointer
    for n, (start, final, tokens) in enumerate([(2, 5, range(0, 7)), (-1, 6, range(7, 10))]):
        state = torch.zeros(HV, dk, dv, dtype=torch.float64) if start < 0 else before[start].double()
        outs, states = reference_tokens(x, list(tokens), state, None, True)
        assert torch.allclose(o[0, list(tokens)].double(), torch.stack(outs), **TOL)
        assert torch.allclose(pool[final].double(), states[-1], **TOL)
    untouched = [r for r in range(8) if r not in (5, 6)]
    assert torch.equal(pool[untouched], before[untouched])


def test_pool_cache_serves_from_the_callers_pools() -> None:
    """A stack over caller-given strided pools (layer 0) and an allocated one (layer 1):
    prompts, decode steps and a fork give each request's outputs alone, and the states
    live in the caller's tensor (its rows change in place)."""
    stack = make_stack()
    layer0 = stack[0]
    shape = (3, layer0.num_v_heads, layer0.head_k_dim, layer0.head_v_dim)
    allocation = torch.zeros(shape[0] + 1, shape[2], shape[1], shape[3] + 3)
    pool = allocation[1:, :, :, 1:shape[3] + 1].permute(0, 2, 1, 3)
    assert tuple(pool.shape) == shape and not pool.is_contiguous()
    cache = GatedDeltaNetPoolCache(slots=3, recurrent_pools={layer0.cache_key: pool})
    prompts, tail = inputs(2, 5), inputs(2, 3, seed=4)
    with torch.no_grad():
        cache.allocate(["a", "b"])
        y0 = run_stack(stack, prompts, cache=cache.batch(["a", "b"]))
        steps = [run_stack(stack, tail[:, t:t + 1], cache=cache.batch(["a", "b"])) for t in range(2)]
        cache.fork("a", "c")
        y_c = run_stack(stack, tail[:1, 2:3], cache=cache.batch(["c"]))
    assert cache.layers[layer0.cache_key].recurrent_pool is pool
    assert pool.abs().sum() > 0  # written in place
    for i in range(2):
        whole = alone(stack, torch.cat([prompts[i], tail[i, :2]]))
        assert close(torch.cat([y0[i], steps[0][i], steps[1][i]]), whole)
    assert close(y_c[0], alone(stack, torch.cat([prompts[0], tail[0]]))[-1:])


def test_pool_cache_dtype_and_bad_pools() -> None:
    layer = make_layer("torch").eval()
    with pytest.raises(TypeError, match="dtype: expected one of"):
        GatedDeltaNetPoolCache(slots=2, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"recurrent_pools: expected the pool of layer 0 of shape \[slots = 2"):
        GatedDeltaNetPoolCache(slots=2, recurrent_pools={0: torch.zeros(3, 4, 8, 8)})
    cache = GatedDeltaNetPoolCache(slots=2, recurrent_pools={layer.cache_key: torch.zeros(2, 4, 8, 7)})
    cache.allocate(["a"])
    with torch.no_grad(), pytest.raises(ValueError, match="recurrent_pools: the pool given for layer"):
        layer(inputs(1, 2), cache=cache.batch(["a"]))
    bf16 = GatedDeltaNetPoolCache(slots=2, dtype=torch.bfloat16)
    bf16.allocate(["a"])
    x = inputs(1, 4)
    with torch.no_grad():
        y = torch.cat([layer(x[:, :3], cache=bf16.batch(["a"])), layer(x[:, 3:], cache=bf16.batch(["a"]))], 1)
        want = layer(x)
    assert bf16.layers[layer.cache_key].recurrent_pool.dtype == torch.bfloat16
    assert rmse_ratio(want.double(), y.double()) < 0.005
