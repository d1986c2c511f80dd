"""Decode without a pool at the pool's speed (issue 39): the in-place per-sequence step, the
layer's decode on GatedDeltaNetCache, and transformers' generate with ``use_torch_gdr``.

Same run, 2 threads (torch and OpenMP), medians over alternated rounds (every variant once
per round, in turn), Qwen3-Next's linear attention: H = 16, HV = 32, K = V = 128, float32,
the in-kernel l2norm and fla's activations on, ``"cpu"`` backend.

Part ``step`` (B = 8 and 64), one token per sequence:

- ``pool``: :func:`torch_gdr.fused_recurrent_gated_delta_rule` over a 512-slot pool
  (``ssm_state_indices``, rows spread over the pool), the reference;
- ``inplace``: the same call on a ``[B, HV, K, V]`` state with ``inplace_final_state=True``;
- ``new_state``: the same call returning a new final state (fla's default, the path before).

Part ``layer`` (B = 8 and 64): one decode step of a :class:`torch_gdr.nn.GatedDeltaNet`
(hidden 2048) on a :class:`~torch_gdr.nn.GatedDeltaNetCache` (in place), on a
:class:`~torch_gdr.nn.GatedDeltaNetPoolCache` (512 slots), and on the cache with its entry
marked not owned (the replacing path, before).

Part ``generate`` (``--generate-rounds``, 3 by default): transformers' ``generate`` on a small Qwen3-Next config (random weights,
3 linear-attention layers + 1 full-attention layer, dense MLP) with the same linear heads,
batch 16, greedy: the tokens of transformers alone, of ``use_torch_gdr(inplace_decode=False)``
and of ``use_torch_gdr()`` (in place) must be equal; time per decode step is
``(t(32 new tokens) - t(1 new token)) / 31``.

    OMP_NUM_THREADS=2 python bench/inplace_bench.py [--rounds 7] [--parts step,layer,generate]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from typing import Callable

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

import torch_gdr  # noqa: E402
from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache, GatedDeltaNetPoolCache  # noqa: E402

HEADS, V_HEADS, DIM, SLOTS, HIDDEN = 16, 32, 128, 512, 2048


def _timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` calls of ``fn``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _alternate(variants: dict[str, Callable[[], object]], rounds: int, repeat: int) -> dict[str, float]:
    """Median over ``rounds`` of each variant's median of ``repeat`` calls, variants in turn."""
    for fn in variants.values():  # warm up
        fn()
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        names = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in names:
            per_round[name].append(_timed(variants[name], repeat))
    return {name: statistics.median(ts) for name, ts in per_round.items()}


def _step_inputs(batch: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, 1, HEADS, DIM, generator=g) for _ in range(2))
    v = torch.randn(batch, 1, V_HEADS, DIM, generator=g)
    a, b = (torch.randn(batch, 1, V_HEADS, generator=g) for _ in range(2))
    return dict(q=q, k=k, v=v, a=a, b=b, A_log=torch.rand(V_HEADS, generator=g).log(),
                dt_bias=torch.randn(V_HEADS, generator=g))


def part_step(batch: int, rounds: int) -> dict[str, float]:
    x = _step_inputs(batch, seed=batch)
    gating = dict(use_gate_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True)
    pool = torch.randn(SLOTS, V_HEADS, DIM, DIM) * 0.01
    rows = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))[:batch]
    state = pool[rows].clone()

    def call(initial_state, **kw):
        return torch_gdr.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["a"], beta=x["b"],
                                                          initial_state=initial_state, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True, backend="cpu", **gating, **kw)

    # the three agree on one step from the same states
    with torch.no_grad():
        o_new, s_new = call(state)
        check = state.clone()
        o_in, _ = call(check, inplace_final_state=True)
        before = pool[rows].clone()
        o_pool, _ = call(pool, ssm_state_indices=rows)
        torch.testing.assert_close(o_in, o_new, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o_pool, o_new, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(check, s_new, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pool[rows], s_new, atol=1e-5, rtol=1e-5)
        pool[rows] = before
    variants = dict(pool=lambda: call(pool, ssm_state_indices=rows),
                    inplace=lambda: call(state, inplace_final_state=True),
                    new_state=lambda: call(state))
    with torch.no_grad():
        return _alternate(variants, rounds, repeat=9 if batch <= 8 else 5)


def part_layer(batch: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, num_heads=HEADS, num_v_heads=V_HEADS, head_k_dim=DIM, head_v_dim=DIM,
                          backend="cpu").eval()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randn(batch, 4, HIDDEN, generator=g)
    token = torch.randn(batch, 1, HIDDEN, generator=g)
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        layer(prompt, cache=cache)
        replaced = copy.copy(cache)
        pool_cache = GatedDeltaNetPoolCache(slots=SLOTS)
        pool_cache.allocate(range(SLOTS))  # requests spread over the whole pool
        ids = [int(i) for i in torch.randperm(SLOTS, generator=g)[:batch]]
        pool_batch = pool_cache.batch(ids)
        layer(prompt, cache=pool_batch)
        # the same step on both caches from the same prompt (the pool advances once: no matter)
        torch.testing.assert_close(layer(token, cache=copy.copy(cache)), layer(token, cache=pool_batch),
                                   atol=1e-4, rtol=1e-4)

    def not_owned() -> None:
        replaced.get(layer.cache_key).owned = False  # the replacing path (before): a new state per step
        layer(token, cache=replaced)

    variants = dict(pool_cache=lambda: layer(token, cache=pool_batch),
                    inplace_cache=lambda: layer(token, cache=cache),
                    new_state_cache=not_owned)
    with torch.no_grad():
        return _alternate(variants, rounds, repeat=7 if batch <= 8 else 3)


def _qwen3_next(transformers) -> torch.nn.Module:
    config = transformers.Qwen3NextConfig(
        vocab_size=2048, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, linear_conv_kernel_dim=4, linear_key_head_dim=DIM, linear_value_head_dim=DIM,
        linear_num_key_heads=HEADS, linear_num_value_heads=V_HEADS, num_experts=0, pad_token_id=0, bos_token_id=2,
        eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # realistic gates so the state carries across tokens
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.uniform_(-3.0, -1.0)
    return model


def part_generate(rounds: int, batch: int = 16, new_tokens: int = 32) -> dict[str, float]:
    import transformers
    from torch_gdr.integrations.transformers import use_torch_gdr

    base = _qwen3_next(transformers)
    models = dict(copying=use_torch_gdr(copy.deepcopy(base), inplace_decode=False),
                  inplace=use_torch_gdr(copy.deepcopy(base)))
    ids = torch.randint(3, 2048, (batch, 16), generator=torch.Generator().manual_seed(3))

    def generate(model, n):
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.no_grad():
        start = time.perf_counter()
        want = generate(base, new_tokens)
        print(f"  transformers alone: {time.perf_counter() - start:.1f} s for {new_tokens} new tokens", flush=True)
        got = {name: generate(m, new_tokens) for name, m in models.items()}
        for name, seq in got.items():
            assert torch.equal(seq, want), f"{name}: tokens differ from transformers' own"
        variants = {}
        for name, m in models.items():
            variants[f"{name}_{new_tokens}"] = (lambda m=m: generate(m, new_tokens))
            variants[f"{name}_1"] = (lambda m=m: generate(m, 1))
        times = _alternate(variants, rounds, repeat=1)
    out = {}
    for name in models:
        out[f"{name}_ms_per_step"] = 1e3 * (times[f"{name}_{new_tokens}"] - times[f"{name}_1"]) / (new_tokens - 1)
        out[f"{name}_generate_s"] = times[f"{name}_{new_tokens}"]
    out["tokens_equal"] = 1.0
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parts", default="step,layer,generate")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--generate-rounds", type=int, default=3,
                        help="alternated rounds of the generate part (a few minutes each on a busy 2-core machine)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"CPU: {_cpu_name()}; torch threads {torch.get_num_threads()}, OMP_NUM_THREADS "
          f"{os.environ.get('OMP_NUM_THREADS')}; rounds {args.rounds}")
    parts = args.parts.split(",")
    for batch in (int(b) for b in args.batches.split(",")):
        if "step" in parts:
            t = part_step(batch, args.rounds)
            print(f"step  B={batch:3d}: pool {t['pool'] * 1e3:8.3f} ms  inplace {t['inplace'] * 1e3:8.3f} ms "
                  f"({t['inplace'] / t['pool']:.2f}x)  new_state {t['new_state'] * 1e3:8.3f} ms "
                  f"({t['new_state'] / t['pool']:.2f}x)", flush=True)
        if "layer" in parts:
            t = part_layer(batch, args.rounds)
            print(f"layer B={batch:3d}: pool_cache {t['pool_cache'] * 1e3:8.3f} ms  inplace_cache "
                  f"{t['inplace_cache'] * 1e3:8.3f} ms ({t['inplace_cache'] / t['pool_cache']:.2f}x)  new_state_cache "
                  f"{t['new_state_cache'] * 1e3:8.3f} ms ({t['new_state_cache'] / t['pool_cache']:.2f}x)", flush=True)
    if "generate" in parts:
        t = part_generate(args.generate_rounds)
        print(f"generate B=16, 32 new tokens (same tokens as transformers alone): in place "
              f"{t['inplace_ms_per_step']:.1f} ms/step ({t['inplace_generate_s']:.2f} s), copying "
              f"{t['copying_ms_per_step']:.1f} ms/step ({t['copying_generate_s']:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
