"""Forward + backward of torch_gdr vs the HF Qwen3-Next fallback, with peak memory."""

from __future__ import annotations

import pytest

from _common import IMPLS, SHAPES, forward_backward, forward_flops, make_inputs, peak_memory_mib
from conftest import record


@pytest.mark.parametrize("impl", ["hf_fallback", "torch_gdr"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_backward(benchmark, gemm_gflops, memory, impl, shape, request):
    if impl == "hf_fallback":
        request.getfixturevalue("requires_hf")
    batch, seq_len, heads, dim = SHAPES[shape]
    inputs = make_inputs(batch, seq_len, heads, dim, requires_grad=True)
    fn = IMPLS[impl]
    forward_backward(fn, inputs)
    rounds = 3 if (impl == "hf_fallback" and seq_len > 4096) else 5
    benchmark.pedantic(forward_backward, args=(fn, inputs), rounds=rounds, warmup_rounds=0)
    # GFLOP/s here counts the forward's nominal flops only (a lower bound of the work done).
    record(benchmark, "fwd+bwd", shape, impl, batch * seq_len, forward_flops(batch * seq_len, heads, dim),
           gemm_gflops)
    peak = peak_memory_mib(impl, SHAPES[shape])
    if peak is not None:
        memory[(shape, impl)] = peak
        benchmark.extra_info["peak_mib"] = peak
        other = memory.get((shape, "hf_fallback"))
        if impl == "torch_gdr" and other:
            benchmark.extra_info["peak_ratio_vs_hf"] = peak / other
