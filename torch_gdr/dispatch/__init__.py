"""Backend choice for the public call, NPU detection and the compiled-kernel cache."""

from torch_gdr.dispatch.backends import (BACKEND_ENV_VAR, BACKENDS, default_backend, resolve_backend,
                                         select_backend)
from torch_gdr.dispatch.device import npu_available
from torch_gdr.dispatch.kernel_cache import cache_clear, cache_info
from torch_gdr.dispatch.pypto_backend import (STRICT_ENV_VAR, PyptoBackendError, PyptoFallbackWarning,
                                              unsupported_reason)

__all__ = [
    "BACKEND_ENV_VAR", "BACKENDS", "STRICT_ENV_VAR", "PyptoBackendError", "PyptoFallbackWarning", "cache_clear",
    "cache_info", "default_backend", "npu_available", "resolve_backend", "select_backend", "unsupported_reason",
]
