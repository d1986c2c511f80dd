"""Host side of the PyPTO forward: layout checks, constant inputs, kernel launch.

On CPU tensors the kernel runs through PyPTO's verify interpreter (:mod:`.interpreter`);
on Ascend NPU tensors (``device.type == "npu"``) it is launched on the device. q, k and v
go to the kernel in their own dtype (fp32, fp16 or bf16); the kernel converts them to fp32,
and with half inputs in bodies of several value heads multiplies ``Q K^T`` and
``diag(beta) K K^T`` at the cube's half rate (operands rounded to the input dtype, fp32
accumulation; fla's bf16 error bounds). The state and every other product stay fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_gdr._gating import Gating
from torch_gdr._validate import check_inputs, read_cu_seqlens

from . import interpreter
from . import kernel as _kernel
from .kernel import augmented_state, chunk_masks, chunk_offsets, eye_pad, kernel_chunk_size, ticket_scratch, \
    ticket_width, time_windows
from .kernel_cache import get_gdr_kernel
from .kernel_gating import gate_params

#: ``kernel_getter(**config) -> kernel``; config holds the keyword arguments of
#: :func:`.kernel.build_gdr_kernel`.
KernelGetter = Callable[..., Any]

# Positions of the outputs among the plain kernel's tensor arguments (one further with
# gate_in_kernel: gate_params comes after beta).
_O_ARG, _STATE_OUT_ARG, _CHUNK_STATES_ARG = 11, 12, 13

_KERNEL_INPUT_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


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
    output_chunk_states: bool = False,
    kernel_getter: KernelGetter | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule forward through the PyPTO kernel.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``: fp32, fp16 or bf16 (one dtype), read by
            the kernel as they are. g (raw log decay), beta: ``[T, HV]``, any float dtype
            (converted to fp32 here).
        cu_seqlens: ``[N + 1]`` integer cumulative sequence offsets, ``cu_seqlens[-1] == T``.
        initial_state: ``[N, HV, K, V]`` key-first, or None for zeros.
        scale: factor on q. use_qk_l2norm_in_kernel: l2-normalise q and k first.
        chunk_size: the caller's chunk length, checked for validity only: the kernel runs
            with its own, ``kernel_chunk_size(K, V, max_seqlen, num_seqs=N, num_v_heads=HV)``.
        output_chunk_states: also return the state entering every kernel chunk.
        kernel_getter: returns the kernel for a configuration; defaults to the compiled
            kernel cache of :mod:`torch_gdr.ops.pypto.kernel_cache`.

    Returns:
        ``o [T, HV, V]`` fp32, the final state ``[N, HV, K, V]`` fp32 key-first, and
        ``chunk_states [C, HV, K, V]`` fp32 key-first (None unless asked for): row
        ``chunk_offsets(cu_seqlens, l)[n] + c`` is the state entering chunk c of sequence
        n, with ``l = kernel_chunk_size(K, V, max_seqlen, num_seqs=N, num_v_heads=HV)``
        (:func:`.kernel.kernel_chunk_size`).
    """
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first=False)
    if q.dim() != 3:
        raise ValueError(f"q: expected the token-major shape [T, H, K], got {list(q.shape)}")
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: expected [N + 1] offsets for token-major input, got None")
    if q.dtype not in _KERNEL_INPUT_DTYPES:
        raise TypeError(f"q, k, v: the kernel reads float32, float16 or bfloat16, got {q.dtype}")
    read_cu_seqlens(cu_seqlens, q.shape[0])
    return launch_forward(q, k, v, g, beta, cu_seqlens, initial_state, scale=scale,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output_chunk_states=output_chunk_states,
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
    output_chunk_states: bool = False,
    kernel_getter: KernelGetter | None = None,
    gating: Gating | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`pypto_chunk_gated_delta_rule_fwd` on arguments its caller has checked (the op's).

    ``gating``: fla's activation arguments (checked, :mod:`torch_gdr._gating`): g and beta
    are then raw where its flags say, and the kernel applies the activations."""
    gating = gating if gating is not None else Gating()
    device = q.device
    num_tokens, num_qk_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    num_seqs = cu_seqlens.numel() - 1
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    max_seqlen = int(lengths.max()) if num_seqs else 0
    kernel_chunk = kernel_chunk_size(head_k_dim, head_v_dim, max_seqlen, num_seqs=num_seqs,
                                     num_v_heads=num_v_heads)
    offsets = chunk_offsets(cu_seqlens.to(device), kernel_chunk)
    num_chunks = int(offsets[-1])

    o = torch.zeros(num_tokens, num_v_heads, head_v_dim, dtype=torch.float32, device=device)
    state_out = torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device)
    chunk_states = (torch.zeros(num_chunks, num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32, device=device)
                    if output_chunk_states else None)
    if num_tokens == 0:  # nothing to run: every sequence is empty
        if initial_state is not None:
            state_out.copy_(initial_state)
        return o, state_out, chunk_states

    has_initial_state = initial_state is not None
    on_device = device.type == "npu"
    if not on_device and device.type != "cpu":
        raise ValueError(f"the PyPTO backend runs on 'npu' or 'cpu' tensors, not {device.type!r}")
    getter = kernel_getter if kernel_getter is not None else get_gdr_kernel
    kernel = getter(
        num_seqs=num_seqs,
        num_qk_heads=num_qk_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        chunk_size=kernel_chunk,
        use_qk_l2norm=bool(use_qk_l2norm_in_kernel),
        scale=float(scale),
        has_initial_state=has_initial_state,
        on_device=on_device,
        input_dtype=_KERNEL_INPUT_DTYPES[q.dtype],
        output_chunk_states=bool(output_chunk_states),
        gate_in_kernel=gating.use_gate_in_kernel,
        beta_sigmoid_in_kernel=gating.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=gating.allow_neg_eigval,
    )

    def fp32(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32).contiguous()

    inputs = [
        q.reshape(num_tokens, -1).contiguous(), k.reshape(num_tokens, -1).contiguous(),
        v.reshape(num_tokens, -1).contiguous(), fp32(g), fp32(beta),
        *([gate_params(gating.A_log, gating.dt_bias, num_v_heads, device)] if gating.use_gate_in_kernel else []),
        cu_seqlens.to(device=device, dtype=torch.int32).contiguous(),
        offsets.to(dtype=torch.int32).contiguous(),
    ]
    constants = [chunk_masks(kernel_chunk).to(device), eye_pad(head_k_dim, head_v_dim).to(device)]
    chunk_states_arg = (chunk_states.view(-1, head_v_dim) if output_chunk_states
                        else torch.zeros(1, 1, device=device))
    shift = int(gating.use_gate_in_kernel)
    outputs = [_O_ARG + shift, _STATE_OUT_ARG + shift] + ([_CHUNK_STATES_ARG + shift] if output_chunk_states else [])
    # The state carried from window to window; an empty sequence keeps its initial state.
    if initial_state is not None:
        state_out.copy_(initial_state)
    windows = time_windows(cu_seqlens, kernel_chunk, _kernel.WINDOW_CHUNKS)
    ticket = ticket_scratch(num_seqs * num_v_heads, kernel_chunk, device, width=ticket_width(head_k_dim, head_v_dim))
    for window in windows:
        leaving = torch.zeros_like(state_out)
        args = [
            *inputs, window.to(device), *constants,
            augmented_state(state_out, num_seqs, num_v_heads, head_k_dim, head_v_dim, device),
            o.view(num_tokens, -1), leaving.view(-1, head_v_dim), chunk_states_arg, ticket,
        ]
        interpreter.launch(kernel, args, outputs)
        ran = (window[1:] > 0).to(device)
        state_out[ran] = leaving[ran]
    return o, state_out, chunk_states
