"""The Python around the fused CPU pool step: what a decode call costs beside its kernel.

The extension's ``pool_recurrent_fwd`` is replaced by a stub that returns an output tensor
at once, so what is left is argument checking, dispatch and argument preparation. Timed in
CPU seconds of this process (one torch thread, best of several rounds), which other jobs on
the machine disturb less than wall time. H16/HV32, K = V = 128, a 512-slot float32 pool, one
token per sequence, rows changing every call (a serving loop: same shapes, new rows).

    PYTHONPATH=$PWD python bench/pool_call_overhead.py --batches 1 8 64

Rows of the table: ``public`` is ``torch_gdr.fused_recurrent_gated_delta_rule(...,
ssm_state_indices=rows)`` (int32 rows, as vLLM passes them, and int64), ``step`` the CPU
backend's ``pool_recurrent_fwd``.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import torch_gdr
from torch_gdr.ops.cpu import _build
from torch_gdr.ops.cpu import pool as cpu_pool


def cpu_us(call: Callable[[], None], calls: int, rounds: int) -> float:
    """Best per-call CPU microseconds over ``rounds`` rounds of ``calls`` calls."""
    for _ in range(min(calls, 200)):
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(calls):
            call()
        best = min(best, (time.process_time() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ext = _build.load()
    if ext is None:
        raise SystemExit(f"the fused CPU kernels are unavailable: {_build.unavailable_reason()}")
    heads, v_heads, dim, slots = 16, 32, 128, 512
    pool = torch.zeros(slots, v_heads, dim, dim)
    gen = torch.Generator().manual_seed(0)

    class Stub:  # the extension, its pool step returning at once
        def __init__(self, out: torch.Tensor) -> None:
            self.out = out

        def __getattr__(self, name: str):
            if name == "pool_recurrent_fwd":
                return lambda *a: self.out
            return getattr(ext, name)

    print(f"torch_gdr at {torch_gdr.__file__}; CPU us per call, kernel stubbed, 1 thread")
    for batch in args.batches:
        x = dict(q=torch.randn(batch, 1, heads, dim), k=torch.randn(batch, 1, heads, dim),
                 v=torch.randn(batch, 1, v_heads, dim), g=-torch.rand(batch, 1, v_heads),
                 beta=torch.rand(batch, 1, v_heads))
        stub = Stub(torch.empty(batch, 1, v_heads, dim))
        cpu_pool._build.load = lambda stub=stub: stub  # type: ignore[attr-defined]
        table = [torch.randperm(slots, generator=gen)[:batch] for _ in range(64)]
        tables = {"int64": table, "int32": [t.to(torch.int32) for t in table]}
        turn = [0]

        def rows(dtype: str) -> torch.Tensor:
            turn[0] = (turn[0] + 1) % 64
            return tables[dtype][turn[0]]

        def public(dtype: str) -> Callable[[], None]:
            return lambda: torch_gdr.fused_recurrent_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=pool, ssm_state_indices=rows(dtype),
                use_qk_l2norm_in_kernel=True, backend="cpu")

        def step() -> None:
            cpu_pool.pool_recurrent_fwd(*x.values(), None, pool, rows("int64"), use_qk_l2norm_in_kernel=True)

        with torch.no_grad():
            figures = {"public int32": cpu_us(public("int32"), args.calls, args.rounds),
                       "public int64": cpu_us(public("int64"), args.calls, args.rounds),
                       "step int64": cpu_us(step, args.calls, args.rounds)}
        print(f"B={batch}: " + ", ".join(f"{name} {us:.1f}" for name, us in figures.items()))
    cpu_pool._build.load = _build.load  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
