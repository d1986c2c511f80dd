"""One decode step on the CPU, side by side: torch_gdr's fused-recurrent step, the HF
Qwen3-Next fallback's ``torch_recurrent_gated_delta_rule``, and a copy of the state (the
floor: any step reads the state and writes a new one).

Qwen3-Next's linear-attention shape: H = 16 q/k heads, HV = 32 value heads, K = V = 128,
one token per sequence, float32 state, q/k l2-normalised in the call. Each round times
one call of each, in alternating order, so that all see the same machine; the ratio is the
median of the per-round ratios. Target: the step is at least 2x faster than
HF's at B = 1 and B = 8.

The ratio depends on glibc's allocator state: HF's step makes several state-sized
temporaries, each a fresh mmap (page faults) while glibc's mmap threshold is at its initial
128 KiB, but reused heap memory once the threshold has grown (it grows when a large block
is freed, so it depends on what ran before in the process). Running with
``MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=134217728`` pins the second state
(freed memory kept and reused), the one most favourable to HF.

    pytest bench/test_bench_decode.py -p benchmark --benchmark-only
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

from torch_gdr.ops.torch.fused_recurrent import fused_recurrent_gated_delta_rule

HEADS, V_HEADS, DIM = 16, 32, 128
ROUNDS = 41
TARGET_SPEEDUP = 2.0


def hf_recurrent() -> Optional[Callable]:
    """transformers' Qwen3-Next per-token function (undecorated), or None."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    fn = m.torch_recurrent_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


def decode_inputs(batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(batch, 1, HEADS, DIM, generator=gen),
                k=torch.randn(batch, 1, HEADS, DIM, generator=gen),
                v=torch.randn(batch, 1, V_HEADS, DIM, generator=gen),
                g=F.logsigmoid(torch.randn(batch, 1, V_HEADS, generator=gen)),
                beta=torch.sigmoid(torch.randn(batch, 1, V_HEADS, generator=gen)),
                initial_state=torch.randn(batch, V_HEADS, DIM, DIM, generator=gen) * 0.05)


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step_vs_hf(benchmark, batch: int) -> None:
    hf = hf_recurrent()
    if hf is None:
        pytest.skip("transformers (the bench extra) is not installed")
    x = decode_inputs(batch)
    calls: dict[str, Callable[[], object]] = {
        "torch_gdr": lambda: fused_recurrent_gated_delta_rule(**x, output_final_state=True,
                                                               use_qk_l2norm_in_kernel=True),
        "hf_recurrent": lambda: hf(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True),
        "state_copy": lambda: x["initial_state"].clone(),
    }
    with torch.no_grad():  # the two compute the same step
        o, s = calls["torch_gdr"]()
        o_hf, s_hf = calls["hf_recurrent"]()
        torch.testing.assert_close(o, o_hf, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s, s_hf, atol=1e-4, rtol=1e-4)

    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)

    def one_round() -> None:
        with torch.no_grad():
            for name in order:
                start = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - start)
        order.reverse()

    for _ in range(3):
        one_round()  # warm-up
    for t in times.values():
        t.clear()
    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=0)
    ratios = [h / o for o, h in zip(times["torch_gdr"], times["hf_recurrent"])]
    floor = [o / c for o, c in zip(times["torch_gdr"], times["state_copy"])]
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    speedup = statistics.median(ratios)
    benchmark.extra_info.update(threads=torch.get_num_threads(), batch=batch,
                                **{f"{name}_us": m for name, m in medians.items()},
                                speedup_vs_hf=speedup, ratios_q1_q3=statistics.quantiles(ratios, n=4)[::2],
                                times_state_copy=statistics.median(floor))
    print(f"\ndecode B={batch}: torch_gdr {medians['torch_gdr']:.0f} us, HF {medians['hf_recurrent']:.0f} us, "
          f"state copy {medians['state_copy']:.0f} us; speedup vs HF {speedup:.2f}x "
          f"(target >= {TARGET_SPEEDUP:g}x), {statistics.median(floor):.2f}x a state copy")
    assert speedup >= TARGET_SPEEDUP, f"decode B={batch}: {speedup:.2f}x HF, expected >= {TARGET_SPEEDUP:g}x"
