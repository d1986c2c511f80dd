"""Which backend serves a call, the fallback policy, and the public op built on them.

:mod:`.registry` holds every backend and :func:`select`; :mod:`.run` runs the selected one
for each entry point; :mod:`.op` defines ``torch.ops.gdr.chunked_gated_delta_rule``.
"""

from torch_gdr._device import npu_available
from torch_gdr._fallback import (STRICT_ENV_VAR, BackendError, CpuBackendError, CpuFallbackWarning, FallbackWarning,
                                 FlaBackendError, FlaFallbackWarning, NoBackendError, PyptoBackendError,
                                 PyptoFallbackWarning)
from torch_gdr.dispatch import op as _op  # noqa: F401  (registers the public op)
from torch_gdr.dispatch.registry import (BACKEND_ENV_VAR, BACKENDS, DEVICE_ORDERS, Selection, default_backend,
                                         device_order, report, requested_backend, resolve_backend, select,
                                         smallest_chunk_size)
from torch_gdr.dispatch.run import needs_grad, run_checkpoints, run_chunk, run_pool_step, run_step
from torch_gdr.ops._backend import Backend, CallSpec, Capabilities, OpArgs, Reason, reason_text
from torch_gdr.ops.pypto import cache_clear, cache_info

__all__ = [
    "BACKEND_ENV_VAR", "BACKENDS", "Backend", "BackendError", "CallSpec", "Capabilities", "CpuBackendError",
    "CpuFallbackWarning", "DEVICE_ORDERS", "FallbackWarning", "FlaBackendError", "FlaFallbackWarning",
    "NoBackendError", "OpArgs", "PyptoBackendError", "PyptoFallbackWarning", "Reason", "STRICT_ENV_VAR", "Selection",
    "cache_clear", "cache_info", "default_backend", "device_order", "needs_grad", "npu_available", "reason_text",
    "report", "requested_backend", "resolve_backend", "run_checkpoints", "run_chunk", "run_pool_step", "run_step", "select",
    "smallest_chunk_size",
]
