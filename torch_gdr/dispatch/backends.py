"""The backends of the public call and how one is chosen.

| name        | what runs                                                  |
| ----------- | ---------------------------------------------------------- |
| "torch"     | the pure-torch chunked algorithm, any device (the op; in   |
|             | training, eager or compiled, an op that keeps the states)  |
| "recurrent" | the per-token recurrence (the definition), any device      |
| "pypto"     | the PyPTO kernel: on Ascend NPUs, or on the CPU through    |
|             | PyPTO's interpreter (a correctness check, not fast)        |

``backend=None`` takes ``TORCH_GDR_BACKEND`` when it is set, else the default for the
inputs' device: ``"pypto"`` on NPUs (falling back to ``"torch"`` with a warning where the
kernel cannot serve a call), ``"torch"`` elsewhere. A backend named by the argument or the
environment variable is a demand: where it cannot serve a call, the call raises.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch

from torch_gdr._layout import run_in_canonical_layout
from torch_gdr._validate import CHUNK_SIZES
from torch_gdr.dispatch.device import is_npu_device
from torch_gdr.dispatch.pypto_backend import KERNEL_CHUNK_SIZES, pypto_backend
from torch_gdr.ops.registration import _check_real, chunked_pure_torch
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

BACKEND_ENV_VAR = "TORCH_GDR_BACKEND"

BackendFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _recurrent_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                       cu_seqlens, chunk_size):
    del chunk_size  # the recurrence has no chunks
    return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                            use_qk_l2norm_in_kernel, cu_seqlens)


def _recurrent(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
               chunk_size, state_v_first):
    _check_real(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first)
    return run_in_canonical_layout(_recurrent_forward, q, k, v, g, beta, scale, initial_state,
                                   use_qk_l2norm_in_kernel, cu_seqlens, chunk_size, state_v_first)


def _torch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
           chunk_size, state_v_first):
    """The pure-torch chunked algorithm (:func:`torch_gdr.ops.registration.chunked_pure_torch`).
    A call that records autograd, eager or under ``torch.compile``, runs the private op
    ``gdr::_chunked_forward_with_states``: it also returns the state entering every chunk, and
    its registered autograd hands them to the backward op, which then skips the pass that
    recomputes them. Every other call runs ``torch.ops.gdr.chunked_gated_delta_rule`` (whose
    own autograd, saving only the op's inputs, recomputes them). Both validate the call and
    give the same values and gradients."""
    return chunked_pure_torch(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                              cu_seqlens, chunk_size, state_v_first)


BACKENDS: dict[str, BackendFn] = {"torch": _torch, "recurrent": _recurrent, "pypto": pypto_backend}


def default_backend(device: torch.device) -> str:
    """The backend ``backend=None`` means on ``device`` when no environment variable is set."""
    return "pypto" if is_npu_device(device.type) else "torch"


def _resolve(backend: Optional[str], device: torch.device) -> tuple[str, bool]:
    """``(name, named)``: the backend serving a call and whether the caller named it."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV_VAR, "").strip().lower() or None
        source = BACKEND_ENV_VAR
    if backend is None:
        return default_backend(device), False
    if backend not in BACKENDS:
        raise ValueError(f"{source}: expected one of {sorted(BACKENDS)}, got {backend!r}")
    return backend, True


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """Name the backend that serves a call; raise ``ValueError`` for an unknown name."""
    return _resolve(backend, device)[0]


def select_backend(backend: Optional[str], device: torch.device) -> BackendFn:
    """The callable serving a call: it takes the op's arguments in order and returns
    ``(o, final_state)``. The default PyPTO backend may fall back; a named one may not."""
    name, named = _resolve(backend, device)
    if name == "pypto" and not named:
        return functools.partial(pypto_backend, explicit=False)
    return BACKENDS[name]


def smallest_chunk_size(backend: Optional[str], device: torch.device) -> int:
    """The smallest chunk size the backend serving a call on ``device`` takes: what a
    single-token decode step should ask for, since it pads least."""
    return KERNEL_CHUNK_SIZES[0] if resolve_backend(backend, device) == "pypto" else CHUNK_SIZES[0]
