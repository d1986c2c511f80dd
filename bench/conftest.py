"""Fixtures of the benchmark suite and a side-by-side summary at the end of the run.

Every timing goes through pytest-benchmark; throughput (tokens/s), achieved GFLOP/s and,
where the HF fallback ran in the same session, the speed ratio land in ``extra_info``.
The GEMM baseline (torch fp32 matmul) is measured once per session and every GFLOP/s is
also reported as a percentage of it.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import pytest
import torch

from _common import hf_fallback

_RESULTS: dict[tuple[str, str, str], float] = {}  # (kind, shape, impl) -> median seconds
_MEMORY: dict[tuple[str, str], float] = {}  # (shape, impl) -> peak MiB
_PAIRED: dict[tuple[str, str], tuple] = {}  # (kind, shape) -> see record_paired
GEMM_SIZE = 2048


def measure_gemm_gflops(size: int = GEMM_SIZE, repeats: int = 10) -> float:
    """The fp32 GEMM ceiling of torch on this machine at its current thread count: the best
    of ``repeats`` square matmuls (the best, not the median, so that a noisy moment cannot
    lower the bar every percentage is measured against)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


@pytest.fixture(scope="session")
def gemm_gflops() -> float:
    return measure_gemm_gflops()


@pytest.fixture
def requires_hf():
    if hf_fallback() is None:
        pytest.skip("transformers (the bench extra) is not installed")


@pytest.fixture(scope="session")
def results() -> dict:
    return _RESULTS


@pytest.fixture(scope="session")
def memory() -> dict:
    return _MEMORY


def record(benchmark, kind: str, shape: str, impl: str, tokens: int, flops: float, gemm: float) -> None:
    """Put throughput, GFLOP/s, % of GEMM and (when both ran) the ratio to the other
    implementation into ``extra_info``."""
    median = benchmark.stats.stats.median
    _RESULTS[(kind, shape, impl)] = median
    info = benchmark.extra_info
    info.update(threads=torch.get_num_threads(), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
                tokens=tokens, median_ms=median * 1e3,
                tokens_per_s=tokens / median, gflops=flops / median / 1e9, gemm_gflops=gemm,
                pct_of_gemm=100 * flops / median / 1e9 / gemm)
    other = {"torch_gdr": "hf_fallback", "hf_fallback": "torch_gdr"}.get(impl)
    if other and (kind, shape, other) in _RESULTS:
        ours = _RESULTS.get((kind, shape, "torch_gdr"))
        theirs = _RESULTS.get((kind, shape, "hf_fallback"))
        info["speedup_vs_hf"] = theirs / ours


def record_paired(kind: str, shape: str, ours: float, theirs: float, ratio: float, pct_of_gemm: float,
                  pct_of_paired_gemm: Optional[float] = None) -> None:
    """Median seconds of each side, the median of the per-round ratios, ours as % of the
    session's GEMM ceiling (forward flops) and, where rounds timed a GEMM too, the median of
    the per-round shares of it, from calls timed alternately (bench/test_bench_paired.py)."""
    _PAIRED[(kind, shape)] = (ours, theirs, ratio, pct_of_gemm, pct_of_paired_gemm)


def pytest_terminal_summary(terminalreporter) -> None:
    tr = terminalreporter
    if _PAIRED:
        tr.section("torch_gdr vs HF fallback, calls alternated (medians)")
        tr.write_line(f"{'kind':<14}{'shape':<12}{'torch_gdr ms':>14}{'hf ms':>12}{'speedup':>10}{'% of GEMM':>11}"
                      f"{'% same-round GEMM':>19}")
        for (kind, shape), (ours, theirs, ratio, pct, paired_pct) in sorted(_PAIRED.items()):
            forward = kind == "forward"  # a forward-flop share means nothing for fwd+bwd
            share = f"{pct:.0f}%" if forward else "-"
            same_round = f"{paired_pct:.0f}%" if forward and paired_pct is not None else "-"
            tr.write_line(f"{kind:<14}{shape:<12}{ours * 1e3:>14.1f}{theirs * 1e3:>12.1f}{ratio:>9.2f}x{share:>11}"
                          f"{same_round:>19}")
    if not _RESULTS:
        return
    tr.section("torch_gdr vs HF fallback (median, this run)")
    tr.write_line(f"{'kind':<14}{'shape':<12}{'torch_gdr ms':>14}{'hf ms':>12}{'speedup':>10}"
                  f"{'ours MiB':>10}{'hf MiB':>10}{'mem ratio':>11}")
    for kind, shape in sorted({(k, s) for k, s, _ in _RESULTS}):
        ours, theirs = _RESULTS.get((kind, shape, "torch_gdr")), _RESULTS.get((kind, shape, "hf_fallback"))
        m_ours, m_theirs = _MEMORY.get((shape, "torch_gdr")), _MEMORY.get((shape, "hf_fallback"))
        fmt = lambda x, f: (f % x) if x is not None else "-"  # noqa: E731
        mem = kind == "fwd+bwd"
        tr.write_line(
            f"{kind:<14}{shape:<12}{fmt(ours and ours * 1e3, '%.1f'):>14}{fmt(theirs and theirs * 1e3, '%.1f'):>12}"
            f"{fmt(theirs / ours if ours and theirs else None, '%.2fx'):>10}"
            f"{fmt(m_ours if mem else None, '%.0f'):>10}{fmt(m_theirs if mem else None, '%.0f'):>10}"
            f"{fmt(m_ours / m_theirs if mem and m_ours and m_theirs else None, '%.2f'):>11}")
