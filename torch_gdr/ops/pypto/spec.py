"""What the PyPTO kernels serve: head dims, chunk sizes, dtypes, devices. Every other module
reads these constants from here."""

from __future__ import annotations

from typing import Optional

import torch

from torch_gdr._device import is_npu_device

#: Head dims K and V the kernels are written and tested for.
HEAD_DIMS: tuple[int, ...] = (64, 128)
#: Chunk lengths the kernels offer, smallest first.
CHUNK_SIZES: tuple[int, ...] = (32, 64, 128)
#: Input dtypes the kernels take (they compute in float32).
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def unsupported_reason(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> Optional[str]:
    """Why the kernels cannot serve a call with these (checked) inputs, or None when they can."""
    from torch_gdr.ops.pypto._env import is_pypto_available

    device_type = q.device.type
    if device_type != "cpu" and not is_npu_device(device_type):
        return f"PyPTO runs on Ascend NPUs (and on the CPU through its interpreter), not on {device_type!r} tensors"
    if not is_pypto_available():
        return "pypto is not installed (pip install 'torch_gdr[npu]', which brings pypto==0.2.0)"
    if q.dtype not in DTYPES:
        return f"the kernel computes in float32 and takes float32/float16/bfloat16 inputs, got {q.dtype}"
    head_k_dim, head_v_dim = q.shape[-1], v.shape[-1]
    if head_k_dim not in HEAD_DIMS or head_v_dim not in HEAD_DIMS:
        return f"the kernel has head dims K, V in {list(HEAD_DIMS)}, got K = {head_k_dim}, V = {head_v_dim}"
    if chunk_size not in CHUNK_SIZES:
        return f"the kernel has chunk sizes {list(CHUNK_SIZES)}, got chunk_size = {chunk_size}"
    return None
