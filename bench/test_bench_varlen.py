"""Varlen packing: 8 sequences of uneven lengths (4096 tokens in all) packed with cu_seqlens,
against the same tokens as one batched call of equal lengths, and the HF fallback called
once per sequence (it has no varlen)."""

from __future__ import annotations

import pytest
import torch

from _common import IMPLS, forward_backward, forward_flops, make_inputs
from conftest import record

LENGTHS = [1000, 37, 640, 0, 1100, 64, 900, 355]  # sum 4096, one empty sequence
CU_SEQLENS = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())


def _ours_varlen(q, k, v, g, beta):
    return IMPLS["torch_gdr"](q, k, v, g, beta, cu_seqlens=CU_SEQLENS)


def _hf_per_sequence(q, k, v, g, beta):
    outs, states = [], []
    for start, end in zip(CU_SEQLENS[:-1].tolist(), CU_SEQLENS[1:].tolist()):
        if end > start:
            o, s = IMPLS["hf_fallback"](*(t[:, start:end] for t in (q, k, v, g, beta)))
            outs.append(o)
            states.append(s)
    return torch.cat(outs, 1), torch.cat(states, 0)


@pytest.mark.parametrize("mode", ["forward", "fwd+bwd"])
@pytest.mark.parametrize("impl", ["hf_fallback", "torch_gdr"])
def test_varlen(benchmark, gemm_gflops, mode, impl, request):
    if impl == "hf_fallback":
        request.getfixturevalue("requires_hf")
    fn = _hf_per_sequence if impl == "hf_fallback" else _ours_varlen
    inputs = make_inputs(1, int(CU_SEQLENS[-1]), 4, 128, requires_grad=mode == "fwd+bwd")
    if mode == "forward":
        with torch.no_grad():
            fn(*inputs)
            benchmark.pedantic(fn, args=inputs, rounds=5, warmup_rounds=1)
    else:
        forward_backward(fn, inputs)
        benchmark.pedantic(forward_backward, args=(fn, inputs), rounds=5)
    flops = sum(forward_flops(n, 4, 128) for n in LENGTHS)
    record(benchmark, f"varlen {mode}", "8 seqs", impl, int(CU_SEQLENS[-1]), flops, gemm_gflops)
