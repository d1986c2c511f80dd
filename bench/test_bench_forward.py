"""Forward (no autograd) of torch_gdr vs the HF Qwen3-Next fallback, and the GEMM ceiling."""

from __future__ import annotations

import pytest
import torch

from _common import IMPLS, SHAPES, forward_flops, make_inputs
from conftest import GEMM_SIZE, record


def test_gemm_baseline(benchmark, gemm_gflops):
    """torch fp32 matmul at GEMM_SIZE^3: the throughput ceiling every GFLOP/s is compared to."""
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    benchmark.pedantic(torch.matmul, args=(a, b), rounds=7, warmup_rounds=1)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(threads=torch.get_num_threads(), size=GEMM_SIZE,
                                gflops=2 * GEMM_SIZE**3 / median / 1e9, session_gemm_ceiling_gflops=gemm_gflops)


@pytest.mark.parametrize("impl", ["hf_fallback", "torch_gdr"])  # HF first, so ours can report the ratio
@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward(benchmark, gemm_gflops, impl, shape, request):
    if impl == "hf_fallback":
        request.getfixturevalue("requires_hf")
    batch, seq_len, heads, dim = SHAPES[shape]
    inputs = make_inputs(batch, seq_len, heads, dim)
    fn = IMPLS[impl]
    with torch.no_grad():
        fn(*inputs)
        benchmark.pedantic(fn, args=inputs, rounds=7, warmup_rounds=1)
    record(benchmark, "forward", shape, impl, batch * seq_len, forward_flops(batch * seq_len, heads, dim),
           gemm_gflops)
