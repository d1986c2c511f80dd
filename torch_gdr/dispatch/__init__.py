"""Backend choice for the public call, and NPU detection."""

from torch_gdr.dispatch.backends import BACKEND_ENV_VAR, BACKENDS, default_backend, get_backend, resolve_backend
from torch_gdr.dispatch.device import npu_available

__all__ = ["BACKEND_ENV_VAR", "BACKENDS", "default_backend", "get_backend", "npu_available", "resolve_backend"]
