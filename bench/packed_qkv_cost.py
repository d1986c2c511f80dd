"""What packed QKV costs the ``cpu`` backend's pool decode step (issue 36 item 6).

    python bench/packed_qkv_cost.py [--threads N] [--rounds R]

q, k, v as strided views of one ``mixed_qkv [B, 2 * H * K + HV * V]`` bfloat16 tensor (as vLLM
and SGLang pass them) against the same values contiguous, through
``torch_gdr.fused_recurrent_gated_delta_rule`` over a 512-slot float32 pool (H16/HV32,
K = V = 128, one token per sequence, B = 8 and 64). The ``cpu`` kernels read contiguous rows,
so the views are copied first; the difference of the medians (rounds alternated) is that
copy, timed alone as well. Prints one line per batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_gdr

H, HV, K, V, SLOTS = 16, 32, 128, 128, 512


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(SLOTS, HV, K, V, generator=gen) * 0.01
    for batch in (8, 64):
        mixed = torch.randn(batch, 2 * H * K + HV * V, generator=gen).to(torch.bfloat16)
        q = mixed[:, :H * K].view(batch, 1, H, K)
        k = mixed[:, H * K:2 * H * K].view(batch, 1, H, K)
        v = mixed[:, 2 * H * K:].view(batch, 1, HV, V)
        dense = [t.contiguous() for t in (q, k, v)]
        g = -torch.rand(batch, 1, HV, generator=gen)
        beta = torch.rand(batch, 1, HV, generator=gen)
        rows = torch.randperm(SLOTS, generator=gen)[:batch]

        def step(q_, k_, v_):
            torch_gdr.fused_recurrent_gated_delta_rule(q_, k_, v_, g, beta, initial_state=pool, ssm_state_indices=rows,
                                                       use_qk_l2norm_in_kernel=True, backend="cpu")

        with torch.no_grad():
            step(q, k, v), step(*dense)
            packed, contiguous = [], []
            for _ in range(args.rounds):
                packed.append(_time(lambda: step(q, k, v), args.repeats))
                contiguous.append(_time(lambda: step(*dense), args.repeats))
            copies = [_time(lambda: [t.contiguous() for t in (q, k, v)], 10 * args.repeats)
                      for _ in range(args.rounds)]
        p, c, copy = statistics.median(packed), statistics.median(contiguous), statistics.median(copies)
        print(f"B={batch:>3} threads={args.threads}: packed views {p * 1e6:8.1f} us, contiguous {c * 1e6:8.1f} us, "
              f"ratio {p / c:.3f} (median of {args.rounds} alternated rounds of {args.repeats}); the three copies "
              f"alone {copy * 1e6:.1f} us ({copy / c:.2%} of the step)")


if __name__ == "__main__":
    main()
