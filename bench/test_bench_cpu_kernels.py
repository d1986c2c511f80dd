"""The fused CPU kernels (torch_gdr.ops.cpu) against the HF fallback, a GEMM and a state copy,
timed alternately in the same rounds (see test_bench_paired.py for why), for the
CPU kernels' performance targets:

- forward at 4096x4 and 16384x2: the speed-up over HF and the share of a 2048^3 fp32 GEMM
  timed in the same rounds, by the forward FLOP model of _common.forward_flops;
- forward + backward at 4096x4: the speed-up over HF (autograd through its fallback) and
  peak memory (_common.peak_memory_mib of the public call, a fresh process each);
- forward + backward time per token from T = 1024 to 16384 (each round runs every length);
- a decode step (B = 1 and 8, H 16 / HV 32, K = V = 128, fp32 state) against a copy of the
  state (one read, one write).

Every round's ratio is kept; the summary at the end gives medians and ranges.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import pytest
import torch

from _common import CHUNK, SHAPES, forward_backward, forward_flops, make_inputs, peak_memory_mib, run_hf
from conftest import GEMM_SIZE

cpu = pytest.importorskip("torch_gdr.ops.cpu.kernels")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels unavailable")

_SUMMARY: list[str] = []


class _SummaryPlugin:
    """Prints the module's lines in the run's closing summary (next to conftest's)."""

    @staticmethod
    def pytest_terminal_summary(terminalreporter) -> None:
        if _SUMMARY:
            terminalreporter.section("fused CPU kernels (torch_gdr.ops.cpu), alternated rounds")
            for line in _SUMMARY:
                terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    manager = request.config.pluginmanager
    if not manager.is_registered(_SummaryPlugin):
        manager.register(_SummaryPlugin, "torch_gdr_cpu_kernels_summary")
    yield


def _spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} (range {min(xs):.2f}-{max(xs):.2f}, {len(xs)} rounds)"


def _quartiles(xs: list[float]) -> str:
    low, mid, high = statistics.quantiles(xs, n=4)
    return f"median {mid:.2f} (quartiles {low:.2f}-{high:.2f}, {len(xs)} rounds)"


def cpu_forward(q, k, v, g, beta):
    return cpu.chunk_fwd(q, k, v, g, beta, None, None, False, None, CHUNK, False)


def cpu_forward_backward(q, k, v, g, beta):
    o, s, states = cpu.chunk_fwd(q, k, v, g, beta, None, None, False, None, CHUNK, True)
    # the loss of _common.forward_backward: o.sum() + state.sum()
    return cpu.chunk_bwd(torch.ones_like(o), torch.ones_like(s), q, k, v, g, beta, None, None, False, None, CHUNK,
                         states)


def _alternate(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Time every call once per round, the order rotating; one warm-up round first."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            start = time.perf_counter()
            calls[n]()
            elapsed = time.perf_counter() - start
            if r:
                times[n].append(elapsed)
    return times


@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_forward_paired(benchmark, requires_hf, shape):
    batch, seq_len, heads, dim = SHAPES[shape]
    inputs = make_inputs(batch, seq_len, heads, dim)
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE), torch.randn(GEMM_SIZE, GEMM_SIZE)
    product = torch.empty(GEMM_SIZE, GEMM_SIZE)
    calls = {"cpu": lambda: cpu_forward(*inputs), "hf": lambda: run_hf(*inputs),
             "gemm": lambda: torch.mm(a, b, out=product)}
    with torch.no_grad():
        times = benchmark.pedantic(_alternate, args=(calls, 7 if seq_len <= 4096 else 5), rounds=1, iterations=1)
    # the FLOP model of the chunk the kernel runs (a forward without states: forward_chunk_size)
    flops = forward_flops(batch * seq_len, heads, dim, cpu.forward_chunk_size(CHUNK, False))
    gemm_flops = 2 * GEMM_SIZE**3
    speedups = [h / c for c, h in zip(times["cpu"], times["hf"])]
    shares = [100 * flops * tg / (gemm_flops * tc) for tc, tg in zip(times["cpu"], times["gemm"])]
    benchmark.extra_info.update(cpu_ms=[t * 1e3 for t in times["cpu"]], hf_ms=[t * 1e3 for t in times["hf"]],
                                speedup_vs_hf=speedups, pct_of_same_round_gemm=shares)
    _SUMMARY.append(f"forward {shape}: {statistics.median(times['cpu']) * 1e3:.1f} ms; x HF {_spread(speedups)}; "
                    f"% of same-round GEMM {_spread(shares)}")


def test_cpu_forward_backward_paired(benchmark, requires_hf):
    shape = "4096x4"
    batch, seq_len, heads, dim = SHAPES[shape]
    plain = make_inputs(batch, seq_len, heads, dim)
    with_grad = make_inputs(batch, seq_len, heads, dim, requires_grad=True)
    calls = {"cpu": lambda: cpu_forward_backward(*plain), "hf": lambda: forward_backward(run_hf, with_grad)}
    times = benchmark.pedantic(_alternate, args=(calls, 5), rounds=1, iterations=1)
    speedups = [h / c for c, h in zip(times["cpu"], times["hf"])]
    benchmark.extra_info.update(cpu_ms=[t * 1e3 for t in times["cpu"]], hf_ms=[t * 1e3 for t in times["hf"]],
                                speedup_vs_hf=speedups)
    _SUMMARY.append(f"fwd+bwd {shape}: {statistics.median(times['cpu']) * 1e3:.1f} ms; x HF {_spread(speedups)}")


def test_cpu_forward_backward_peak_memory(benchmark, requires_hf):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc")
    shape = SHAPES["4096x4"]
    # the public call's torch backend runs the fused kernels on the CPU, through autograd
    ours, theirs = benchmark.pedantic(lambda: (peak_memory_mib("torch_gdr", shape), peak_memory_mib("hf_fallback", shape)),
                                      rounds=1, iterations=1)
    benchmark.extra_info.update(cpu_peak_mib=ours, hf_peak_mib=theirs, ratio=ours / theirs)
    _SUMMARY.append(f"fwd+bwd 4096x4 peak memory: {ours:.0f} MiB vs HF {theirs:.0f} MiB (ratio {ours / theirs:.2f})")


LENGTHS = [1024, 2048, 4096, 8192, 16384]


def test_cpu_forward_backward_time_per_token(benchmark):
    inputs = {t: make_inputs(1, t, 4, 128) for t in LENGTHS}
    calls = {t: (lambda t=t: cpu_forward_backward(*inputs[t])) for t in LENGTHS}
    times = benchmark.pedantic(_alternate, args=(calls, 5), rounds=1, iterations=1)
    per_token = {t: statistics.median(times[t]) / t * 1e6 for t in LENGTHS}
    spread = max(per_token.values()) / min(per_token.values())
    benchmark.extra_info.update(us_per_token=per_token, largest_over_smallest=spread)
    cells = " / ".join(f"{per_token[t]:.1f}" for t in LENGTHS)
    _SUMMARY.append(f"fwd+bwd us per token, T {LENGTHS[0]}..{LENGTHS[-1]}: {cells} (largest / smallest {spread:.2f})")


@pytest.mark.parametrize("batch", [1, 8])
def test_cpu_decode_step_vs_state_copy(benchmark, batch):
    heads, v_heads, dim = 16, 32, 128
    gen = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(batch, 1, heads, dim, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, 1, heads, dim, generator=gen), dim=-1)
    v = torch.randn(batch, 1, v_heads, dim, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(batch, 1, v_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, 1, v_heads, generator=gen))
    state = torch.randn(batch, v_heads, dim, dim, generator=gen)
    other = torch.empty_like(state)
    copy_dst = torch.empty_like(state)
    buffers = [state, other]

    def step_out():  # read one state, write the other (ping-pong)
        cpu.recurrent_fwd(q, k, v, g, beta, None, buffers[0], False, None, out_state=buffers[1])
        buffers.reverse()

    def step_in_place():
        cpu.recurrent_fwd(q, k, v, g, beta, None, state, False, None, out_state=state)

    calls = {"out": step_out, "in_place": step_in_place, "copy": lambda: copy_dst.copy_(buffers[0])}
    times = benchmark.pedantic(_alternate, args=(calls, 200), rounds=1, iterations=1)
    out_ratio = [a / c for a, c in zip(times["out"], times["copy"])]
    in_ratio = [a / c for a, c in zip(times["in_place"], times["copy"])]
    benchmark.extra_info.update(out_over_copy=statistics.median(out_ratio),
                                in_place_over_copy=statistics.median(in_ratio),
                                copy_us=statistics.median(times["copy"]) * 1e6)
    _SUMMARY.append(f"decode B={batch} H16/HV32 K=V=128: copy {statistics.median(times['copy']) * 1e6:.0f} us; "
                    f"step/copy out-of-place {_quartiles(out_ratio)}; in place {_quartiles(in_ratio)}")


def test_cpu_gating_in_kernel_vs_precomputed(benchmark):
    """fla's activations (``use_gate_in_kernel`` + ``use_beta_sigmoid_in_kernel``) computed in
    the kernels, forward + backward through the public call on ``"cpu"`` (gradients of the raw
    gate, the logits, ``A_log`` and ``dt_bias`` included), against the same call on g and beta
    computed beforehand (no activation at all, its gradients stop at g and beta) and against
    the activations written in torch before the call (what the public call did before the
    kernels had them). T = 4096, H = HV = 4, K = V = 128, fp32."""
    import torch_gdr

    batch, seq_len, heads, dim = SHAPES["4096x4"]
    q, k, v, _, _ = make_inputs(batch, seq_len, heads, dim)
    gen = torch.Generator().manual_seed(1)
    raw_gate = torch.randn(batch, seq_len, heads, generator=gen)
    logits = torch.randn(batch, seq_len, heads, generator=gen)
    a_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(heads, generator=gen)
    with torch.no_grad():
        g = -a_log.exp() * torch.nn.functional.softplus(raw_gate + dt_bias)
        beta = logits.sigmoid()

    def leaves(*tensors):
        return [t.detach().clone().requires_grad_() for t in tensors]

    fused, plain, by_hand = (leaves(q, k, v, raw_gate, logits, a_log, dt_bias), leaves(q, k, v, g, beta),
                             leaves(q, k, v, raw_gate, logits, a_log, dt_bias))

    def backward(o, state, tensors):
        (o.sum() + state.sum()).backward()
        for t in tensors:
            t.grad = None

    def run_fused():
        o, s = torch_gdr.chunk_gated_delta_rule(*fused[:5], output_final_state=True, use_gate_in_kernel=True,
                                                A_log=fused[5], dt_bias=fused[6], use_beta_sigmoid_in_kernel=True,
                                                chunk_size=CHUNK, backend="cpu")
        backward(o, s, fused)

    def run_plain():
        o, s = torch_gdr.chunk_gated_delta_rule(*plain, output_final_state=True, chunk_size=CHUNK, backend="cpu")
        backward(o, s, plain)

    def run_by_hand():
        q_, k_, v_, a_, b_, a_log_, dt_ = by_hand
        g_ = -a_log_.exp() * torch.nn.functional.softplus(a_ + dt_)
        o, s = torch_gdr.chunk_gated_delta_rule(q_, k_, v_, g_, b_.sigmoid(), output_final_state=True,
                                                chunk_size=CHUNK, backend="cpu")
        backward(o, s, by_hand)

    calls = {"fused": run_fused, "precomputed": run_plain, "torch_activations": run_by_hand}
    times = benchmark.pedantic(_alternate, args=(calls, 7), rounds=1, iterations=1)
    fused_ratio = [f / p for f, p in zip(times["fused"], times["precomputed"])]
    torch_ratio = [t / p for t, p in zip(times["torch_activations"], times["precomputed"])]
    benchmark.extra_info.update(precomputed_ms=[t * 1e3 for t in times["precomputed"]],
                                fused_over_precomputed=fused_ratio, torch_activations_over_precomputed=torch_ratio)
    _SUMMARY.append(f"fwd+bwd 4096x4 with the activations: precomputed g/beta "
                    f"{statistics.median(times['precomputed']) * 1e3:.1f} ms; in-kernel / precomputed "
                    f"{_spread(fused_ratio)}; in torch before the call / precomputed {_spread(torch_ratio)}")
