"""Half precision on the CPU kernels against float32, same run, alternated rounds (issue 38).

Parts (``--part``):

- ``pool``: the decode step over a 512-slot pool (H16/HV32, K = V = 128, one token per
  sequence at random rows, q/k l2-normalised in the call), a float32 pool with float32
  inputs against a bfloat16 (float16) pool with bfloat16 (float16) inputs, B = 8 and 64.
  Acceptance: the bf16 step at most 0.7x the fp32 step.
- ``gemm``: ``torch.mm`` 2048 x 2048, bfloat16 against float32 (which acceptance line of
  the issue applies to this machine).
- ``chunk``: the chunked forward (``backend="cpu"``) and forward + backward at T = 4096,
  H16/HV32 and H4/HV4, K = V = 128, bfloat16 / float16 inputs against float32. The backward
  runs from given gradients in o's dtype (``--loss grad``), or from the float32 loss
  ``(o.float() ** 2).sum() + s.sum()`` (``--loss square``), whose cast and float32 gradient
  a half o pays for and a float32 o does not.

Every round times each variant once, in an order reversed every round; the figures are the
medians of the per-round ratios.

    PYTHONPATH=$PWD OMP_NUM_THREADS=2 python bench/half_bench.py --part pool --rounds 9
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr.ops.cpu import _build
from torch_gdr.ops.cpu.pool import pool_recurrent_fwd

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_name() -> str:
    """The CPU's model name and the kernel variant this process runs."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ext = _build.load()
    return f"{model}, torch {torch.__version__}, {torch.get_num_threads()} threads, variant {getattr(ext, '__name__', None)}"


#: CPU seconds (all threads of the process) of the calls of the last :func:`alternate`, by
#: name: on a machine shared with other work, the wall time measures the share of the cores
#: a call got as much as the call; its CPU time does not.
CPU_TIMES: dict[str, list[float]] = {}


def alternate(calls: dict[str, Callable[[], None]], rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """Wall seconds of every call per round, the order reversed each round (CPU seconds in
    :data:`CPU_TIMES`)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    CPU_TIMES.clear()
    CPU_TIMES.update({name: [] for name in calls})
    order = list(calls)
    for r in range(warmup + rounds):
        for name in order:
            cpu = time.process_time()
            begin = time.perf_counter()
            calls[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - begin)
                CPU_TIMES[name].append(time.process_time() - cpu)
        order.reverse()
    return times


def cpu_ratio(a: str, b: str) -> float:
    """The median over rounds of the CPU time of a over b's (last :func:`alternate`)."""
    return ratio(CPU_TIMES, a, b)


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of time(a) / time(b)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def pool_part(rounds: int, batches: tuple[int, ...], heads: int = 16, v_heads: int = 32, dim: int = 128,
              slots: int = 512) -> None:
    gen = torch.Generator().manual_seed(0)
    pools = {"fp32": torch.randn(slots, v_heads, dim, dim, generator=gen) * 0.05}
    for name, dt in HALF.items():
        pools[name] = pools["fp32"].to(dt)
    for batch in batches:
        x = dict(q=torch.randn(batch, 1, heads, dim, generator=gen), k=torch.randn(batch, 1, heads, dim, generator=gen),
                 v=torch.randn(batch, 1, v_heads, dim, generator=gen),
                 g=F.logsigmoid(torch.randn(batch, 1, v_heads, generator=gen)),
                 beta=torch.sigmoid(torch.randn(batch, 1, v_heads, generator=gen)))
        calls = {}
        for name, pool in pools.items():
            inputs = {n: (t.to(pool.dtype) if n in "qkv" else t) for n, t in x.items()}

            def step(pool=pool, inputs=inputs) -> None:
                rows = torch.randperm(slots, generator=gen)[:batch]
                pool_recurrent_fwd(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], None, pool,
                                   rows, use_qk_l2norm_in_kernel=True)
            calls[name] = step
        with torch.no_grad():
            times = alternate(calls, rounds)
        med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
        print(f"pool step B={batch}: " + ", ".join(f"{n} {m:.0f} us" for n, m in med.items())
              + f"; bf16/fp32 {ratio(times, 'bf16', 'fp32'):.3f}, fp16/fp32 {ratio(times, 'fp16', 'fp32'):.3f}"
              f" (target <= 0.7); CPU time: bf16/fp32 {cpu_ratio('bf16', 'fp32'):.3f}, fp16/fp32 "
              f"{cpu_ratio('fp16', 'fp32'):.3f}")


def gemm_part(rounds: int, n: int = 2048) -> None:
    a32, b32 = torch.randn(n, n), torch.randn(n, n)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    times = alternate({"fp32": lambda: torch.mm(a32, b32), "bf16": lambda: torch.mm(a16, b16)}, rounds)
    print(f"torch.mm {n}^2: fp32 {statistics.median(times['fp32']) * 1e3:.1f} ms, bf16 "
          f"{statistics.median(times['bf16']) * 1e3:.1f} ms; bf16/fp32 {ratio(times, 'bf16', 'fp32'):.3f} "
          f"(CPU time {cpu_ratio('bf16', 'fp32'):.3f})")


def chunk_inputs(seq_len: int, heads: int, v_heads: int, dim: int = 128) -> dict[str, torch.Tensor]:
    """One sequence's float32 inputs, seeded: q, k unit rows ``[1, T, H, K]``, v ``[1, T, HV, V]``,
    g (mild decay) and beta ``[1, T, HV]``."""
    gen = torch.Generator().manual_seed(1)
    return dict(q=F.normalize(torch.randn(1, seq_len, heads, dim, generator=gen), dim=-1),
                k=F.normalize(torch.randn(1, seq_len, heads, dim, generator=gen), dim=-1),
                v=torch.randn(1, seq_len, v_heads, dim, generator=gen),
                g=F.logsigmoid(torch.randn(1, seq_len, v_heads, generator=gen)) * 0.1,
                beta=torch.sigmoid(torch.randn(1, seq_len, v_heads, generator=gen)))


def chunk_part(rounds: int, seq_len: int, shapes: tuple[tuple[int, int], ...], dim: int = 128,
               backward: bool = True, loss: str = "grad") -> None:
    for heads, v_heads in shapes:
        base = chunk_inputs(seq_len, heads, v_heads, dim)
        gen = torch.Generator().manual_seed(2)  # the gradients'
        inputs = {"fp32": base}
        for name, dt in HALF.items():
            inputs[name] = {n: (t.to(dt) if n in "qkv" else t) for n, t in base.items()}

        def fwd(x) -> None:
            with torch.no_grad():
                torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                                 backend="cpu")

        grads = {name: (torch.randn(base["v"].shape, generator=gen).to(x["v"].dtype),
                        torch.randn(1, v_heads, dim, dim, generator=gen)) for name, x in inputs.items()}

        def fwd_bwd(x, name) -> None:
            xs = {n: t.detach().requires_grad_() for n, t in x.items()}
            o, s = torch_gdr.chunk_gated_delta_rule(xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"],
                                                    output_final_state=True, backend="cpu")
            if loss == "square":  # a float32 loss: o's gradient reaches a half o through a cast
                (o.float().square().sum() + s.sum()).backward()
            else:  # given gradients in o's dtype: the op's forward and backward alone
                torch.autograd.backward([o, s], list(grads[name]))

        kinds = {"fwd": fwd, "fwd+bwd": fwd_bwd} if backward else {"fwd": fwd}
        for kind, fn in kinds.items():
            calls = {name: (lambda x=x, fn=fn, name=name: fn(x) if fn is fwd else fn(x, name))
                     for name, x in inputs.items()}
            times = alternate(calls, rounds, warmup=1)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            print(f"chunk {kind}{'' if kind == 'fwd' else ' (' + loss + ')'} T={seq_len} H{heads}/HV{v_heads}: " + ", ".join(f"{n} {m:.1f} ms" for n, m in med.items())
                  + f"; bf16/fp32 {ratio(times, 'bf16', 'fp32'):.3f}, fp16/fp32 {ratio(times, 'fp16', 'fp32'):.3f}"
                  f" (target <= 1.0 without half units); CPU time: bf16/fp32 {cpu_ratio('bf16', 'fp32'):.3f}, "
                  f"fp16/fp32 {cpu_ratio('fp16', 'fp32'):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("pool", "gemm", "chunk", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--loss", choices=("grad", "square"), default="grad",
                        help="fwd+bwd: given gradients in o's dtype (the op alone), or the float32 loss "
                             "(o.float() ** 2).sum() + s.sum() of the earlier measurements")
    parser.add_argument("--shapes", default="16/32,4/4", help="H/HV pairs, comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_name())
    if args.part in ("pool", "all"):
        pool_part(args.rounds, tuple(args.batches))
    if args.part in ("gemm", "all"):
        gemm_part(args.rounds)
    if args.part in ("chunk", "all"):
        shapes = tuple(tuple(int(n) for n in pair.split("/")) for pair in args.shapes.split(","))
        chunk_part(args.rounds, args.seq_len, shapes, backward=not args.no_backward, loss=args.loss)


if __name__ == "__main__":
    main()
