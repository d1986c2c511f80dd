"""What happens when a backend cannot serve a call: an error or one warning per reason.

A backend the caller named (``backend=...`` or ``TORCH_GDR_BACKEND``) is a demand: where it
cannot serve a call, the call raises the backend's :class:`BackendError`. A backend chosen by
default for the device falls back to the pure-torch path and warns once per (backend,
reason) with its :class:`FallbackWarning`; ``TORCH_GDR_STRICT=1`` makes every fallback an
error. The policy takes a reason's words (``Reason.text``, several joined by
:func:`~torch_gdr.ops._backend.reason_text`), which say what the backend lacks, as fla's
verifiers do.
"""

from __future__ import annotations

import os
import threading
import warnings

STRICT_ENV_VAR = "TORCH_GDR_STRICT"


class BackendError(RuntimeError):
    """A backend was asked for by name (or strict mode is on) and cannot serve the call."""


class FallbackWarning(RuntimeWarning):
    """A default backend fell back to the pure-torch path."""


class PyptoBackendError(BackendError):
    """The PyPTO backend was asked for by name and cannot serve the call."""


class PyptoFallbackWarning(FallbackWarning):
    """The default backend of an NPU fell back from the PyPTO kernel to the pure-torch path."""


class FlaBackendError(BackendError):
    """The fla backend was asked for by name and cannot serve the call."""


class FlaFallbackWarning(FallbackWarning):
    """The default backend of a CUDA device fell back from fla's kernels to the pure-torch path."""


class CpuBackendError(BackendError):
    """The ``"cpu"`` backend (the fused C++ kernels) was asked for by name and cannot serve the call."""


class CpuFallbackWarning(FallbackWarning):
    """The default backend of CPU tensors fell back from the fused C++ kernels (not built or
    not loadable here) to the pure-torch path."""


class NoBackendError(BackendError, ValueError):
    """No backend can serve a call; the message lists every backend's reasons."""


_CLASSES: dict[str, tuple[type[BackendError], type[FallbackWarning]]] = {
    "pypto": (PyptoBackendError, PyptoFallbackWarning),
    "fla": (FlaBackendError, FlaFallbackWarning),
    "cpu": (CpuBackendError, CpuFallbackWarning),
}

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def strict_mode() -> bool:
    """True when ``TORCH_GDR_STRICT`` asks for every fallback to be an error."""
    return os.environ.get(STRICT_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def error_class(backend: str) -> type[BackendError]:
    """The error a named ``backend`` raises when it cannot serve a call."""
    return _CLASSES.get(backend, (BackendError, FallbackWarning))[0]


def failure_reason(what: str, error: BaseException) -> str:
    """The fallback reason of ``what`` (e.g. "the kernel") failing with ``error``: its type and
    the first line of its message."""
    lines = str(error).splitlines()
    return f"{what} failed: {type(error).__name__}: {lines[0] if lines else ''}"


def refuse_or_warn(backend: str, reason: str, *, named: bool, instead: str = "the pure-torch path",
                   stacklevel: int = 4) -> None:
    """Apply the policy to ``backend`` being unable to serve a call for ``reason``: raise its
    error when it was ``named`` or in strict mode; otherwise warn once per reason and return
    (the caller then runs ``instead``, on the same device)."""
    error, warning = _CLASSES.get(backend, (BackendError, FallbackWarning))
    if named or strict_mode():
        raise error(f"backend {backend!r} cannot serve this call: {reason}")
    with _warned_lock:
        if (backend, reason) in _warned:
            return
        _warned.add((backend, reason))
    warnings.warn(f"torch_gdr: the {backend} backend cannot serve this call ({reason}); running {instead} on "
                  f"the same device instead. Set {STRICT_ENV_VAR}=1 to make this an error.",
                  warning, stacklevel=stacklevel)


def reset_warnings() -> None:
    """Forget which reasons were warned about (each warns again once)."""
    with _warned_lock:
        _warned.clear()
