"""Concurrent calls: servers call the op from several threads, sharing every process-wide
cache (varlen layouts, masks, compiled kernels)."""

from __future__ import annotations

import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

import torch_gdr
import torch_gdr.ops.torch.chunk_layout as chunk_layout
from tests.helpers import make_inputs
from torch_gdr.ops.pypto import kernel_cache

NUM_THREADS = 8
CALLS_PER_THREAD = 150


def _packings(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.choice([0, 1, 5, 16, 17, 40]) for _ in range(rng.randint(1, 5))] for _ in range(count)]


def test_concurrent_varlen_calls_equal_serial_ones() -> None:
    """8 threads x 150 calls over 24 packings (more than the layout cache keeps, so entries
    are evicted while other threads read them): the results equal the serial ones, nothing
    raises, and the shared layout cache is consistent afterwards."""
    cases = []
    for i, lens in enumerate(_packings(24)):
        if sum(lens) == 0:
            lens = lens + [3]
        cases.append(make_inputs(seqlens=lens, num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                                 with_initial_state=True, dtype=torch.float32, seed=i))

    def run(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=16)

    serial = [run(inputs) for inputs in cases]

    def worker(seed: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        rng = random.Random(seed)
        results = []
        for _ in range(CALLS_PER_THREAD):
            i = rng.randrange(len(cases))
            results.append((i, *run(cases[i])))
        return results

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: races show up in every run, not one in a hundred
    try:
        with ThreadPoolExecutor(NUM_THREADS) as pool:
            outcomes = [f.result() for f in [pool.submit(worker, seed) for seed in range(NUM_THREADS)]]
    finally:
        sys.setswitchinterval(interval)
    for results in outcomes:
        for i, o, s in results:
            torch.testing.assert_close(o, serial[i][0], atol=0, rtol=0)
            torch.testing.assert_close(s, serial[i][1], atol=0, rtol=0)
    with chunk_layout._SHARED_LOCK:
        keys = list(chunk_layout._SHARED)
        assert len(keys) == len(chunk_layout._SHARED) <= chunk_layout.SHARED_LAYOUTS
        assert all(chunk_layout._SHARED[key] is not None for key in keys)
    o, s = run(cases[0])  # a later single-threaded call still works
    torch.testing.assert_close(o, serial[0][0], atol=0, rtol=0)


def test_concurrent_kernel_lookups_build_each_key_once() -> None:
    kernel_cache.cache_clear()
    builds: list[dict] = []
    lock = threading.Lock()

    def builder(**config):
        with lock:
            builds.append(config)
        return object()

    config = dict(num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64, chunk_size=64, use_qk_l2norm=True,
                  scale=0.125, has_initial_state=False, on_device=False)

    def lookup(n: int) -> object:
        return kernel_cache.get_gdr_kernel(builder=builder, num_seqs=1 + n % 3, **config)

    with ThreadPoolExecutor(NUM_THREADS) as pool:
        kernels = list(pool.map(lookup, range(200)))
    info = kernel_cache.cache_info()
    assert len(builds) == 3 and info.misses == 3 and info.hits == 197
    assert len({id(k) for k in kernels}) == 3
    kernel_cache.cache_clear()
