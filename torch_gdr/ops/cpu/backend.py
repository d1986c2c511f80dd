"""The ``"cpu"`` backend: the fused C++/OpenMP kernels on CPU tensors, the default there.

It takes float32, float16 and bfloat16 inputs with q, k and v of one dtype (computing in
float32); float64 calls, the reference's dtype, go to ``"torch"`` without a word. Where the
extension cannot be built or loaded (no compiler, a failed build, sources missing) every
call names that reason: a default call warns once and runs ``"torch"``, strict mode and a
named ``"cpu"`` raise. fla's gate and beta activations, and their gradients, are computed
inside its kernels (chunked forward and backward, step, pool step). Its pool step serves
trees, intermediate buffers, strided and fp8 pools in one pass (``pool_extras``). Its in-place step
(``inplace_final_state``) runs the pool kernel on the caller's state (:mod:`.inplace`).
"""

from __future__ import annotations

import torch

from torch_gdr._fallback import CpuBackendError, CpuFallbackWarning
from torch_gdr.ops._backend import Backend, CallSpec, Capabilities, Reason
from torch_gdr.ops.cpu import kernels
from torch_gdr.ops.cpu.inplace import cpu_step_inplace
from torch_gdr.ops.cpu.op import cpu_bwd, cpu_fwd, cpu_step
from torch_gdr.ops.cpu.pool import pool_recurrent_fwd, prepared_pool_step


@torch.compiler.assume_constant_result
def _unavailable_reason() -> str:
    """Why the extension is not loaded ("" when it is); builds it on first use. A constant
    to ``torch.compile``: decided once, outside any traced graph."""
    return kernels.unavailable_reason() or ""


def _missing(call: CallSpec) -> list[Reason]:
    if call.device.type != "cpu":
        return []
    reason = _unavailable_reason()
    return [Reason(f"the fused CPU kernels are unavailable: {reason}", kind="missing")] if reason else []


BACKEND = Backend(
    name="cpu",
    capabilities=Capabilities(entries=frozenset({"chunk", "step", "pool_step"}), device_types=("cpu",),
                              dtypes=kernels.KERNEL_DTYPES, same_dtype=True, step_training=False),
    forward_op=cpu_fwd,
    backward_op=cpu_bwd,
    keeps_chunk_states=True,
    step=cpu_step,
    pool_step=pool_recurrent_fwd,
    prepared_pool_step=prepared_pool_step,
    step_inplace=cpu_step_inplace,
    pool_extras=True,
    error=CpuBackendError,
    warning=CpuFallbackWarning,
    description="the fused C++/OpenMP kernels on CPU tensors",
    extra_reasons=_missing,
    in_kernel_gating=frozenset({"step", "pool_step"}),
)
