"""The ``"fla"`` backend: fla-core's Triton kernels on CUDA tensors, the default there.

fla-core is an optional extra (``pip install 'torch_gdr[gpu]'``): where it is not
installed the default on CUDA runs ``"torch"`` silently; where it is installed but broken
or of another version, and where it does not take a call, the default warns once per
reason. Whether fla imports is decided once per process, outside any traced graph, so that
``torch.compile`` never traces the loader.
"""

from __future__ import annotations

import importlib.util

import torch

from torch_gdr._fallback import FlaBackendError, FlaFallbackWarning
from torch_gdr.ops._backend import Backend, CallSpec, Capabilities, Reason
from torch_gdr.ops.fla import FLA_DEVICE_TYPES, FLA_DTYPES, FLA_MAX_HEAD_K_DIM, backward_refusal_reason, load_reason
from torch_gdr.ops.fla.op import fla_bwd, fla_fwd, fla_step


@torch.compiler.assume_constant_result
def _load_reason() -> str:
    return load_reason()


@torch.compiler.assume_constant_result
def _backward_refusal() -> str:
    return backward_refusal_reason() or ""


@torch.compiler.assume_constant_result
def _installed() -> bool:
    """Whether a package named fla is there at all (broken or not)."""
    try:
        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):  # a module in sys.modules without a spec
        return True


def _reasons(call: CallSpec) -> list[Reason]:
    if call.device.type not in BACKEND.capabilities.device_types:
        return []  # the capabilities say so; nothing to load
    reason = _load_reason()
    if reason:
        return [Reason(reason, kind="missing" if _installed() else "absent")]
    reasons = []
    if call.num_tokens == 0:
        reasons.append(Reason("the call has no tokens (T = 0)"))
    if call.entry == "chunk" and call.qk_dtype != call.v_dtype:
        reasons.append(Reason(f"fla's chunked kernels take one dtype for q, k and v, got q/k in {call.qk_dtype} "
                              f"and v in {call.v_dtype}"))
    if call.entry == "chunk" and call.head_k_dim > FLA_MAX_HEAD_K_DIM:
        reasons.append(Reason(f"fla's chunked kernels take head dims K <= {FLA_MAX_HEAD_K_DIM}, "
                              f"got K = {call.head_k_dim}"))
    if call.entry == "chunk" and call.needs_grad:
        refusal = _backward_refusal()
        if refusal:
            reasons.append(Reason(refusal))
    return reasons


BACKEND = Backend(
    name="fla",
    capabilities=Capabilities(entries=frozenset({"chunk", "step"}), device_types=FLA_DEVICE_TYPES,
                              dtypes=FLA_DTYPES, step_training=False),
    forward_op=fla_fwd,
    backward_op=fla_bwd,
    keeps_chunk_states=True,
    step=fla_step,
    # no step_inplace: fla-core's fused-recurrent forward has no in-place final state (vLLM's fork
    # of it has); dispatch copies its new state into the caller's (torch_gdr.dispatch.run)
    may_fail=True,
    warns_when_unsupported=True,
    error=FlaBackendError,
    warning=FlaFallbackWarning,
    description="fla-core's Triton kernels on CUDA tensors",
    extra_reasons=_reasons,
    in_kernel_gating=frozenset({"step"}),  # fla's fused-recurrent kernel; the chunked ops say it themselves
)
