"""Check and time the pure-torch path on a CUDA GPU.

Correctness first: on small random problems (varlen, GVA, initial state, l2norm), the
``"torch"`` backend on the GPU against float64 references on the CPU (the per-token
recurrence for outputs, states and gradients), as ``‖out − ref‖ / ‖ref‖``. Then timing:
forward and forward + backward of torch_gdr, and of the HF Qwen3-Next fallback when
transformers is importable, at the shapes of the CPU bench and a Qwen3-Next-sized layer,
in float32 and bfloat16, with CUDA events (median after warm-up) and the peak of
``torch.cuda.max_memory_allocated`` above the inputs.

Then fla (when fla-core is importable, bench/fla_compare.py): torch_gdr's adapter against
fla's public call, fla's own calls timed beside torch_gdr's defaults on the same inputs
(forward, forward + backward at 1 x 32768 and 8 x 4096, H16/HV32, K = V = 128, bf16; decode
B = 1 and B = 64) with the ratios, and a fullgraph-compiled step through ``backend="fla"``.

    PYTHONPATH=. python bench/gpu_check.py [--sections correctness,hf,fla,compile] [--json results.json]
    PYTHONPATH=. python bench/gpu_check.py --smoke     # tiny shapes, any device: the script itself runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import torch_gdr
import fla_compare  # bench/ is on sys.path when run as a script
from _common import hf_fallback
from torch_gdr.ref import naive_recurrent_gated_delta_rule

# (B, T, H, HV, K = V)
SHAPES = {
    "1x4096 h4": (1, 4096, 4, 4, 128),
    "1x16384 h2": (1, 16384, 2, 2, 128),
    "4x1024 h4": (4, 1024, 4, 4, 128),
    "1x32768 h16/32": (1, 32768, 16, 32, 128),  # a Qwen3-Next-sized linear-attention layer
}


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double().cpu(), out.double().cpu()
    return ((ref - out).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(batch: int, seq_len: int, heads: int, v_heads: int, dim: int, dtype: torch.dtype,
                device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(batch, seq_len, heads, dim, generator=gen),
             k=torch.randn(batch, seq_len, heads, dim, generator=gen),
             v=torch.randn(batch, seq_len, v_heads, dim, generator=gen),
             g=F.logsigmoid(torch.randn(batch, seq_len, v_heads, generator=gen)),
             beta=torch.sigmoid(torch.randn(batch, seq_len, v_heads, generator=gen)))
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


def check_correctness(device: str) -> list[str]:
    """Outputs, final states and every gradient of the GPU path against float64 references."""
    lines = []
    gen = torch.Generator().manual_seed(1)
    lens = [200, 0, 1, 77, 130]
    cu = torch.tensor([0] + lens).cumsum(0)
    base = make_inputs(1, sum(lens), 2, 4, 64, torch.float64, "cpu", seed=1)
    base["initial_state"] = torch.randn(len(lens), 4, 64, 64, generator=gen, dtype=torch.float64) * 0.1
    do = torch.randn_like(base["v"])
    dht = torch.randn_like(base["initial_state"])

    def run(fn: Callable, inputs: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
        o, s = fn(**leaves, cu_seqlens=cu.to(leaves["q"].device), output_final_state=True,
                  use_qk_l2norm_in_kernel=True, **kw)
        loss = (o.double() * do.to(o.device)).sum() + (s.double() * dht.to(s.device)).sum()
        return o, s, list(torch.autograd.grad(loss, list(leaves.values())))

    ref_o, ref_s, ref_grads = run(naive_recurrent_gated_delta_rule, base)
    for dtype, bound in ((torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        inputs = {n: t.to(device=device, dtype=dtype if n != "initial_state" else state_dtype)
                  for n, t in base.items()}
        o, s, grads = run(torch_gdr.chunk_gated_delta_rule, inputs, backend="torch")
        errs = {"o": rel_err(ref_o, o), "state": rel_err(ref_s, s)}
        errs.update({f"d{n}": rel_err(r, g) for n, r, g in zip(base, ref_grads, grads)})
        worst = max(errs.values())
        lines.append(f"{str(dtype):<15} worst rel err {worst:.2e} (bound {bound:.0e}) "
                     f"{'OK' if worst < bound else 'FAIL'}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    return lines


def time_ms(fn: Callable[[], object], warmup: int = 2, repeats: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def time_impls(device: str) -> list[dict]:
    impls: dict[str, Callable] = {
        "torch_gdr": lambda x: torch_gdr.chunk_gated_delta_rule(
            **x, output_final_state=True, use_qk_l2norm_in_kernel=True, backend="torch"),
    }
    hf = hf_fallback()
    if hf is not None:
        impls["hf_fallback"] = lambda x: hf(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64,
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    rows = []
    for shape_name, (b, t, h, hv, d) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for name, impl in impls.items():
                if name == "hf_fallback" and hv != h:
                    continue  # the fallback has no GVA of its own
                x = make_inputs(b, t, h, hv, d, dtype, device)
                leaves = {n: v.detach().requires_grad_() for n, v in x.items()}

                def fwd() -> None:
                    with torch.no_grad():
                        impl(x)

                def fwd_bwd() -> None:
                    o, s = impl(leaves)
                    (o.float().sum() + s.float().sum()).backward()
                    for v in leaves.values():
                        v.grad = None

                try:
                    row = dict(shape=shape_name, dtype=str(dtype).replace("torch.", ""), impl=name,
                               fwd_ms=time_ms(fwd), fwd_bwd_ms=time_ms(fwd_bwd, repeats=5),
                               peak_fwd_bwd_mib=peak_mib(fwd_bwd))
                except torch.cuda.OutOfMemoryError:
                    row = dict(shape=shape_name, dtype=str(dtype), impl=name, note="out of memory")
                    torch.cuda.empty_cache()
                row["tokens_per_s_fwd"] = b * t / row["fwd_ms"] * 1e3 if "fwd_ms" in row else None
                rows.append(row)
                print(row, flush=True)
                del x, leaves
                torch.cuda.empty_cache()
    return rows


def wall_ms(fn: Callable[[], object], warmup: int = 1, repeats: int = 3) -> float:
    """Median wall-clock milliseconds (smoke runs on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


SECTIONS = ("correctness", "hf", "fla", "compile")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and wall-clock timing on any device: checks that the script runs")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(sections - set(SECTIONS))}, expected a subset of {SECTIONS}")
    if args.smoke:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        timer: Callable = wall_ms
        chunk_shapes, decode_batches = {"1x256 h2/4": (1, 256, 2, 4, 32)}, (1, 2)
        small = dict(seq_lens=(30, 1, 17), heads=(2, 4), dim=16, decode_batch=2)
        decode_heads = (2, 4, 16)
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--smoke runs the script on the CPU)")
        return 0
    else:
        device, timer = "cuda", time_ms
        chunk_shapes, decode_batches = fla_compare.CHUNK_SHAPES, fla_compare.DECODE_BATCHES
        small, decode_heads = {}, (16, 32, 128)
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}")
    correctness: list[str] = []
    rows: list[dict] = []
    if "correctness" in sections:
        correctness += check_correctness(device)
    if "fla" in sections:
        correctness += fla_compare.check_adapter(device, **small)
        correctness += fla_compare.check_adapter(device, **small, gated=True)
    print("\n".join(correctness), flush=True)
    if "compile" in sections and fla_compare.fla_public()[0] is not None:
        correctness += fla_compare.check_compile(device)
        print(correctness[-1], flush=True)
    if "hf" in sections and not args.smoke:
        rows = time_impls(device)
        print(f"\n{'shape':<16}{'dtype':<10}{'impl':<13}{'fwd ms':>9}{'fwd+bwd ms':>12}{'peak MiB':>10}"
              f"{'Mtok/s fwd':>12}")
        for r in rows:
            if "fwd_ms" not in r:
                print(f"{r['shape']:<16}{r['dtype']:<10}{r['impl']:<13}  {r.get('note')}")
                continue
            print(f"{r['shape']:<16}{r['dtype']:<10}{r['impl']:<13}{r['fwd_ms']:>9.2f}{r['fwd_bwd_ms']:>12.2f}"
                  f"{r['peak_fwd_bwd_mib']:>10.0f}{r['tokens_per_s_fwd'] / 1e6:>12.2f}")
    fla_lines: list[str] = []
    if "fla" in sections:
        fla_lines = fla_compare.time_against_fla(device, timer, chunk_shapes, decode_batches, decode_heads)
        print("\n" + "\n".join(fla_lines), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(correctness=correctness, timings=rows, fla=fla_lines), f, indent=1)
    return 1 if any("FAIL" in line for line in correctness) else 0


if __name__ == "__main__":
    raise SystemExit(main())
