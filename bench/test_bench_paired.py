"""torch_gdr and the HF fallback timed alternately, call for call, at the issue's shapes.

On a shared machine whose speed drifts by tens of percent within a minute, the ratio of
two tests run a minute apart measures the drift as much as the code. Here each round times
one call of each (who goes first alternates), so both see the same conditions; the
summary reports the median of the per-round ratios next to the separate tests' ratio.
Forward rounds also time one GEMM of the session ceiling's size, so that the share of the
GEMM is measured under the same conditions too (the median of the per-round shares, next
to the share of the session's best GEMM).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from _common import IMPLS, SHAPES, forward_backward, forward_flops, make_inputs
from conftest import GEMM_SIZE, record_paired

ROUNDS = {"forward": 11, "fwd+bwd": 5}


@pytest.mark.parametrize("kind", list(ROUNDS))
@pytest.mark.parametrize("shape", ["4096x4"])
def test_paired(benchmark, gemm_gflops, requires_hf, kind, shape):
    batch, seq_len, heads, dim = SHAPES[shape]
    inputs = make_inputs(batch, seq_len, heads, dim, requires_grad=kind == "fwd+bwd")

    def call(impl: str) -> None:
        if kind == "forward":
            with torch.no_grad():
                IMPLS[impl](*inputs)
        else:
            forward_backward(IMPLS[impl], inputs)

    times: dict[str, list[float]] = {"torch_gdr": [], "hf_fallback": [], "gemm": []}
    order = ["torch_gdr", "hf_fallback"]
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    product = torch.empty(GEMM_SIZE, GEMM_SIZE)

    def one_round() -> None:
        for impl in order:
            start = time.perf_counter()
            call(impl)
            times[impl].append(time.perf_counter() - start)
        order.reverse()
        if kind == "forward":
            start = time.perf_counter()
            torch.mm(a, b, out=product)
            times["gemm"].append(time.perf_counter() - start)

    one_round()  # warm-up
    for t in times.values():
        t.clear()
    benchmark.pedantic(one_round, rounds=ROUNDS[kind], warmup_rounds=0)
    ratios = [theirs / ours for ours, theirs in zip(times["torch_gdr"], times["hf_fallback"])]
    ours, theirs = statistics.median(times["torch_gdr"]), statistics.median(times["hf_fallback"])
    flops = forward_flops(batch * seq_len, heads, dim)
    # ours / GEMM throughput, round by round: (flops / t_ours) / (gemm_flops / t_gemm)
    gemm_flops = 2 * GEMM_SIZE**3
    shares = [100 * flops * t_gemm / (gemm_flops * t_ours) for t_ours, t_gemm in zip(times["torch_gdr"], times["gemm"])]
    paired_share = statistics.median(shares) if shares else None
    benchmark.extra_info.update(ours_ms=ours * 1e3, hf_ms=theirs * 1e3, paired_ratio=statistics.median(ratios),
                                ratios=ratios, ours_gflops=flops / ours / 1e9,
                                ours_pct_of_gemm=100 * flops / ours / 1e9 / gemm_gflops, gemm_gflops=gemm_gflops,
                                ours_pct_of_paired_gemm=paired_share, pct_of_paired_gemm_by_round=shares)
    record_paired(kind, shape, ours, theirs, statistics.median(ratios), 100 * flops / ours / 1e9 / gemm_gflops,
                  paired_share)
