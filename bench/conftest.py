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


_CEILING: dict[str, float] = {}  # "gemm_gflops" -> the session's GEMM ceiling


@pytest.fixture(scope="session")
def gemm_gflops() -> float:
    _CEILING["gemm_gflops"] = measure_gemm_gflops()
    return _CEILING["gemm_gflops"]


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


# The acceptance lines of the CPU performance issue, at (1, 4096, 4, 128) unless said.
TARGET_FORWARD_SPEEDUP = 2.0
TARGET_FORWARD_GEMM_SHARE = 60.0  # percent
TARGET_TRAINING_SPEEDUP = 5.0
TARGET_PER_TOKEN_SPREAD = 1.25  # largest / smallest time per token, T 1024 .. 16384
TARGET_MEMORY_RATIO = 1 / 3


def _acceptance_rows() -> list[tuple[str, str, float, str]]:
    """``(line, measure, value, target)`` for every acceptance line this run measured."""
    rows = []
    shape = "4096x4"
    ours, theirs = _RESULTS.get(("forward", shape, "torch_gdr")), _RESULTS.get(("forward", shape, "hf_fallback"))
    forward_line = f"forward >= {TARGET_FORWARD_SPEEDUP:g}x HF"
    if ours and theirs:
        rows.append((forward_line, "separate tests", theirs / ours, f">= {TARGET_FORWARD_SPEEDUP:g}"))
    share_line = f"forward >= {TARGET_FORWARD_GEMM_SHARE:g}% of GEMM"
    if ours and "gemm_gflops" in _CEILING:
        from _common import SHAPES, forward_flops

        batch, seq_len, heads, dim = SHAPES[shape]
        share = 100 * forward_flops(batch * seq_len, heads, dim) / ours / 1e9 / _CEILING["gemm_gflops"]
        rows.append((share_line, "separate test, run's best GEMM", share, f">= {TARGET_FORWARD_GEMM_SHARE:g}"))
    paired = _PAIRED.get(("forward", shape))
    if paired:
        rows.append((forward_line, "alternated calls", paired[2], f">= {TARGET_FORWARD_SPEEDUP:g}"))
        if paired[4] is not None:
            rows.append((share_line, "alternated, same-round GEMM", paired[4], f">= {TARGET_FORWARD_GEMM_SHARE:g}"))
    training_line = f"fwd+bwd >= {TARGET_TRAINING_SPEEDUP:g}x HF"
    ours, theirs = _RESULTS.get(("fwd+bwd", shape, "torch_gdr")), _RESULTS.get(("fwd+bwd", shape, "hf_fallback"))
    if ours and theirs:
        rows.append((training_line, "separate tests", theirs / ours, f">= {TARGET_TRAINING_SPEEDUP:g}"))
    paired = _PAIRED.get(("fwd+bwd", shape))
    if paired:
        rows.append((training_line, "alternated calls", paired[2], f">= {TARGET_TRAINING_SPEEDUP:g}"))
    per_token = [median / int(name[2:]) for (kind, name, _), median in _RESULTS.items() if kind == "scaling"]
    if len(per_token) > 1:
        rows.append(("fwd+bwd time per token flat within 25%", "largest / smallest, T 1024..16384",
                     max(per_token) / min(per_token), f"<= {TARGET_PER_TOKEN_SPREAD:g}"))
    m_ours, m_theirs = _MEMORY.get((shape, "torch_gdr")), _MEMORY.get((shape, "hf_fallback"))
    if m_ours and m_theirs:
        rows.append(("fwd+bwd peak memory <= 1/3 of HF", "ours / HF", m_ours / m_theirs,
                     f"<= {TARGET_MEMORY_RATIO:.3f}"))
    return rows


def _holds(value: float, target: str) -> bool:
    op, bound = target.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def pytest_terminal_summary(terminalreporter) -> None:
    tr = terminalreporter
    rows = _acceptance_rows()
    if rows:
        tr.section("acceptance lines at 1 x 4096, H 4, K = V = 128 (this run)")
        for line, measure, value, target in rows:
            verdict = "holds" if _holds(value, target) else "MISSED"
            tr.write_line(f"{line:<42}{measure:<36}{value:>8.2f}  {target:<9}{verdict}")
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
