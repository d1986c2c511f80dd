"""The backends of the public call and how one is chosen.

| name        | what runs                                                  |
| ----------- | ---------------------------------------------------------- |
| "torch"     | the op with the pure-torch chunked algorithm, any device   |
| "recurrent" | the per-token recurrence (the definition), any device      |

``backend=None`` takes ``TORCH_GDR_BACKEND`` when it is set, else the default for the
inputs' device.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from torch_gdr._layout import run_in_canonical_layout
from torch_gdr.ops.registration import _check_real
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


def _torch_op(*args):
    return torch.ops.gdr.chunked_gated_delta_rule(*args)


BACKENDS: dict[str, BackendFn] = {"torch": _torch_op, "recurrent": _recurrent}


def default_backend(device: torch.device) -> str:
    """The backend ``backend=None`` means on ``device`` when no environment variable is set."""
    return "torch"


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """Name the backend that serves a call; raise ``ValueError`` for an unknown name."""
    source = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV_VAR) or None
        source = BACKEND_ENV_VAR
    if backend is None:
        return default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"{source}: expected one of {sorted(BACKENDS)}, got {backend!r}")
    return backend


def get_backend(name: str) -> BackendFn:
    """The callable of a resolved backend; it takes the op's arguments in order and
    returns ``(o, final_state)``."""
    return BACKENDS[name]
