"""Fused C++/OpenMP CPU kernels of the chunked gated delta rule.

Entry points (see :mod:`torch_gdr.ops.cpu.kernels` for shapes and dtypes):

- :func:`available` / :func:`unavailable_reason`: whether the extension builds here;
- :func:`chunk_fwd`: the chunked forward, optionally returning the chunk states;
- :func:`chunk_bwd`: its hand-written backward from those states;
- :func:`recurrent_fwd`: the per-token step for decode and short T;
- :func:`torch_gdr.ops.cpu.pool.pool_recurrent_fwd`: that step over a state pool, in place
  (serving; the semantics are :mod:`torch_gdr._pool`'s).

The extension is compiled at first use into the cache directory (:mod:`._build`);
without a working C++ toolchain every entry point runs the pure-torch path, with one
warning.
"""

from torch_gdr.ops.cpu.kernels import (available, chunk_bwd, chunk_fwd, kernel_chunk_size, recurrent_fwd,
                                       unavailable_reason)

__all__ = ["available", "chunk_bwd", "chunk_fwd", "kernel_chunk_size", "recurrent_fwd", "unavailable_reason"]
