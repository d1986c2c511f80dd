"""PyPTO kernels of torch_gdr for the Ascend NPU, runnable on the CPU through PyPTO's interpreter.

Importing this package does not import pypto; the first kernel build does (see ``_env``).
"""

from ._env import PyptoUnavailableError, cache_dir, import_pypto, is_pypto_available
from .forward import chunk_offsets, pypto_chunk_gated_delta_rule_fwd
from .kernel import kernel_chunk_size

__all__ = [
    "PyptoUnavailableError",
    "cache_dir",
    "chunk_offsets",
    "import_pypto",
    "is_pypto_available",
    "kernel_chunk_size",
    "pypto_chunk_gated_delta_rule_fwd",
]
