"""Context-parallel bench: one 65,536-token sequence split over 1, 2 and 4 gloo ranks on the CPU.

    PYTHONPATH=. python bench/cp_bench.py                       # T 65,536, H 4, K = V 128, fp32
    PYTHONPATH=. python bench/cp_bench.py --tokens 8192 --ranks 1 2

Per world size, every rank (one process, one torch thread) warms up, then, ``--rounds``
times (the best round is printed): (1) alone, while the other ranks wait at a barrier, its
share of the work - forward and backward of the context-parallel call's local part (the op
with the extra transition columns), and of the plain op on the same slice for comparison,
in alternating rounds (their median ratio is printed too);
(2) together, all ranks at once, the context-parallel forward (its collective included) and
backward (its reduce-scatter included); then ``--collectives`` bare all-gathers of the
``[HV, K, K + V]`` state piece after a barrier (median). It prints the bytes each rank sent
in the forward and the backward. On a machine with fewer cores than ranks, "together" shares
cores (oversubscription) and the forward's collective time includes the wait for the
slowest rank; "alone" is each rank's compute on a core of its own.
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
from torch_gdr.distributed.chunk import local_pass
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


def _alone(rank: int, world_size: int, run) -> None:
    """``run()`` on this rank while the other ranks wait at a barrier (its compute on a core of
    its own), one rank after the other."""
    for turn in range(world_size):
        dist.barrier()
        if turn == rank:
            run()
    dist.barrier()


def rank_main(rank: int, world_size: int, args: argparse.Namespace, out_dir: str) -> None:
    ctx = build_cp_context(torch.tensor([0, args.tokens]))
    lo, hi = ctx.slice_bounds[rank], ctx.slice_bounds[rank + 1]
    inputs = slice_inputs(args, lo, hi)
    warm = [x[:, :128].clone().requires_grad_() for x in inputs]
    torch_gdr.chunk_gated_delta_rule(*warm)[0].sum().backward()

    def local_fwd_bwd(plain: bool) -> None:
        leaves = [x.clone().requires_grad_() for x in inputs]
        if plain:
            o, final = torch_gdr.chunk_gated_delta_rule(*leaves, output_final_state=True)
            loss = o.sum() + final.sum()
        else:  # what the context-parallel call computes on this rank, without its collective
            parts = local_pass(*leaves, None, None, ctx, use_qk_l2norm_in_kernel=False, chunk_size=64, backend=None)
            loss = sum(x.sum() for x in parts if x is not None)
        loss.backward()

    rows: dict[str, list] = {"alone": [], "alone_plain": [], "forward": [], "backward": [], "fwd_collective": []}

    def alternate() -> None:  # the two in alternating rounds, so that a busy moment hits both
        pair = ((False, "alone"), (True, "alone_plain"))
        for round_index in range(args.rounds):
            for plain, key in pair if round_index % 2 == 0 else pair[::-1]:
                began = time.perf_counter()
                local_fwd_bwd(plain)
                rows[key].append(time.perf_counter() - began)

    _alone(rank, world_size, alternate)
    ratio = statistics.median(a / b for a, b in zip(rows["alone"], rows["alone_plain"]))
    for _ in range(args.rounds):
        leaves = [x.clone().requires_grad_() for x in inputs]
        ctx.stats.reset()
        dist.barrier()
        began = time.perf_counter()
        o, final = context_parallel_chunk_gated_delta_rule(*leaves, output_final_state=True, cp_context=ctx)
        rows["forward"].append(time.perf_counter() - began)
        rows["fwd_collective"].append(ctx.stats.seconds)
        dist.barrier()
        began = time.perf_counter()
        (o.sum() + final.sum()).backward()
        rows["backward"].append(time.perf_counter() - began)
        bytes_sent, backward_bytes = ctx.stats.bytes_sent, ctx.stats.backward_bytes_sent
        del o, final, leaves

    collective = []
    if world_size > 1:
        piece = torch.zeros(args.heads, args.dim, 2 * args.dim)
        for _ in range(args.collectives):
            dist.barrier()
            began = time.perf_counter()
            all_gather_pieces(piece, ctx)
            collective.append(time.perf_counter() - began)
    result = {"rank": rank, "tokens": hi - lo, **{k: min(v) for k, v in rows.items()},
              "ratio": ratio, "bytes_sent": bytes_sent, "backward_bytes_sent": backward_bytes,
              "collective": statistics.median(collective) if collective else 0.0}
    torch.save(result, pathlib.Path(out_dir) / f"rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128, help="K = V")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--collectives", type=int, default=5)
    args = parser.parse_args()
    print(f"T {args.tokens}, H = HV {args.heads}, K = V {args.dim}, fp32, chunk 64, one sequence; "
          f"{os.cpu_count()} cores, torch {torch.__version__}, one torch thread per rank")
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print("ranks | rank | tokens | alone: fwd+bwd s (plain op s, median ratio) | together: fwd s, bwd s | fwd collective "
          "(incl. skew) ms | bytes sent fwd / bwd | bare all-gather ms")
    for world_size in args.ranks:
        with tempfile.TemporaryDirectory(prefix="torch_gdr-cp-bench-") as out_dir:
            run_local(rank_main, world_size, args, out_dir, timeout=1800.0,
                      preload=("torch", "torch._dynamo", "torch_gdr"))
            for rank in range(world_size):
                r = torch.load(pathlib.Path(out_dir) / f"rank{rank}.pt")
                print(f"{world_size} | {rank} | {r['tokens']} | {r['alone']:.2f} ({r['alone_plain']:.2f}, {r['ratio']:.2f}x) | "
                      f"{r['forward']:.2f}, {r['backward']:.2f} | {r['fwd_collective'] * 1e3:.1f} | "
                      f"{r['bytes_sent']} / {r['backward_bytes_sent']} | {r['collective'] * 1e3:.2f}", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
