"""Context parallelism on 4 CPU ranks: a 65,536-token packed batch split over a gloo group.

    PYTHONPATH=. python examples/context_parallel.py              # 4 ranks, 65,536 tokens
    PYTHONPATH=. python examples/context_parallel.py --tokens 8192 --ranks 2

Each rank (a process started with torch.multiprocessing, one torch thread) holds a quarter of
the tokens; sequences of the batch start, end and pass through ranks (the longest spans
several). Every rank builds the context from the global ``cu_seqlens``, runs the op on its
slice and backpropagates a random loss; rank 0 then runs the same batch in one process and
compares outputs, final states and the gradients of q, k, v, g and beta (float32: rmse of the
difference over rms of the single-process value). It prints the bytes each rank sent and the
time of the collectives. About 30 s with the defaults on 2 cores shared with other work (load ~13).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import torch_gdr
from torch_gdr.distributed import build_cp_context, context_parallel_chunk_gated_delta_rule
from torch_gdr.distributed.launch import run_local

FIELDS = ("q", "k", "v", "g", "beta")


def packed_batch(args: argparse.Namespace) -> tuple[dict, torch.Tensor]:
    """The global batch (the same on every rank): a few long sequences and many short ones,
    packed into ``[1, T]``, and the cotangents of the loss."""
    gen = torch.Generator().manual_seed(args.seed)
    total = args.tokens
    lengths = [total * 5 // 8]  # spans three ranks of four; the short ones cross the last boundary
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(16, total // 16, (1,), generator=gen)), total - sum(lengths)))
    lengths.insert(3, 0)  # an empty sequence
    cu_seqlens = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    heads, dim = args.heads, args.head_dim
    data = dict(q=randn(1, total, heads, dim), k=randn(1, total, heads, dim), v=randn(1, total, heads, dim),
                g=F.logsigmoid(randn(1, total, heads)), beta=torch.sigmoid(randn(1, total, heads)),
                do=randn(1, total, heads, dim), dht=randn(len(lengths), heads, dim, dim))
    return data, cu_seqlens


def loss_and_grads(o: torch.Tensor, final: torch.Tensor, data: dict, lo: int, hi: int, ids: torch.Tensor,
                   weight: torch.Tensor, leaves: dict) -> dict:
    ((o * data["do"][:, lo:hi]).sum() + (final * data["dht"][ids] * weight[:, None, None, None]).sum()).backward()
    return {name: leaves[name].grad for name in FIELDS}


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    data, cu_seqlens = packed_batch(args)
    ctx = build_cp_context(cu_seqlens)  # equal slices, the default group
    lo, hi = ctx.slice_bounds[rank], ctx.slice_bounds[rank + 1]
    leaves = {name: data[name][:, lo:hi].clone().requires_grad_() for name in FIELDS}
    warm_up = [data[name][:, :64].clone().requires_grad_() for name in FIELDS]  # torch's one-time imports
    torch_gdr.chunk_gated_delta_rule(*warm_up)[0].sum().backward()
    began = time.perf_counter()
    o, final = context_parallel_chunk_gated_delta_rule(*(leaves[name] for name in FIELDS), output_final_state=True,
                                                       use_qk_l2norm_in_kernel=True, cp_context=ctx)
    ends = ctx.ends_here
    grads = loss_and_grads(o, final, data, lo, hi, ctx.sequence_ids, ends.float(), leaves)
    seconds = time.perf_counter() - began

    shares = [None] * world_size
    dist.all_gather_object(shares, dict(o=o.detach(), final=final.detach()[ends], ids=ctx.sequence_ids[ends],
                                        grads=grads, seconds=seconds, stats=ctx.stats, lengths=ctx.cu_seqlens.diff()))
    if rank != 0:
        return
    for r, share in enumerate(shares):
        print(f"rank {r}: tokens [{ctx.slice_bounds[r]}, {ctx.slice_bounds[r + 1]}), local sequence lengths "
              f"{share['lengths'].tolist()[:6]}{' ...' if len(share['lengths']) > 6 else ''}; forward + backward "
              f"{share['seconds']:.2f} s; sent {share['stats'].bytes_sent} B forward, "
              f"{share['stats'].backward_bytes_sent} B backward; collective {share['stats'].seconds * 1e3:.1f} ms")

    leaves = {name: data[name].clone().requires_grad_() for name in FIELDS}
    began = time.perf_counter()
    o_ref, final_ref = torch_gdr.chunk_gated_delta_rule(*(leaves[name] for name in FIELDS), output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    ids = torch.arange(final_ref.shape[0])
    grads_ref = loss_and_grads(o_ref, final_ref, data, 0, args.tokens, ids, torch.ones(len(ids)), leaves)
    print(f"one process: forward + backward {time.perf_counter() - began:.2f} s")

    def ratio(actual: torch.Tensor, expected: torch.Tensor) -> float:
        return ((actual - expected).double().pow(2).mean().sqrt() / expected.double().pow(2).mean().sqrt()).item()

    final_ids = torch.cat([s["ids"] for s in shares])
    errors = {"o": ratio(torch.cat([s["o"] for s in shares], dim=1), o_ref.detach()),
              "final state": ratio(torch.cat([s["final"] for s in shares])[final_ids.argsort()], final_ref.detach())}
    for name in FIELDS:
        errors[f"d{name}"] = ratio(torch.cat([s["grads"][name] for s in shares], dim=1), grads_ref[name])
    print("rmse ratio against one process: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    worst = max(errors.values())
    print(f"{'OK' if worst < 1e-5 else 'MISMATCH'}: worst rmse ratio {worst:.1e} (float32)")
    if worst >= 1e-5:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    began = time.perf_counter()
    run_local(rank_main, args.ranks, args, timeout=args.timeout, preload=("torch", "torch._dynamo", "torch_gdr"))
    print(f"total {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
