"""The ``"pypto"`` backend: the PyPTO kernels, the default on Ascend NPUs.

On NPU tensors it runs on the device; on CPU tensors, when named, through PyPTO's verify
interpreter (a correctness check, slow). Where it cannot serve a call on an NPU (another
head dim, float64, chunk size 16, pypto missing, a kernel that fails to build) the default
warns once per reason and runs ``"torch"`` on the same device.
"""

from __future__ import annotations

import torch

from torch_gdr._fallback import PyptoBackendError, PyptoFallbackWarning
from torch_gdr.ops._backend import Backend, CallSpec, Capabilities, Reason
from torch_gdr.ops.pypto import spec
from torch_gdr.ops.pypto import _env
from torch_gdr.ops.pypto.decode import pypto_pool_step
from torch_gdr.ops.pypto.inplace import pypto_step_inplace
from torch_gdr.ops.pypto.op import pypto_bwd, pypto_fwd, pypto_step


@torch.compiler.assume_constant_result
def _pypto_installed() -> bool:
    return _env.is_pypto_available()


def _reasons(call: CallSpec) -> list[Reason]:
    if not _pypto_installed():
        return [Reason("pypto is not installed (pip install 'torch_gdr[npu]', which brings pypto==0.2.0)",
                       kind="missing")]
    reasons = []
    if call.entry == "pool_step" and call.tokens_per_sequence > spec.MAX_STEP_TOKENS:
        reasons.append(Reason(f"the PyPTO decode kernel takes at most {spec.MAX_STEP_TOKENS} tokens per sequence "
                              f"in a step (ssm_state_indices [N, S]), got S = {call.tokens_per_sequence}"))
    return reasons


BACKEND = Backend(
    name="pypto",
    capabilities=Capabilities(entries=frozenset({"chunk", "step", "pool_step"}), device_types=("cpu", "npu", "privateuseone"),
                              dtypes=spec.DTYPES, head_dims=spec.HEAD_DIMS, chunk_sizes=spec.CHUNK_SIZES,
                              pool_extras=frozenset()),  # its decode kernel: plain chains over packed rows
    forward_op=pypto_fwd,
    backward_op=pypto_bwd,
    keeps_chunk_states=True,
    step=pypto_step,
    pool_step=pypto_pool_step,
    step_inplace=pypto_step_inplace,  # its decode kernel on the caller's states as a pool
    may_fail=True,
    warns_when_unsupported=True,
    error=PyptoBackendError,
    warning=PyptoFallbackWarning,
    description="the PyPTO kernels: on Ascend NPUs, or on CPU tensors through PyPTO's interpreter",
    extra_reasons=_reasons,
    in_kernel_gating=frozenset({"step", "pool_step"}),  # the chunked kernels and the decode kernel
)
