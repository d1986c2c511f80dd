"""One registry of backends and one :func:`select` for every entry point.

| name        | what runs                                                   | default on         |
| ----------- | ----------------------------------------------------------- | ------------------ |
| "cpu"       | the fused C++/OpenMP kernels (``gdr::_cpu_*``)              | CPU tensors        |
| "torch"     | the chunked algorithm in pure torch (``gdr::_torch_*``)     | every device, last |
| "recurrent" | the per-token recurrence, the definition (``gdr::_recurrent_*``) | never         |
| "pypto"     | the PyPTO kernels (``gdr::_pypto_*``); CPU tensors through   | NPU tensors        |
|             | PyPTO's interpreter                                         |                    |
| "fla"       | fla-core's Triton kernels (``gdr::_fla_*``)                 | CUDA tensors       |

``backend=None`` takes ``TORCH_GDR_BACKEND`` when it is set, else the first backend of the device's order (:data:`DEVICE_ORDERS`) that
serves the call; in ``backend=`` and the variable alike, case and surrounding blanks do not
matter (``" CPU "`` names ``"cpu"``). The policy:

- a backend the caller named (``backend=`` or the variable) that cannot serve a call raises
  its :class:`~torch_gdr._fallback.BackendError` with every reason;
- a default backend that cannot serve a call is passed over: silently for calls it simply
  does not take (float64 on ``"cpu"``), with one warning per reason where it is missing or
  broken on this machine (kernels not built, pypto absent on an NPU) or where it warns for
  any fallback (``"pypto"``, ``"fla"``); ``TORCH_GDR_STRICT=1`` turns every warning into the
  error;
- when no backend serves a call, :class:`~torch_gdr._fallback.NoBackendError` lists every
  backend's reasons.

The questions read shapes, dtypes and devices only, and whatever they must load (an
extension, pypto, fla) is decided once per process as a constant to ``torch.compile``, so
selection runs inside compiled graphs without a break.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from torch_gdr._fallback import NoBackendError, refuse_or_warn
from torch_gdr._validate import CHUNK_SIZES
from torch_gdr.ops._backend import Backend, CallSpec, Reason, reason_text
from torch_gdr.ops.cpu.backend import BACKEND as _CPU
from torch_gdr.ops.fla.backend import BACKEND as _FLA
from torch_gdr.ops.pypto.backend import BACKEND as _PYPTO
from torch_gdr.ops.recurrent.backend import BACKEND as _RECURRENT
from torch_gdr.ops.torch.backend import BACKEND as _TORCH

BACKEND_ENV_VAR = "TORCH_GDR_BACKEND"

#: Every backend by name.
BACKENDS: dict[str, Backend] = {b.name: b for b in (_TORCH, _CPU, _RECURRENT, _PYPTO, _FLA)}

#: The backend that serves every call on every device: the end of every order.
UNIVERSAL_BACKEND = "torch"

#: ``(entry, device type) -> backends tried in order`` by a default call; any other device
#: type tries ``"torch"`` only. The NPU's step without a pool stays on ``"torch"`` (the
#: PyPTO step is one chunked launch per token); its step over a state pool is the PyPTO
#: decode kernel.
DEVICE_ORDERS: dict[tuple[str, str], tuple[str, ...]] = {
    ("chunk", "cpu"): ("cpu", "torch"),
    ("step", "cpu"): ("cpu", "torch"),
    ("pool_step", "cpu"): ("cpu", "torch"),
    ("chunk", "cuda"): ("fla", "torch"),
    ("step", "cuda"): ("fla", "torch"),
    ("chunk", "npu"): ("pypto", "torch"),
    ("chunk", "privateuseone"): ("pypto", "torch"),
    ("pool_step", "npu"): ("pypto", "torch"),
    ("pool_step", "privateuseone"): ("pypto", "torch"),
}


class Selection(NamedTuple):
    """The backend serving a call and whether the caller named it (then it may not fall back)."""

    backend: Backend
    named: bool


def device_order(entry: str, device: torch.device) -> tuple[str, ...]:
    """The backends a default call of ``entry`` on ``device`` tries, in order."""
    return DEVICE_ORDERS.get((entry, device.type), (UNIVERSAL_BACKEND,))


def backend_name(backend: str) -> str:
    """A backend's name as the caller wrote it, without surrounding blanks and in lower case
    (``" CPU "`` names ``"cpu"``), for ``backend=`` and ``TORCH_GDR_BACKEND`` alike."""
    return backend.strip().lower()


def requested_backend(backend: Optional[str]) -> Optional[str]:
    """The backend the caller named: ``backend``, else ``TORCH_GDR_BACKEND``, else None;
    case and surrounding blanks do not matter in either. ``ValueError`` for a name that is
    not a backend."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV_VAR, "")
        source = BACKEND_ENV_VAR
        if not backend.strip():
            return None
    if not isinstance(backend, str) or backend_name(backend) not in BACKENDS:
        raise ValueError(f"{source}: expected one of {sorted(BACKENDS)}, got {backend!r}")
    return backend_name(backend)


def default_backend(device: torch.device, entry: str = "chunk") -> str:
    """The first backend of the device's order for ``entry`` (before asking whether it
    serves a particular call)."""
    return device_order(entry, device)[0]


def resolve_backend(backend: Optional[str], device: torch.device, entry: str = "chunk") -> str:
    """The backend a call names, or the first of the device's order."""
    return requested_backend(backend) or default_backend(device, entry)


def _warns(backend: Backend, reasons: list[Reason]) -> bool:
    """Whether passing ``backend`` over for ``reasons`` is worth a warning (see the module doc)."""
    if any(r.kind == "absent" for r in reasons):
        return False
    return all(r.kind == "missing" for r in reasons) or backend.warns_when_unsupported


def _entry_words(entry: str) -> str:
    return {"chunk": "this call", "step": "this token-by-token call",
            "checkpoints": "this call with checkpoint_every",
            "pool_step": "this step over a state pool"}[entry]


@torch.compiler.assume_constant_result
def _pass_over(name: str, reasons: str, instead: str, warn: bool) -> bool:
    """Apply the policy to a default backend passed over (a constant to ``torch.compile``:
    the warning, or the strict-mode error, happens while tracing, once)."""
    if warn:
        refuse_or_warn(name, reasons, named=False, instead=f"the {instead!r} backend", stacklevel=6)
    return True


def select(call: CallSpec, backend: Optional[str] = None) -> Selection:
    """The backend serving ``call``: the one named (``backend`` or ``TORCH_GDR_BACKEND``), or
    the first of the device's order that serves it. Raises the named backend's error, or
    :class:`NoBackendError`, as the module doc says; warns when a default passes a backend
    over for a reason worth it."""
    name = requested_backend(backend)
    if name is not None:
        chosen = BACKENDS[name]
        reasons = chosen.unsupported_reasons(call)
        if reasons:
            raise chosen.error(f"backend {name!r} cannot serve {_entry_words(call.entry)}: {reason_text(reasons)}")
        return Selection(chosen, True)
    order = device_order(call.entry, call.device)
    for position, candidate in enumerate(order):
        chosen = BACKENDS[candidate]
        reasons = chosen.unsupported_reasons(call)
        if not reasons:
            return Selection(chosen, False)
        if position + 1 < len(order):
            _pass_over(candidate, reason_text(reasons), order[position + 1], _warns(chosen, reasons))
    lines = [f"  {n}: {reason_text(BACKENDS[n].unsupported_reasons(call)) or 'not in the order of this device'}"
             for n in BACKENDS]
    raise NoBackendError(f"no backend can serve {_entry_words(call.entry)} on {call.device.type!r} tensors:\n"
                         + "\n".join(lines))


def report(call: CallSpec) -> dict[str, list[Reason]]:
    """Every backend's reasons for ``call`` (empty: it serves it), for diagnostics."""
    return {name: b.unsupported_reasons(call) for name, b in BACKENDS.items()}


def smallest_chunk_size(backend: Optional[str], device: torch.device) -> int:
    """The smallest chunk size the backend serving a chunked call on ``device`` takes: what
    a single-token decode through the chunked call should ask for, since it pads least."""
    sizes = BACKENDS[resolve_backend(backend, device)].capabilities.chunk_sizes or CHUNK_SIZES
    return min(sizes)

