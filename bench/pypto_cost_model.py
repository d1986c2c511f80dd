"""Measure the PyPTO GDR kernel on the default workload.

Reports, for packed sequences of lengths [300, 17, 0, 130] (T = 447), H = 2, HV = 4,
K = V = 128, l = 64, with an initial state:

* the CPU interpreter: time of the first call (includes the trace) and of later calls, and
  the max abs error against the float64 recurrence;
* pypto's cost model (stock SIM mode, an Ascend 910B "A2A3" model): "Total Cycles" of one
  launch from ``CostModelSimulationOutput/_simulate.stat.report.txt`` and the time in µs
  (cycles / 1800, pypto's own conversion), plus how long the SIM compile took.

Every file PyPTO writes goes to a temporary directory under the torch_gdr cache, removed
at the end. Run: ``PYTHONPATH=. python bench/pypto_cost_model.py [--head-dim 64]``.

Measured (pypto 0.2.0, torch 2.13.0 CPU, 2 shared x86-64 cores under load 2-6, so the
wall times are noisy; the cycle counts are deterministic):

=============  ====================  ===================  ==================  ===========
K = V          interpreter / call    SIM compile + model  total cycles        µs (/1800)
=============  ====================  ===================  ==================  ===========
128            2.2-8 s               2.2-6.8 s            617,054             342.8
64             1.3-2.2 s             2.8-3.5 s            472,362             262.4
=============  ====================  ===================  ==================  ===========

Max abs error against the float64 recurrence: 1.5e-7 (o), 1.2e-6 (final state) at 128.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from torch_gdr.ops.pypto import kernel_cache
from torch_gdr.ops.pypto._env import import_pypto, redirected_output, scratch_dir
from torch_gdr.ops.pypto.forward import pypto_chunk_gated_delta_rule_fwd
from torch_gdr.ops.pypto.kernel import build_gdr_kernel, chunk_masks
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

CYCLES_PER_US = 1800.0
DEFAULT_LENS = (300, 17, 0, 130)


def make_workload(lens: tuple[int, ...], heads: int, v_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    t = sum(lens)
    return dict(
        q=torch.randn(t, heads, head_dim, generator=gen),
        k=torch.randn(t, heads, head_dim, generator=gen),
        v=torch.randn(t, v_heads, head_dim, generator=gen),
        g=F.logsigmoid(torch.randn(t, v_heads, generator=gen)),
        beta=torch.sigmoid(torch.randn(t, v_heads, generator=gen)),
        cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32),
        initial_state=0.5 * torch.randn(len(lens), v_heads, head_dim, head_dim, generator=gen),
    )


def time_interpreter(w: dict[str, torch.Tensor], chunk_size: int, repeats: int) -> dict[str, float]:
    names = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")
    scale = w["q"].shape[-1] ** -0.5
    kernel_cache.cache_clear()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        o, state = pypto_chunk_gated_delta_rule_fwd(
            *(w[n] for n in names), scale=scale, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size
        )
        times.append(time.perf_counter() - t0)
    ref_o, ref_state = naive_recurrent_gated_delta_rule(
        *(w[n].double().unsqueeze(0) for n in ("q", "k", "v", "g", "beta")), scale=scale,
        initial_state=w["initial_state"].double(), use_qk_l2norm_in_kernel=True, cu_seqlens=w["cu_seqlens"].long(),
    )
    ref_o = ref_o[0]
    info = kernel_cache.cache_info()
    return dict(
        first_call_s=times[0],
        later_call_s=sum(times[1:]) / max(1, len(times) - 1),
        max_err_o=float((o.double() - ref_o).abs().max()),
        max_err_state=float((state.double() - ref_state).abs().max()),
        cache_hits=info.hits,
        cache_misses=info.misses,
    )


@contextlib.contextmanager
def silenced_output() -> Iterator[None]:
    """Silence fds 1 and 2: pypto's cost-model plotting scripts print there (and fail
    noisily without matplotlib); pypto's own errors still surface as Python exceptions."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(os.devnull, "w") as devnull:
        for fd in saved:
            os.dup2(devnull.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


def cost_model(w: dict[str, torch.Tensor], chunk_size: int) -> dict[str, float]:
    """Compile in stock SIM mode and read the cost model's total cycles."""
    import_pypto()
    num_tokens, heads, head_dim = w["q"].shape
    v_heads = w["v"].shape[1]
    kernel = build_gdr_kernel(
        num_seqs=w["cu_seqlens"].numel() - 1, num_qk_heads=heads, num_v_heads=v_heads,
        head_k_dim=head_dim, head_v_dim=head_dim, chunk_size=chunk_size, use_qk_l2norm=True,
        scale=head_dim ** -0.5, has_initial_state=True,
    )
    o = torch.zeros(num_tokens, v_heads, head_dim)
    state = torch.zeros_like(w["initial_state"])
    args = [w["q"], w["k"], w["v"], w["g"], w["beta"], w["cu_seqlens"], chunk_masks(chunk_size),
            w["initial_state"], o, state]
    with scratch_dir("costmodel_") as scratch, redirected_output(scratch):
        t0 = time.perf_counter()
        with silenced_output():
            kernel(*args)
        seconds = time.perf_counter() - t0
        reports = sorted(scratch.rglob("_simulate.stat.report.txt"))
        if not reports:
            raise RuntimeError("the cost model wrote no _simulate.stat.report.txt")
        text = reports[-1].read_text()
    match = re.search(r"Total Cycles\D*(\d[\d,]*)", text)
    if match is None:
        raise RuntimeError("no 'Total Cycles' in the cost-model report:\n" + text[:2000])
    cycles = int(match.group(1).replace(",", ""))
    return dict(sim_compile_and_model_s=seconds, total_cycles=cycles, total_us=cycles / CYCLES_PER_US)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    parser.add_argument("--chunk-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--repeats", type=int, default=3, help="interpreter calls to time")
    parser.add_argument("--skip-interpreter", action="store_true")
    args = parser.parse_args()
    w = make_workload(DEFAULT_LENS, heads=2, v_heads=4, head_dim=args.head_dim)
    print(f"workload: lens={list(DEFAULT_LENS)} T={sum(DEFAULT_LENS)} H=2 HV=4 K=V={args.head_dim} "
          f"l={args.chunk_size} initial_state=yes l2norm=yes")
    if not args.skip_interpreter:
        for name, value in time_interpreter(w, args.chunk_size, args.repeats).items():
            print(f"interpreter {name}: {value:.4g}")
    for name, value in cost_model(w, args.chunk_size).items():
        print(f"cost model {name}: {value:.6g}")


if __name__ == "__main__":
    main()
