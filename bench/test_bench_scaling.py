"""Time per token of torch_gdr's forward + backward from T = 1024 to 16384 at H = 4, D = 128:
the chunked algorithm is linear in T, so this should stay flat."""

from __future__ import annotations

import pytest

from _common import IMPLS, forward_backward, forward_flops, make_inputs
from conftest import record

LENGTHS = [1024, 2048, 4096, 8192, 16384]


@pytest.mark.parametrize("seq_len", LENGTHS)
def test_scaling_forward_backward(benchmark, gemm_gflops, seq_len):
    inputs = make_inputs(1, seq_len, 4, 128, requires_grad=True)
    fn = IMPLS["torch_gdr"]
    forward_backward(fn, inputs)
    benchmark.pedantic(forward_backward, args=(fn, inputs), rounds=5 if seq_len <= 4096 else 3)
    record(benchmark, "scaling", f"T={seq_len}", "torch_gdr", seq_len, forward_flops(seq_len, 4, 128), gemm_gflops)
    benchmark.extra_info["us_per_token"] = benchmark.stats.stats.median / seq_len * 1e6
