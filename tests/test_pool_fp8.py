"""fp8 state pools (issue 36 item 5): ``float8_e4m3fn`` and ``float8_e5m2`` pools, stored by a
plain cast (round to nearest even, saturating at the largest finite value, NaN staying NaN,
no scale), computed in float32.

Against a float64 recurrence that rounds the state to fp8 at the same stores (after every
call): outputs within fla's rmse ratio 0.005; every stored row equal to the reference state
rounded to fp8 (all but a few elements at a rounding boundary), on ``cpu`` and ``torch``, in
decode (eager and compiled), prefill and the pool cache.
"""

from __future__ import annotations

import pytest
import torch

import torch_gdr
from torch_gdr.nn import GatedDeltaNetPoolCache
from torch_gdr.testing import make_inputs, rmse_ratio
from tests.test_nn import inputs, make_layer
from tests.test_pool import FIELDS, reference_tokens

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DIMS = {"cpu": (8, 40), "torch": (8, 6)}
HV = 2


def fp8_round(state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference store: saturate at the largest finite value, then round to nearest even (float64 back)."""
    limit = torch.finfo(dtype).max
    return state.clamp(-limit, limit).to(dtype).double()


def assert_stored(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (an fp8 row) equals ``want`` (float64) rounded to fp8, but for at most 1% of
    elements one fp8 step apart (float32 vs float64 on a rounding boundary)."""
    rounded = fp8_round(want, dtype)
    differ = got.double() != rounded
    assert differ.float().mean() <= 0.01, f"{int(differ.sum())} of {differ.numel()} stored elements differ"
    assert rmse_ratio(rounded, got.double()) < 0.005


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_decode_steps_over_an_fp8_pool(backend: str, dtype: torch.dtype, compiled: bool) -> None:
    """Three decode steps of three sequences (one from -1, written to another row), each
    reading the rows the previous one stored in fp8."""
    dk, dv = DIMS[backend]
    gen = torch.Generator().manual_seed(1)
    pool = (torch.randn(8, HV, dk, dv, generator=gen) * 0.5).to(dtype)
    rows, first_read = [3, 5, 6], [3, -1, 6]
    ref_states = [pool[r].double() if r >= 0 else torch.zeros(HV, dk, dv, dtype=torch.float64) for r in first_read]

    def step(q, k, v, g, beta, pool, idx, start):
        return torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool,
                                                          ssm_state_indices=idx, initial_state_indices=start,
                                                          use_qk_l2norm_in_kernel=True, backend=backend)[0]
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, fullgraph=True, backend="aot_eager")
    try:
        for t in range(3):
            x = make_inputs(seqlens=[1, 1, 1], num_qk_heads=1, num_v_heads=HV, head_k_dim=dk, head_v_dim=dv,
                            dtype=torch.float32, seed=10 + t)
            x.pop("cu_seqlens")
            x = {f: x[f].reshape(3, 1, *x[f].shape[2:]) for f in FIELDS}
            with torch.no_grad():
                o = step(*(x[f] for f in FIELDS), pool, torch.tensor(rows),
                         torch.tensor(first_read if t == 0 else rows))
            want_o = []
            for n in range(3):
                outs, states = reference_tokens(x, [n], ref_states[n], None, True)
                want_o.append(outs[0])
                assert_stored(pool[rows[n]], states[0], dtype)
                ref_states[n] = fp8_round(states[0], dtype)  # the store the next step reads
            assert rmse_ratio(torch.stack(want_o), o[:, 0].double()) < 0.005
    finally:
        if compiled:
            torch._dynamo.reset()


def _fp8_probe_values(dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` float32 values that exercise an fp8 store: every midpoint between two
    neighbouring finite fp8 values (ties: round to even), values just off them, subnormals,
    values past the largest finite one, +-inf and NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -max..max
    mids = (grid[1:] + grid[:-1]) / 2
    limit = torch.finfo(dtype).max
    special = torch.tensor([limit * 1.01, -limit * 4, float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    values = torch.cat([mids, mids * (1 + 2 ** -12), mids * (1 - 2 ** -12), special])
    return values[torch.arange(count) % values.numel()]


@pytest.mark.parametrize("dim_v", [64, 20], ids=["vector", "scalar-tail"])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_store_is_the_saturating_cast(backend: str, dtype: torch.dtype, dim_v: int) -> None:
    """A state of known values stored into an fp8 pool equals torch's cast of those values
    after clamping to the largest finite value: from a zero start with g = 0, beta = 1 and
    k = e_0, the state after one token is e_0 v^T, so the pool row's first key row is v,
    stored; the other key rows are zero."""
    values = _fp8_probe_values(dtype, 3 * 2 * dim_v).view(3, 1, 2, dim_v)  # [N, T, HV, V]
    dim_k = 8
    q = torch.zeros(3, 1, 1, dim_k)
    k = torch.zeros(3, 1, 1, dim_k)
    k[..., 0] = 1.0
    pool = torch.full((5, 2, dim_k, dim_v), 3.0).to(dtype)
    with torch.no_grad():
        torch_gdr.fused_recurrent_gated_delta_rule(q, k, values, torch.zeros(3, 1, 2), beta=torch.ones(3, 1, 2),
                                                   initial_state=pool, ssm_state_indices=torch.tensor([4, 0, 2]),
                                                   initial_state_indices=torch.tensor([-1, -1, -1]), backend=backend)
    limit = torch.finfo(dtype).max
    for n, row in enumerate([4, 0, 2]):
        want = values[n, 0].clamp(-limit, limit).to(dtype)  # torch's cast: round to nearest even; NaN stays
        got = pool[row, :, 0]
        same = (got.view(torch.uint8) == want.view(torch.uint8)) | (got.float().isnan() & want.float().isnan())
        assert bool(same.all()), f"row {row}: {int((~same).sum())} stored values differ from the cast"
        assert bool(pool[row, :, 1:].float().eq(0).all())
    assert bool(pool[[1, 3]].float().eq(3.0).all())  # rows not written keep their bits


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fp8_rows_read_exactly(backend: str, dtype: torch.dtype) -> None:
    """Every finite fp8 value (but -0) is read exactly: with g = 0, beta = 0 and k = 0 a step
    leaves the state as it is, so the row written is the row read, bit for bit, and with q = e_n
    and scale 1 the output of sequence n is key row n of the state as float32. V = 64 runs
    the kernel's vector path (whole registers of fp8 lanes)."""
    dk, dv, seqs = 8, 64, 8
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    finite = codes[codes.float().isfinite() & (codes.view(torch.uint8) != 0x80)]  # -0 + 0 is +0
    src = finite[torch.arange(HV * dk * dv) % finite.numel()].view(HV, dk, dv)
    pool = torch.zeros(seqs + 1, HV, dk, dv, dtype=dtype)
    pool[0] = src
    q = torch.eye(dk)[:seqs].view(seqs, 1, 1, dk)
    zeros = torch.zeros(seqs, 1, HV)
    with torch.no_grad():
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            q, torch.zeros(seqs, 1, 1, dk), torch.randn(seqs, 1, HV, dv), zeros, beta=zeros, scale=1.0,
            initial_state=pool, ssm_state_indices=torch.arange(1, seqs + 1),
            initial_state_indices=torch.zeros(seqs, dtype=torch.int64), backend=backend)
    for n in range(seqs):
        assert torch.equal(pool[n + 1].view(torch.uint8), src.view(torch.uint8)), f"row {n + 1} is not the row read"
        assert torch.equal(o[n, 0], src[:, n].float()), f"sequence {n}: o is not key row {n} of the state"


def test_saturating_store_and_nan() -> None:
    """A state past the largest finite value is stored as that value (e5m2 too, where a
    plain cast gives inf); a NaN state stays NaN; other rows keep their bits."""
    for dtype in FP8:
        pool = torch.zeros(4, 1, 2, 2, dtype=dtype)
        pool[2] = float("nan")
        limit = torch.finfo(dtype).max
        q = torch.zeros(2, 1, 1, 2)
        k = torch.tensor([1.0, 0.0]).expand(2, 1, 1, 2).clone()
        v = torch.tensor([limit * 4, -limit * 4]).expand(2, 1, 1, 2).clone()
        with torch.no_grad():
            torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, torch.zeros(2, 1, 1), beta=torch.ones(2, 1, 1),
                                                       initial_state=pool, ssm_state_indices=torch.tensor([1, 2]),
                                                       backend="torch")
        assert pool[1, 0, 0].double().tolist() == [limit, -limit] and pool[1, 0, 1].double().tolist() == [0.0, 0.0]
        assert pool[2].double().isnan().all()
        assert pool[0].double().eq(0).all() and pool[3].double().eq(0).all()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_prefill_into_an_fp8_pool(backend: str) -> None:
    dk, dv = DIMS[backend]
    dtype = torch.float8_e4m3fn
    pool = (torch.randn(6, HV, dk, dv, generator=torch.Generator().manual_seed(2)) * 0.5).to(dtype)
    before = pool.clone()
    x = make_inputs(seqlens=[9, 4], num_qk_heads=1, num_v_heads=HV, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32, seed=6)
    cu = x.pop("cu_seqlens")
    with torch.no_grad():
        o, _ = torch_gdr.chunk_gated_delta_rule(*(x[f] for f in FIELDS[:4]), beta=x["beta"], initial_state=pool,
                                                initial_state_indices=torch.tensor([1, -1]),
                                                final_state_indices=torch.tensor([4, 5]), cu_seqlens=cu,
                                                use_qk_l2norm_in_kernel=True, backend=backend)
    for start, final, tokens in [(1, 4, range(0, 9)), (-1, 5, range(9, 13))]:
        state = torch.zeros(HV, dk, dv, dtype=torch.float64) if start < 0 else before[start].double()
        outs, states = reference_tokens(x, list(tokens), state, None, True)
        assert rmse_ratio(torch.stack(outs), o[0, list(tokens)].double()) < 0.005
        assert_stored(pool[final], states[-1], dtype)
    assert torch.equal(pool[[0, 1, 2, 3]].view(torch.uint8), before[[0, 1, 2, 3]].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
def test_pool_cache_with_an_fp8_dtype(dtype: torch.dtype) -> None:
    """A layer's prompt and decode steps over a cache of fp8 pools: the outputs follow the
    layer run without a cache (the state rounded to fp8 between calls) within rmse 0.05,
    and the pools are fp8."""
    layer = make_layer("torch").eval()
    cache = GatedDeltaNetPoolCache(slots=2, dtype=dtype)
    cache.allocate(["a"])
    x = inputs(1, 6)
    with torch.no_grad():
        y = torch.cat([layer(x[:, :4], cache=cache.batch(["a"]))]
                      + [layer(x[:, t:t + 1], cache=cache.batch(["a"])) for t in (4, 5)], 1)
        want = layer(x)
    assert cache.layers[layer.cache_key].recurrent_pool.dtype == dtype
    assert rmse_ratio(want.double(), y.double()) < 0.05
