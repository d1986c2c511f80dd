"""The CPU decode step over a state pool, in place, side by side with its floor and with the
per-sequence state path an engine has without pools.

A pool of 512 slots of Qwen3-Next's linear-attention state (HV = 32 value heads, K = V =
128, float32: 2 MiB a row, 1 GiB in all, larger than the last-level cache), one token per
sequence at random rows, H = 16 q/k heads, q/k l2-normalised in the call. Each round times,
in alternating order and each on rows of its own (so that none finds another's rows in the
cache):

- ``pool_step``: :func:`torch_gdr.ops.cpu.pool.pool_recurrent_fwd`, the state read from and
  written to the pool rows in place;
- ``row_copy``: ``pool.index_copy_(0, rows, pool.index_select(0, rows))``, the floor (any step
  reads the rows and writes them back);
- ``per_sequence``: gather the rows, run the fused per-sequence step
  (:func:`torch_gdr.ops.cpu.kernels.recurrent_fwd`) in place on the gathered states, scatter
  them back.

Acceptance: ``pool_step`` at most 1.3x ``row_copy`` and no slower than ``per_sequence`` (the
medians of the per-round ratios).

    pytest bench/test_bench_pool.py -p benchmark --benchmark-only
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from torch_gdr.ops.cpu import kernels
from torch_gdr.ops.cpu.pool import pool_recurrent_fwd

HEADS, V_HEADS, DIM, SLOTS = 16, 32, 128, 512
ROUNDS = 31
TARGET_VS_COPY = 1.3
TARGET_VS_PER_SEQUENCE = 1.0


@pytest.fixture(scope="module")
def pool() -> torch.Tensor:
    return torch.randn(SLOTS, V_HEADS, DIM, DIM) * 0.05


def step_inputs(batch: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(batch, 1, HEADS, DIM, generator=gen), k=torch.randn(batch, 1, HEADS, DIM, generator=gen),
                v=torch.randn(batch, 1, V_HEADS, DIM, generator=gen),
                g=F.logsigmoid(torch.randn(batch, 1, V_HEADS, generator=gen)),
                beta=torch.sigmoid(torch.randn(batch, 1, V_HEADS, generator=gen)))


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_pool_decode_step(benchmark, pool: torch.Tensor, batch: int) -> None:
    if not kernels.available():
        pytest.skip(f"the fused CPU kernels are unavailable: {kernels.unavailable_reason()}")
    x = step_inputs(batch, seed=batch)
    gen = torch.Generator().manual_seed(1000 + batch)

    def fresh_rows() -> torch.Tensor:
        return torch.randperm(SLOTS, generator=gen)[:batch]

    def pool_step(rows: torch.Tensor) -> None:
        pool_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, pool, rows, use_qk_l2norm_in_kernel=True)

    def row_copy(rows: torch.Tensor) -> None:
        pool.index_copy_(0, rows, pool.index_select(0, rows))

    def per_sequence(rows: torch.Tensor) -> None:
        states = pool.index_select(0, rows)
        kernels.recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, states, True, None, out_state=states)
        pool.index_copy_(0, rows, states)

    calls: dict[str, Callable[[torch.Tensor], None]] = dict(pool_step=pool_step, row_copy=row_copy,
                                                            per_sequence=per_sequence)
    with torch.no_grad():  # the two steps agree
        rows = fresh_rows()
        start = pool.index_select(0, rows)
        pool_step(rows)
        after_pool_step = pool.index_select(0, rows)
        pool.index_copy_(0, rows, start)
        per_sequence(rows)
        torch.testing.assert_close(after_pool_step, pool.index_select(0, rows), atol=1e-5, rtol=1e-5)

    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)

    def one_round() -> None:
        with torch.no_grad():
            for name in order:
                rows = fresh_rows()
                begin = time.perf_counter()
                calls[name](rows)
                times[name].append(time.perf_counter() - begin)
        order.reverse()

    for _ in range(3):
        one_round()  # warm-up
    for t in times.values():
        t.clear()
    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=0)
    vs_copy = statistics.median(p / c for p, c in zip(times["pool_step"], times["row_copy"]))
    vs_per_seq = statistics.median(p / s for p, s in zip(times["pool_step"], times["per_sequence"]))
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    benchmark.extra_info.update(threads=torch.get_num_threads(), batch=batch,
                                **{f"{name}_us": m for name, m in medians.items()},
                                pool_step_vs_row_copy=vs_copy, pool_step_vs_per_sequence=vs_per_seq)
    print(f"\npool decode B={batch}: pool step {medians['pool_step']:.0f} us, row copy {medians['row_copy']:.0f} us, "
          f"per-sequence path {medians['per_sequence']:.0f} us; pool step / row copy {vs_copy:.2f} (target <= "
          f"{TARGET_VS_COPY:g}), / per-sequence {vs_per_seq:.2f} (target <= {TARGET_VS_PER_SEQUENCE:g})")
    assert vs_copy <= TARGET_VS_COPY, f"B={batch}: pool step {vs_copy:.2f}x the row copy"
    assert vs_per_seq <= TARGET_VS_PER_SEQUENCE, f"B={batch}: pool step {vs_per_seq:.2f}x the per-sequence path"
