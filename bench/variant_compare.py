"""Two instruction-set variants of the fused CPU kernels on this CPU, same process, same run,
alternated rounds: which one should this CPU run, and what does the wider one buy?

Both variants must be built in place, e.g. on an AVX-512 machine::

    TORCH_GDR_CPU_VARIANTS=avx512,avx2 python setup.py build_ext --inplace
    PYTHONPATH=$PWD OMP_NUM_THREADS=2 python bench/variant_compare.py --variants avx512 avx2

Each round swaps the loaded module (``torch_gdr.ops.cpu._build``'s choice) between the two and
times every case once per variant, the order reversed every round; the figure is the median
of the per-round ratios (first variant over second). Cases: the chunked forward (T = 4096,
H16/HV32 and H4/HV4, fp32 and bf16 q, k, v), forward + backward at H16/HV32, and the pool
decode step (512 slots, H16/HV32, fp32 and bf16 pools, B = 1 and 8, ``8 // B`` steps a call).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr.ops.cpu import _build, _variants
from torch_gdr.ops.cpu.pool import pool_recurrent_fwd

try:
    from bench.half_bench import alternate, chunk_inputs, cpu_name
except ImportError:  # run as a script from bench/
    from half_bench import alternate, chunk_inputs, cpu_name  # type: ignore[no-redef]

DIM, SLOTS = 128, 512


def cases(seq_len: int) -> dict[str, Callable[[], None]]:
    """The timed calls, by name."""
    out: dict[str, Callable[[], None]] = {}
    for heads, v_heads in ((16, 32), (4, 4)):
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x = {n: (t.to(dtype) if n in ("q", "k", "v") else t)
                 for n, t in chunk_inputs(seq_len, heads, v_heads, DIM).items()}

            def forward(x=x) -> None:
                with torch.no_grad():
                    torch_gdr.chunk_gated_delta_rule(**x, backend="cpu")
            out[f"forward H{heads}/HV{v_heads} {name}"] = forward
            if heads == 16:
                leaves = {n: t.clone().requires_grad_() for n, t in x.items()}

                def forward_backward(leaves=leaves) -> None:
                    o, s = torch_gdr.chunk_gated_delta_rule(**leaves, backend="cpu", output_final_state=True)
                    torch.autograd.backward([o, s], [torch.ones_like(o), torch.ones_like(s)])
                out[f"fwd+bwd H{heads}/HV{v_heads} {name}"] = forward_backward
    gen = torch.Generator().manual_seed(0)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        pool = (torch.randn(SLOTS, 32, DIM, DIM, generator=gen) * 0.05).to(dtype)
        for batch in (1, 8):
            x = dict(q=torch.randn(batch, 1, 16, DIM, generator=gen), k=torch.randn(batch, 1, 16, DIM, generator=gen),
                     v=torch.randn(batch, 1, 32, DIM, generator=gen),
                     g=F.logsigmoid(torch.randn(batch, 1, 32, generator=gen)),
                     beta=torch.sigmoid(torch.randn(batch, 1, 32, generator=gen)))
            x = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in x.items()}

            def step(x=x, pool=pool, batch=batch) -> None:
                for _ in range(max(1, 8 // batch)):
                    rows = torch.randperm(SLOTS, generator=gen)[:batch]
                    with torch.no_grad():
                        pool_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, pool, rows,
                                           use_qk_l2norm_in_kernel=True)
            out[f"pool step B={batch} {name}"] = step
    return out


def load_variant(name: str) -> ModuleType:
    """The in-place build of variant ``name``; SystemExit naming the build command when absent."""
    if name not in _variants.names():
        raise SystemExit(f"--variants: expected names from {_variants.names()}, got {name!r}")
    try:
        return importlib.import_module(f"torch_gdr.ops.cpu.{_variants.module_name(name)}")
    except ImportError as exc:
        raise SystemExit(f"--variants: the {name!r} variant is not built here ({exc}); build it with "
                         f"TORCH_GDR_CPU_VARIANTS=<both> python setup.py build_ext --inplace") from exc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs=2, default=["avx512", "avx2"], metavar=("A", "B"))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    a, b = args.variants
    modules = {name: load_variant(name) for name in (a, b)}
    _build.load()  # settle the loader's own choice first, then swap its module
    print(cpu_name().rsplit(", variant", 1)[0] + f"; {a} / {b}, {args.rounds} rounds")
    for name, call in cases(args.seq_len).items():
        def run_as(variant: str, call: Callable[[], None] = call) -> None:
            _build._state.module = modules[variant]
            call()
        times = alternate({v: (lambda v=v: run_as(v)) for v in (a, b)}, args.rounds)
        ratios = [x / y for x, y in zip(times[a], times[b])]
        print(f"{name}: {a}/{b} {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
              f"{b} {statistics.median(times[b]) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
