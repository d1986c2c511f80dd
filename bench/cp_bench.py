"""Context-parallel bench: one 65,536-token sequence split over 1, 2 and 4 gloo ranks on the CPU.

    PYTHONPATH=. python bench/cp_bench.py                       # T 65,536, H 4, K = V 128, fp32
    PYTHONPATH=. python bench/cp_bench.py --tokens 8192 --ranks 1 2

Per world size, every rank (one process, one torch thread) warms up, then runs its slice of
the sequence ``--rounds`` times: the context-parallel forward, its backward, the plain op on
the same slice (no context, grad enabled too: the cost of the extra columns is the difference), and
``--collectives`` bare all-gathers of the state piece after a barrier. It prints, per rank,
the best round of each: forward compute (the call less its collective), the plain forward,
the backward (with its reduce-scatter), the bytes sent by the forward and the backward, and
the median time of the bare collective. On a machine with fewer cores than ranks the ranks
share cores (say so with the numbers): per-rank times then include the waits of
oversubscription, and the collective's time the skew between ranks.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_gdr
from torch_gdr.distributed import build_cp_context, context_parallel_chunk_gated_delta_rule
from torch_gdr.distributed.collectives import all_gather_pieces
from torch_gdr.distributed.launch import run_local


def slice_inputs(args: argparse.Namespace, lo: int, hi: int) -> list:
    """Tokens ``[lo, hi)`` of the sequence (the same global data on every rank)."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.tokens, args.heads)
    q = F.normalize(torch.randn(*shape, args.dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(*shape, args.dim, generator=gen), dim=-1)
    v = torch.randn(*shape, args.dim, generator=gen)
    g = F.logsigmoid(torch.randn(*shape, generator=gen))
    beta = torch.sigmoid(torch.randn(*shape, generator=gen))
    return [x[:, lo:hi].clone() for x in (q, k, v, g, beta)]


def rank_main(rank: int, world_size: int, args: argparse.Namespace, out_dir: str) -> None:
    ctx = build_cp_context(torch.tensor([0, args.tokens]))
    lo, hi = ctx.slice_bounds[rank], ctx.slice_bounds[rank + 1]
    inputs = slice_inputs(args, lo, hi)
    warm = [x[:, :128].clone().requires_grad_() for x in inputs]
    torch_gdr.chunk_gated_delta_rule(*warm)[0].sum().backward()

    rows = {"forward": [], "plain": [], "backward": [], "fwd_collective": []}
    for _ in range(args.rounds):
        leaves = [x.clone().requires_grad_() for x in inputs]
        ctx.stats.reset()
        dist.barrier()
        began = time.perf_counter()
        o, final = context_parallel_chunk_gated_delta_rule(*leaves, output_final_state=True, cp_context=ctx)
        forward = time.perf_counter() - began
        rows["fwd_collective"].append(ctx.stats.seconds)
        rows["forward"].append(forward - ctx.stats.seconds)
        dist.barrier()
        began = time.perf_counter()
        (o.sum() + final.sum()).backward()
        rows["backward"].append(time.perf_counter() - began)
        bytes_sent, backward_bytes = ctx.stats.bytes_sent, ctx.stats.backward_bytes_sent
        del o, final, leaves
        leaves = [x.clone().requires_grad_() for x in inputs]
        began = time.perf_counter()
        torch_gdr.chunk_gated_delta_rule(*leaves, output_final_state=True)  # grad mode alike
        rows["plain"].append(time.perf_counter() - began)
        del leaves

    collective = []
    if world_size > 1:
        piece = torch.zeros(args.heads, args.dim, 2 * args.dim)
        for _ in range(args.collectives):
            dist.barrier()
            began = time.perf_counter()
            all_gather_pieces(piece, ctx)
            collective.append(time.perf_counter() - began)
    result = {"rank": rank, "tokens": hi - lo, **{k: min(v) for k, v in rows.items()},
              "bytes_sent": bytes_sent, "backward_bytes_sent": backward_bytes,
              "collective": statistics.median(collective) if collective else 0.0}
    torch.save(result, pathlib.Path(out_dir) / f"rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128, help="K = V")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--collectives", type=int, default=5)
    args = parser.parse_args()
    print(f"T {args.tokens}, H = HV {args.heads}, K = V {args.dim}, fp32, chunk 64, one sequence; "
          f"{os.cpu_count()} cores, torch {torch.__version__}, one torch thread per rank")
    print("ranks | rank | tokens | fwd compute s | plain fwd s | bwd s | fwd collective (with skew) ms | "
          "bytes sent fwd / bwd | bare all-gather ms")
    for world_size in args.ranks:
        with tempfile.TemporaryDirectory(prefix="torch_gdr-cp-bench-") as out_dir:
            run_local(rank_main, world_size, args, out_dir, timeout=1800.0)
            for rank in range(world_size):
                r = torch.load(pathlib.Path(out_dir) / f"rank{rank}.pt")
                print(f"{world_size} | {rank} | {r['tokens']} | {r['forward']:.2f} | {r['plain']:.2f} | "
                      f"{r['backward']:.2f} | {r['fwd_collective'] * 1e3:.1f} | {r['bytes_sent']} / "
                      f"{r['backward_bytes_sent']} | {r['collective'] * 1e3:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
