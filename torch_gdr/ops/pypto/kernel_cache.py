"""The caches of built PyPTO kernels, forward and backward, one kernel per concrete
configuration, each thread-safe.

Everything :func:`torch_gdr.ops.pypto.kernel.build_gdr_kernel` specialises on is part of
the forward key (:class:`KernelKey`; the backward's, :class:`BwdKernelKey`, likewise for
:func:`~torch_gdr.ops.pypto.kernel_bwd.build_gdr_bwd_kernel`): sequences N (b), heads H and HV (nv), head dims K and V, chunk length l, the
l2-norm flag, the scale, whether an initial state is read, the run target (NPU device
or the CPU interpreter), and which of fla's activations the kernel applies (the gated
variants take the raw gate and beta logits). A key is built once and reused after.

What "built" buys: on an NPU, pypto compiles the kernel at its first launch and keeps the
compiled module on the kernel object, so later calls only launch. On the CPU, pypto 0.2.0's
SIM path re-traces the graph for the interpreter at every call (it has no compile cache
there), so the cache saves the factory work but not the trace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
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
    gate_in_kernel: bool = False
    beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False


class CacheInfo(NamedTuple):
    """Cache statistics: lookups served from the cache, kernels built, keys held."""

    hits: int
    misses: int
    keys: tuple[KernelKey, ...]


class KernelCache:
    """Kernels built once per key, thread-safe: a lookup of a missing key builds it under the
    cache's lock (concurrent lookups of one key build it once)."""

    def __init__(self, key_type: type, default_builder: Callable[..., Any]) -> None:
        self._key_type = key_type
        self._default_builder = default_builder
        self._lock = threading.Lock()
        self._kernels: dict[Any, Any] = {}
        self._hits = 0
        self._misses = 0

    def get(self, builder: Callable[..., Any] | None = None, **config: Any) -> Any:
        """The kernel for ``config`` (the key's fields), built by ``builder`` (the default
        builder when None) from the key's fields on a miss."""
        key = self._key_type(**config)
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is not None:
                self._hits += 1
                return kernel
            kernel = (builder or self._default_builder)(**build_arguments(key))
            self._kernels[key] = kernel
            self._misses += 1
            return kernel

    def info(self) -> CacheInfo:
        """Hits, misses (= kernels built) and the keys held."""
        with self._lock:
            return CacheInfo(hits=self._hits, misses=self._misses, keys=tuple(self._kernels))

    def clear(self) -> None:
        """Drop every cached kernel and reset the statistics."""
        with self._lock:
            self._kernels.clear()
            self._hits = self._misses = 0


def build_arguments(key: Any) -> dict[str, Any]:
    """The builder's keyword arguments of ``key``: its fields but ``kind``."""
    arguments = asdict(key)
    arguments.pop("kind", None)
    return arguments


def _default_builder(**config: Any) -> Any:
    from .kernel import build_gdr_kernel

    return build_gdr_kernel(**config)


_forward_kernels = KernelCache(KernelKey, lambda **config: _default_builder(**config))


def get_gdr_kernel(*, builder: Callable[..., Any] | None = None, **config: Any) -> Any:
    """The forward kernel for ``config`` (the keyword arguments of ``build_gdr_kernel``), built once.

    Args:
        builder: factory used on a miss; defaults to ``build_gdr_kernel``.
        config: fields of :class:`KernelKey`.
    """
    return _forward_kernels.get(builder, **config)


def cache_info() -> CacheInfo:
    """Hits, misses (= kernels built) and the keys held, forward kernels."""
    return _forward_kernels.info()


def cache_clear() -> None:
    """Drop every cached forward kernel and reset the statistics."""
    _forward_kernels.clear()


def _default_bwd_builder(**config: Any) -> Any:
    from .kernel_bwd import build_gdr_bwd_kernel

    return build_gdr_bwd_kernel(**config)


@dataclass(frozen=True)
class BwdKernelKey:
    """Everything a backward kernel is specialised on; ``kind`` tells it from forward keys."""

    num_seqs: int
    num_qk_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    chunk_size: int
    scale: float
    on_device: bool
    gate_in_kernel: bool = False
    beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    kind: str = field(default="bwd")


class BwdCacheInfo(NamedTuple):
    """Backward-kernel cache statistics: lookups served, kernels built, keys held, launches."""

    hits: int
    misses: int
    keys: tuple[BwdKernelKey, ...]
    launches: int


_backward_kernels = KernelCache(BwdKernelKey, lambda **config: _default_bwd_builder(**config))
_launch_lock = threading.Lock()
_launches = 0


def get_gdr_bwd_kernel(*, builder: Callable[..., Any] | None = None, **config: Any) -> Any:
    """The backward kernel for ``config`` (fields of :class:`BwdKernelKey` but ``kind``), built once.

    ``builder`` (default :func:`.kernel_bwd.build_gdr_bwd_kernel`) is called on a miss with
    the same keyword arguments.
    """
    return _backward_kernels.get(builder, **config)


def bwd_cache_info() -> BwdCacheInfo:
    """Hits, misses (= kernels built), the keys held, and the launches since the last clear."""
    info = _backward_kernels.info()
    with _launch_lock:
        return BwdCacheInfo(hits=info.hits, misses=info.misses, keys=info.keys, launches=_launches)


def bwd_cache_clear() -> None:
    """Drop every cached backward kernel and reset the statistics (launches included)."""
    global _launches
    _backward_kernels.clear()
    with _launch_lock:
        _launches = 0


def launch_count() -> int:
    """How many times a backward kernel was launched (by any getter) since the last clear."""
    with _launch_lock:
        return _launches


def _count_launch() -> None:
    global _launches
    with _launch_lock:
        _launches += 1


def _default_decode_builder(**config: Any) -> Any:
    from .kernel_decode import build_decode_kernel

    return build_decode_kernel(**config)


@dataclass(frozen=True)
class DecodeKernelKey:
    """Everything a decode-step kernel is specialised on; ``kind`` tells it from other keys.
    The batch is not part of it (the kernel's batch is dynamic); it enters only through
    ``heads_per_body`` (one-token kernels: 1, 2, 4, 8 or 16 value heads a body, at most
    five; several-token ones: 1, or 2 at S = 4, 8, 12, 16), and S as its bucket
    (:func:`torch_gdr.ops.pypto.decode.token_bucket`): at most 5 + 7 + 4 = 16 kernels per
    configuration of heads, head dims and dtypes."""

    heads_per_body: int
    num_qk_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    tokens_per_seq: int
    use_qk_l2norm: bool
    scale: float
    input_dtype: str
    pool_dtype: str
    on_device: bool
    gate_in_kernel: bool = False
    beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    store_every_token: bool = False
    kind: str = field(default="decode")


class DecodeCacheInfo(NamedTuple):
    """Decode-kernel cache statistics: lookups served, kernels built, keys held, and the
    token buckets (S) those keys cover (sorted, each once)."""

    hits: int
    misses: int
    keys: tuple[DecodeKernelKey, ...]
    token_buckets: tuple[int, ...]


_decode_kernels = KernelCache(DecodeKernelKey, lambda **config: _default_decode_builder(**config))


def get_decode_kernel(*, builder: Callable[..., Any] | None = None, **config: Any) -> Any:
    """The decode kernel for ``config`` (fields of :class:`DecodeKernelKey` but ``kind``),
    built once by ``builder`` (default :func:`.kernel_decode.build_decode_kernel`)."""
    return _decode_kernels.get(builder, **config)


def decode_cache_info() -> DecodeCacheInfo:
    """Hits, misses (= kernels built), the keys held and their token buckets."""
    info = _decode_kernels.info()
    buckets = tuple(sorted({key.tokens_per_seq for key in info.keys}))
    return DecodeCacheInfo(hits=info.hits, misses=info.misses, keys=info.keys, token_buckets=buckets)


def decode_cache_clear() -> None:
    """Drop every cached decode kernel and reset the statistics."""
    _decode_kernels.clear()
