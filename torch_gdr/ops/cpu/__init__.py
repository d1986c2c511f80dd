"""Fused C++/OpenMP CPU kernels of the chunked gated delta rule.

Entry points (see :mod:`torch_gdr.ops.cpu.kernels` for shapes and dtypes):

- :func:`available` / :func:`unavailable_reason`: whether the extension builds here;
- :func:`chunk_fwd`: the chunked forward, optionally returning the chunk states;
- :func:`chunk_bwd`: its hand-written backward from those states;
- :func:`recurrent_fwd`: the per-token step for decode and short T.

The extension is compiled at install time, one module per instruction-set variant
(:mod:`._variants`), or else at first use into the cache directory (:mod:`._build`); where
neither gives a module every entry point runs the pure-torch path, with one warning.
"""

from torch_gdr.ops.cpu.kernels import (available, chunk_bwd, chunk_fwd, kernel_chunk_size, recurrent_fwd,
                                       unavailable_reason)

__all__ = ["available", "chunk_bwd", "chunk_fwd", "kernel_chunk_size", "recurrent_fwd", "unavailable_reason"]
