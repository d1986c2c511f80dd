"""Backend choice for the public call, the fallback policy and NPU detection."""

from torch_gdr._device import npu_available
from torch_gdr._fallback import (STRICT_ENV_VAR, BackendError, FallbackWarning, FlaBackendError, FlaFallbackWarning,
                                 PyptoBackendError, PyptoFallbackWarning)
from torch_gdr.dispatch.backends import BACKEND_ENV_VAR, BACKENDS, default_backend, resolve_backend, run_forward
from torch_gdr.ops.pypto import cache_clear, cache_info
from torch_gdr.ops.pypto.spec import unsupported_reason

__all__ = [
    "BACKEND_ENV_VAR", "BACKENDS", "STRICT_ENV_VAR", "BackendError", "FallbackWarning", "FlaBackendError",
    "FlaFallbackWarning", "PyptoBackendError", "PyptoFallbackWarning", "cache_clear", "cache_info",
    "default_backend", "npu_available", "resolve_backend", "run_forward", "unsupported_reason",
]
