"""Host side of the PyPTO forward: layout checks, dtype conversion, kernel launch.

On CPU tensors the kernel runs through PyPTO's verify interpreter (:mod:`.interpreter`);
on Ascend NPU tensors (``device.type == "npu"``) it is launched on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_gdr._validate import check_inputs, read_cu_seqlens

from . import interpreter
from .kernel import chunk_masks
from .kernel_cache import get_gdr_kernel
from .spec import CHUNK_SIZES

#: ``kernel_getter(**config) -> kernel``; config holds the keyword arguments of
#: :func:`.kernel.build_gdr_kernel`.
KernelGetter = Callable[..., Any]

# Positions of the outputs among the kernel's tensor arguments.
_O_ARG, _STATE_OUT_ARG = 8, 9


def pypto_chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    chunk_size: int,
    kernel_getter: KernelGetter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule forward through the PyPTO kernel.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g (raw log decay), beta: ``[T, HV]``.
            fp32, fp16 or bf16 (converted to fp32 for the kernel).
        cu_seqlens: ``[N + 1]`` integer cumulative sequence offsets, ``cu_seqlens[-1] == T``.
        initial_state: ``[N, HV, K, V]`` key-first, or None for zeros.
        scale: factor on q. use_qk_l2norm_in_kernel: l2-normalise q and k first.
        chunk_size: l, one of 32, 64, 128.
        kernel_getter: returns the kernel for a configuration; defaults to the compiled
            kernel cache of :mod:`torch_gdr.ops.pypto.kernel_cache`.

    Returns:
        ``o [T, HV, V]`` fp32 and the final state ``[N, HV, K, V]`` fp32 key-first.
    """
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first=False)
    if q.dim() != 3:
        raise ValueError(f"q: expected the token-major shape [T, H, K], got {list(q.shape)}")
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: expected [N + 1] offsets for token-major input, got None")
    read_cu_seqlens(cu_seqlens, q.shape[0])
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: the kernel has {list(CHUNK_SIZES)}, got {chunk_size}")
    return launch_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale=scale,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                          kernel_getter=kernel_getter)


def launch_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    chunk_size: int,
    kernel_getter: KernelGetter | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pypto_chunk_gated_delta_rule_fwd` on arguments its caller has checked (the op's)."""
    device = q.device
    num_tokens, num_qk_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    num_seqs = cu_seqlens.numel() - 1

    def fp32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32).contiguous()

    o = torch.zeros(num_tokens, num_v_heads, head_v_dim, dtype=torch.float32, device=device)
    state_out = torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device)
    if num_tokens == 0:  # nothing to run: every sequence is empty
        if initial_state is not None:
            state_out.copy_(initial_state)
        return o, state_out

    has_initial_state = initial_state is not None
    state_in = fp32(initial_state) if has_initial_state else torch.zeros(1, 1, 1, 1, device=device)
    on_device = device.type == "npu"
    getter = kernel_getter if kernel_getter is not None else get_gdr_kernel
    kernel = getter(
        num_seqs=num_seqs,
        num_qk_heads=num_qk_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        chunk_size=chunk_size,
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
        scale=float(scale),
        has_initial_state=has_initial_state,
        on_device=on_device,
    )
    args = [
        fp32(q), fp32(k), fp32(v), fp32(g), fp32(beta),
        cu_seqlens.to(device=device, dtype=torch.int32).contiguous(),
        chunk_masks(chunk_size).to(device),
        state_in, o, state_out,
    ]
    if on_device:
        kernel(*args)  # run mode NPU: pypto launches on the current NPU stream
    else:
        if device.type != "cpu":
            raise ValueError(f"the PyPTO backend runs on 'npu' or 'cpu' tensors, not {device.type!r}")
        interpreter.run_kernel(kernel, args, [_O_ARG, _STATE_OUT_ARG])
    return o, state_out
