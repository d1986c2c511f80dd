"""The backends of the public call and how one is chosen.

| name        | forward op            | what runs                                           |
| ----------- | --------------------- | --------------------------------------------------- |
| "torch"     | ``gdr::_torch_fwd``   | the pure-torch chunked algorithm, any device; in    |
|             |                       | training it keeps the chunk states for the backward |
| "recurrent" | ``gdr::_recurrent_fwd`` | the per-token recurrence (the definition), any device |
| "pypto"     | ``gdr::_pypto_fwd``   | the PyPTO kernel: on Ascend NPUs, or on the CPU     |
|             |                       | through PyPTO's interpreter (a check, not fast)     |
| "fla"       | ``gdr::_fla_fwd``     | fla-core's Triton kernels, on CUDA tensors          |

``backend=None`` takes ``TORCH_GDR_BACKEND`` when it is set, else the default for the
inputs' device: ``"pypto"`` on NPUs, ``"fla"`` on CUDA where fla-core imports, ``"torch"``
elsewhere. Where the chosen backend
cannot serve a call, :func:`torch_gdr._fallback.refuse_or_warn` applies: a named backend
raises, a default one warns once per reason and the call runs the ``"torch"`` op. Dispatch
only picks ops; it registers nothing on one.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Optional

import torch

from torch_gdr._device import is_npu_device
from torch_gdr._fallback import BackendError, error_class, failure_reason, refuse_or_warn, strict_mode
from torch_gdr._validate import CHUNK_SIZES
from torch_gdr.ops import fla
from torch_gdr.ops.fla import op as fla_op
from torch_gdr.ops.pypto import op as pypto_op
from torch_gdr.ops.pypto import spec as pypto_spec
from torch_gdr.ops import registration

BACKEND_ENV_VAR = "TORCH_GDR_BACKEND"


class Backend(NamedTuple):
    """A backend: its forward op, whether that op returns chunk states its backward reads,
    and, for a kernel that cannot serve every call, ``unsupported_reason(args, needs_grad)``
    (``args``: the public op's twelve arguments; a reason string, or None when it can)."""

    forward_op: Any
    keeps_chunk_states: bool
    unsupported_reason: Optional[Callable[[tuple, bool], Optional[str]]] = None
    named_forward_op: Any = None  # where a named backend's backward must raise rather than fall back


def _pypto_reason(args: tuple, needs_grad: bool) -> Optional[str]:
    return pypto_spec.unsupported_reason(args[0], args[2], args[10])


def _fla_reason(args: tuple, needs_grad: bool) -> Optional[str]:
    q, k, v, g, beta, _, initial_state, _, _, cu_seqlens, chunk_size, _ = args
    return fla.unavailable_reason(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size, needs_backward=needs_grad)


BACKENDS: dict[str, Backend] = {
    "torch": Backend(registration.torch_chunked_fwd, True),
    "recurrent": Backend(registration.recurrent_fwd, False),
    "pypto": Backend(pypto_op.pypto_fwd, True, _pypto_reason, pypto_op.pypto_named_fwd),
    "fla": Backend(fla_op.fla_fwd, True, _fla_reason),
}
FALLBACK_BACKEND = "torch"


@torch.compiler.assume_constant_result
def _fla_available() -> bool:
    return fla.available()


def default_backend(device: torch.device) -> str:
    """The backend ``backend=None`` means on ``device`` when no environment variable is set:
    ``"pypto"`` on NPUs, ``"fla"`` on CUDA devices where fla-core imports, else ``"torch"``."""
    if is_npu_device(device.type):
        return "pypto"
    if device.type == "cuda" and _fla_available():
        return "fla"
    return "torch"


def _resolve(backend: Optional[str], device: torch.device) -> tuple[str, bool]:
    """``(name, named)``: the backend serving a call and whether the caller named it."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV_VAR, "").strip().lower() or None
        source = BACKEND_ENV_VAR
    if backend is None:
        return default_backend(device), False
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{source}: expected one of {sorted(BACKENDS)}, got {backend!r}")
    return backend, True


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """Name the backend that serves a call; raise ``ValueError`` for an unknown name."""
    return _resolve(backend, device)[0]


def run_forward(backend: Optional[str], args: tuple, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a checked call (``args``: the public op's twelve arguments in order) on the backend
    serving it, or on ``"torch"`` where that one cannot (see the module doc). ``needs_grad``:
    autograd records the call, so a backend that can keeps its chunk states. Returns
    ``(o, final_state)`` (the latter empty unless asked for)."""
    name, named = _resolve(backend, args[0].device)
    chosen = BACKENDS[name]
    if chosen.unsupported_reason is not None:
        reason = chosen.unsupported_reason(args, needs_grad)
        if reason is None:
            forward_op = chosen.named_forward_op if named and chosen.named_forward_op is not None else \
                chosen.forward_op
            try:
                o, final_state, _ = forward_op(*args, needs_grad and chosen.keeps_chunk_states)
                return o, final_state
            except BackendError:
                raise
            except Exception as error:  # noqa: BLE001 - a kernel failing to build or run is a fallback reason
                reason = failure_reason("the kernel", error)
                if named or strict_mode():
                    raise error_class(name)(f"backend {name!r} cannot serve this call: {reason}") from error
        refuse_or_warn(name, reason, named=named, stacklevel=5)
        chosen = BACKENDS[FALLBACK_BACKEND]
    o, final_state, _ = chosen.forward_op(*args, needs_grad and chosen.keeps_chunk_states)
    return o, final_state


def smallest_chunk_size(backend: Optional[str], device: torch.device) -> int:
    """The smallest chunk size the backend serving a call on ``device`` takes: what a
    single-token decode step should ask for, since it pads least."""
    return pypto_spec.CHUNK_SIZES[0] if resolve_backend(backend, device) == "pypto" else CHUNK_SIZES[0]
