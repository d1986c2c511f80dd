"""Shared pieces of the benchmark suite: inputs, flop counts, the implementations timed,
and the peak-memory probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Optional

import torch

import torch_gdr
from torch_gdr import testing

CHUNK = 64
# (B, T, H = HV, K = V): the shapes of the issue.
SHAPES = {"4096x4": (1, 4096, 4, 128), "16384x2": (1, 16384, 2, 128)}


def make_inputs(batch: int, seq_len: int, heads: int, dim: int, dtype=torch.float32, seed: int = 0,
                requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, g, beta)`` of :func:`torch_gdr.testing.make_inputs` at a bench shape (H = HV,
    K = V = dim, unit-norm q/k)."""
    x = testing.make_inputs(batch_size=batch, seq_len=seq_len, num_qk_heads=heads, num_v_heads=heads, head_k_dim=dim,
                            head_v_dim=dim, dtype=dtype, seed=seed, normalize_qk=True, requires_grad=requires_grad)
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta"))


def forward_flops(num_tokens: int, heads: int, dim: int, chunk: int = CHUNK) -> float:
    """Nominal flops of the chunked forward: 10 C^2 D + 6 C D^2 + 2 C^3 / 3 per chunk and head."""
    chunks = -(-num_tokens // chunk)
    return chunks * heads * (10 * chunk**2 * dim + 6 * chunk * dim**2 + 2 * chunk**3 / 3)


def hf_fallback() -> Optional[Callable]:
    """transformers' Qwen3-Next pure-torch chunked function, or None when not installed."""
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None
    fn = m.torch_chunk_gated_delta_rule
    return getattr(fn, "__wrapped__", fn)


def run_ours(q, k, v, g, beta, **kw):
    return torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=CHUNK,
                                            backend="torch", **kw)


def run_hf(q, k, v, g, beta):
    # Same [B, T, H, D] inputs; it transposes to [B, H, T, D] itself, scale = K ** -0.5.
    return hf_fallback()(q, k, v, g, beta, chunk_size=CHUNK, output_final_state=True)


IMPLS = {"torch_gdr": run_ours, "hf_fallback": run_hf}


def forward_backward(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> None:
    o, state = fn(*inputs)
    (o.sum() + state.sum()).backward()
    for t in inputs:
        t.grad = None


_PROBE = r"""
import json, sys, torch
sys.path.insert(0, {bench_dir!r})
import _common as c
torch.set_num_threads({threads})

def status(key):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

inputs = c.make_inputs(*{shape!r}, requires_grad=True)
fn = c.IMPLS[{impl!r}]
c.forward_backward(fn, inputs)  # warm-up: lazy initialisation is not the op's memory
base = status('VmRSS')
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset VmHWM, the peak resident set
o, s = fn(*inputs)
(o.sum() + s.sum()).backward()
print(json.dumps({{'peak_mib': (status('VmHWM') - base) / 2**20}}))
"""


def peak_memory_mib(impl: str, shape: tuple[int, int, int, int]) -> Optional[float]:
    """Peak resident memory of one forward + backward above what was resident before it
    (inputs allocated, one warm-up call done), in MiB, measured in a fresh process.

    Why this way: tracemalloc does not see torch's allocations, and the profiler's memory
    events miss allocations made inside a custom op. The kernel's high-water mark of the
    resident set (VmHWM, reset through /proc/self/clear_refs) sees every page touched. So
    that it also sees pages freed and reused, glibc is told to serve every allocation of
    64 KiB or more by its own mmap, returned to the system on free
    (MALLOC_MMAP_THRESHOLD_=65536; the default threshold grows and keeps freed memory
    resident, which would make the number depend on allocation history). Linux only;
    returns None elsewhere.
    """
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    code = _PROBE.format(bench_dir=bench_dir, threads=torch.get_num_threads(), shape=tuple(shape), impl=impl)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(bench_dir), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]
