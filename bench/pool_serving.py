"""The decode step's serving variants over a state pool against the plain float32 pool step
(issue 36): a token tree (``retrieve_parent_token``), an intermediate-states buffer with
``disable_state_update``, a pool with strided rows, a bfloat16 pool and an fp8 pool.

Qwen3-Next's linear-attention state: H = 16 q/k heads, HV = 32 value heads, K = V = 128, a
512-slot pool (float32: 1 GiB), S = 4 tokens per sequence, B = 8 and 64 sequences at random
rows, q/k l2-normalised in the call, the default backend (``"cpu"``). Each round times
every variant once, in an order rotated per round, each on a pool of its own; the figure is
the median over rounds of each variant's time divided by the plain step's of the same round.

    OMP_NUM_THREADS=2 python bench/pool_serving.py [--rounds 7] [--batches 8 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import torch_gdr

HEADS, V_HEADS, DIM, SLOTS, WIDTH = 16, 32, 128, 512, 4


def inputs(batch: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, WIDTH)
    return dict(q=torch.randn(*shape, HEADS, DIM, generator=gen), k=torch.randn(*shape, HEADS, DIM, generator=gen),
                v=torch.randn(*shape, V_HEADS, DIM, generator=gen),
                g=F.logsigmoid(torch.randn(*shape, V_HEADS, generator=gen)),
                beta=torch.sigmoid(torch.randn(*shape, V_HEADS, generator=gen)))


def variants(batch: int) -> dict[str, Callable[[], None]]:
    x = inputs(batch, seed=batch)
    rows = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(batch))[:batch * WIDTH].view(batch, WIDTH)
    tree = torch.tensor([-1, 0, 0, 1]).expand(batch, WIDTH).contiguous()  # a branching tree of depth 3
    base = torch.randn(SLOTS, V_HEADS, DIM, DIM) * 0.05
    pools = {"plain fp32": base, "tree": base.clone(), "buffer, no update": base.clone(),
             "bf16 pool": base.to(torch.bfloat16), "fp8 e4m3 pool": base.to(torch.float8_e4m3fn)}
    carved = torch.zeros(SLOTS, DIM, V_HEADS, DIM + 8)  # rows not packed: K and HV swapped, V padded
    strided = carved[..., :DIM].permute(0, 2, 1, 3)
    strided.copy_(base)
    pools["strided pool"] = strided
    buffer = torch.zeros(batch, WIDTH, V_HEADS, DIM, DIM)
    buffer_rows = torch.arange(batch)

    def call(pool: torch.Tensor, **extra) -> Callable[[], None]:
        def run() -> None:
            torch_gdr.fused_recurrent_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=pool, ssm_state_indices=rows,
                use_qk_l2norm_in_kernel=True, **extra)
        return run

    return {"plain fp32": call(pools["plain fp32"]), "tree": call(pools["tree"], retrieve_parent_token=tree),
            "buffer, no update": call(pools["buffer, no update"], intermediate_states_buffer=buffer,
                                      intermediate_state_indices=buffer_rows, disable_state_update=True),
            "strided pool": call(pools["strided pool"]), "bf16 pool": call(pools["bf16 pool"]),
            "fp8 e4m3 pool": call(pools["fp8 e4m3 pool"])}


def measure(batch: int, rounds: int) -> dict[str, tuple[float, float]]:
    """variant -> (median seconds, median ratio to the plain step of the same round)."""
    runs = variants(batch)
    names = list(runs)
    with torch.no_grad():
        for run in runs.values():  # warm-up
            run()
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
    plain = times["plain fp32"]
    return {name: (statistics.median(t), statistics.median(a / b for a, b in zip(t, plain)))
            for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rounds {args.rounds}")
    print("| variant | B | median ms | median ratio to plain fp32 |")
    print("| --- | --- | --- | --- |")
    for batch in args.batches:
        for name, (seconds, ratio) in measure(batch, args.rounds).items():
            print(f"| {name} | {batch} | {seconds * 1e3:.1f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
