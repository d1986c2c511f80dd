"""Cache of built PyPTO kernels, one per concrete configuration.

Everything :func:`torch_gdr.ops.pypto.kernel.build_gdr_kernel` specialises on is part of
the key: sequences N (b), heads H and HV (nv), head dims K and V, chunk length l, the
l2-norm flag, the scale, whether an initial state is read, and the run target (NPU device
or the CPU interpreter). A key is built once and reused after.

What "built" buys: on an NPU, pypto compiles the kernel at its first launch and keeps the
compiled module on the kernel object, so later calls only launch. On the CPU, pypto 0.2.0's
SIM path re-traces the graph for the interpreter at every call (it has no compile cache
there), so the cache saves the factory work but not the trace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class KernelKey:
    """Everything a GDR kernel is specialised on."""

    num_seqs: int
    num_qk_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    chunk_size: int
    use_qk_l2norm: bool
    scale: float
    has_initial_state: bool
    on_device: bool
    input_dtype: str = "float32"
    output_chunk_states: bool = False


class CacheInfo(NamedTuple):
    """Cache statistics: lookups served from the cache, kernels built, keys held."""

    hits: int
    misses: int
    keys: tuple[KernelKey, ...]


_lock = threading.Lock()
_kernels: dict[KernelKey, Any] = {}
_hits = 0
_misses = 0


def _default_builder(**config: Any) -> Any:
    from .kernel import build_gdr_kernel

    return build_gdr_kernel(**config)


def get_gdr_kernel(*, builder: Callable[..., Any] | None = None, **config: Any) -> Any:
    """The kernel for ``config`` (the keyword arguments of ``build_gdr_kernel``), built once.

    Args:
        builder: factory used on a miss; defaults to ``build_gdr_kernel``.
        config: fields of :class:`KernelKey`.
    """
    global _hits, _misses
    key = KernelKey(**config)
    with _lock:
        kernel = _kernels.get(key)
        if kernel is not None:
            _hits += 1
            return kernel
        kernel = (builder or _default_builder)(**asdict(key))
        _kernels[key] = kernel
        _misses += 1
        return kernel


def cache_info() -> CacheInfo:
    """Hits, misses (= kernels built) and the keys held."""
    with _lock:
        return CacheInfo(hits=_hits, misses=_misses, keys=tuple(_kernels))


def cache_clear() -> None:
    """Drop every cached kernel and reset the statistics."""
    global _hits, _misses
    with _lock:
        _kernels.clear()
        _hits = 0
        _misses = 0
