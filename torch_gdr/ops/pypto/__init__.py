"""PyPTO kernels of torch_gdr for the Ascend NPU, runnable on the CPU through PyPTO's interpreter.

Importing this package does not import pypto; the first kernel build does (see ``_env``).
"""

from typing import NamedTuple

from torch_gdr._paths import cache_dir

from . import kernel_cache as _caches
from ._env import PyptoUnavailableError, import_pypto, is_pypto_available
from .backward import pypto_chunk_gated_delta_rule_bwd
from .forward import chunk_offsets, pypto_chunk_gated_delta_rule_fwd
from .kernel import kernel_chunk_size


class KernelCaches(NamedTuple):
    """The compiled-kernel caches: forward kernels (hits, misses, keys), backward kernels
    (hits, misses, keys, launches) and decode-step kernels (hits, misses, keys, token_buckets)."""

    forward: _caches.CacheInfo
    backward: _caches.BwdCacheInfo
    decode: _caches.DecodeCacheInfo


def cache_info() -> KernelCaches:
    """What the forward, backward and decode kernel caches hold, each apart."""
    return KernelCaches(_caches.cache_info(), _caches.bwd_cache_info(), _caches.decode_cache_info())


def cache_clear() -> None:
    """Drop every cached forward, backward and decode kernel and reset the statistics."""
    _caches.cache_clear()
    _caches.bwd_cache_clear()
    _caches.decode_cache_clear()

__all__ = [
    "KernelCaches",
    "PyptoUnavailableError",
    "cache_clear",
    "cache_info",
    "cache_dir",
    "chunk_offsets",
    "import_pypto",
    "is_pypto_available",
    "kernel_chunk_size",
    "pypto_chunk_gated_delta_rule_bwd",
    "pypto_chunk_gated_delta_rule_fwd",
]
