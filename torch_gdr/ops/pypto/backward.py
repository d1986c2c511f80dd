"""Host side of the PyPTO backward: checks, the l2norm and GVA reductions, kernel launch.

:func:`pypto_chunk_gated_delta_rule_bwd` is the entry point (token-major, like
:func:`.forward.pypto_chunk_gated_delta_rule_fwd`). The kernel (:mod:`.kernel_bwd`) reads
q and k as the recurrence sees them; around it the host

* l2-normalises q and k when the call asks for it, and applies the l2norm backward
  ``dx = r (dy - y (y . dy))`` (``y = x r``) to the kernel's gradients;
* sums the kernel's per-value-head q/k gradients ``[T, HV, K]`` over each group of
  ``HV / H`` value heads sharing a q/k head (GVA), before the l2norm backward;
* converts fp16/bf16 inputs to fp32 for the kernel and the gradients back.

The per-chunk states ``[C, HV, K, V]`` (fp32, key-first, the state entering each chunk;
sequence n's chunk c at row ``chunk_offsets[n] + c``) come from the forward kernel; when
the caller has none, :func:`chunk_states_torch` computes them in pure torch.

Backward kernels have their own cache in :mod:`.kernel_cache` (:func:`get_gdr_bwd_kernel`,
:func:`bwd_cache_info`, keys with ``kind == "bwd"``), and every launch is counted
(:func:`launch_count`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from torch_gdr._gating import Gating, apply_gating
from torch_gdr._validate import read_cu_seqlens, check_inputs
from torch_gdr.ops.torch.utils import L2NORM_EPS, lower_mask, repeat_kv_heads

from . import interpreter
from .kernel import chunk_offsets
from .kernel_bwd import build_gdr_bwd_kernel, bwd_chunk_masks
from .kernel_cache import (BwdCacheInfo, BwdKernelKey, _count_launch, bwd_cache_clear, bwd_cache_info,  # noqa: F401
                           get_gdr_bwd_kernel, launch_count)
from .kernel_gating import gate_params
from .spec import CHUNK_SIZES

Tensor = torch.Tensor

#: ``kernel_getter(**config) -> kernel``; config holds the fields of :class:`BwdKernelKey`
#: but ``kind``.
KernelGetter = Callable[..., Any]

# Positions of the outputs among the plain kernel's tensor arguments (the gated kernel's:
# one further, gate_params coming after beta, and d_a_log after dbeta).
_OUTPUT_ARGS = (12, 13, 14, 15, 16, 17)
_GATED_OUTPUT_ARGS = (13, 14, 15, 16, 17, 18, 19)


# --------------------------------------------------------------------------- chunk states


def chunk_states_torch(
    k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, initial_state: Optional[Tensor],
    chunk_size: int,
) -> Tensor:
    """The state entering every chunk, in pure torch (float32).

    Args:
        k: ``[T, H, K]`` keys as the recurrence reads them (already l2-normalised if the
            call normalises); v ``[T, HV, V]``; g, beta ``[T, HV]``.
        cu_seqlens: ``[N + 1]`` offsets. initial_state: ``[N, HV, K, V]`` key-first or None.
        chunk_size: l.

    Returns:
        ``[C, HV, K, V]`` float32, key-first; sequence n's chunk c at row
        ``chunk_offsets(cu_seqlens, l)[n] + c``.
    """
    dtype, device = torch.float32, v.device
    num_v_heads, head_k_dim, head_v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    bounds = cu_seqlens.to("cpu", torch.int64).tolist()
    offsets = chunk_offsets(cu_seqlens.to("cpu"), chunk_size)
    out = torch.empty(int(offsets[-1]), num_v_heads, head_k_dim, head_v_dim, dtype=dtype, device=device)
    keys = repeat_kv_heads(k.to(dtype), num_v_heads).transpose(0, 1)  # [HV, T, K]
    values = v.to(dtype).transpose(0, 1)  # [HV, T, V]
    gates, betas = g.to(dtype).t(), beta.to(dtype).t()  # [HV, T]
    for n in range(len(bounds) - 1):
        state = (torch.zeros(num_v_heads, head_k_dim, head_v_dim, dtype=dtype, device=device)
                 if initial_state is None else initial_state[n].to(dtype))
        for c, start in enumerate(range(bounds[n], bounds[n + 1], chunk_size)):
            out[int(offsets[n]) + c] = state
            end = min(start + chunk_size, bounds[n + 1])
            kc, vc, bc = keys[:, start:end], values[:, start:end], betas[:, start:end, None]
            gamma = gates[:, start:end].cumsum(-1)
            rows = end - start
            lower = lower_mask(rows, device, dtype)
            decay = ((gamma[:, :, None] - gamma[:, None, :]) * lower).exp() * lower
            a = (bc * kc) @ kc.transpose(-1, -2) * decay * lower_mask(rows, device, dtype, strict=True)
            eye = torch.eye(rows, dtype=dtype, device=device).expand_as(a)
            t_inv = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
            u = t_inv @ (bc * vc)
            w = t_inv @ (bc * gamma[..., None].exp() * kc)
            v_new = u - w @ state
            gamma_last = gamma[:, -1:]
            k_out = (gamma_last - gamma).exp()[..., None] * kc
            state = gamma_last.exp()[..., None] * state + k_out.transpose(-1, -2) @ v_new
    return out


# --------------------------------------------------------------------------- host entry


def _l2norm_with_rnorm(x: Tensor) -> tuple[Tensor, Tensor]:
    rnorm = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    return x * rnorm, rnorm


def _augmented(grad_final_state: Optional[Tensor], num_seqs: int, num_v_heads: int, head_k_dim: int,
               head_v_dim: int, device: torch.device) -> Tensor:
    """``[N, HV, K + V, V]`` fp32: the final-state gradient (or zeros) over the identity."""
    aug = torch.zeros(num_seqs, num_v_heads, head_k_dim + head_v_dim, head_v_dim, device=device)
    if grad_final_state is not None:
        aug[:, :, :head_k_dim] = grad_final_state
    aug[:, :, head_k_dim:] = torch.eye(head_v_dim, device=device)
    return aug


def _check_bwd_args(grad_o: Tensor, grad_final_state: Optional[Tensor], v: Tensor, num_seqs: int,
                    head_k_dim: int, chunk_states: Optional[Tensor], num_chunks: int) -> None:
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    if list(grad_o.shape) != list(v.shape):
        raise ValueError(f"grad_o: expected shape [T, HV, V] = {list(v.shape)} (as v), got {list(grad_o.shape)}")
    state_shape = [num_seqs, num_v_heads, head_k_dim, head_v_dim]
    if grad_final_state is not None and list(grad_final_state.shape) != state_shape:
        raise ValueError(f"grad_final_state: expected shape [N, HV, K, V] = {state_shape}, "
                         f"got {list(grad_final_state.shape)}")
    if chunk_states is not None:
        expected = [num_chunks, num_v_heads, head_k_dim, head_v_dim]
        if list(chunk_states.shape) != expected:
            raise ValueError(f"chunk_states: expected shape [C, HV, K, V] = {expected} (C = sum of ceil(len_n / "
                             f"chunk_size)), got {list(chunk_states.shape)}")


def pypto_chunk_gated_delta_rule_bwd(
    grad_o: Tensor,
    grad_final_state: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    initial_state: Optional[Tensor],
    chunk_states: Optional[Tensor],
    *,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    chunk_size: int,
    kernel_getter: KernelGetter | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """Gradients of the chunked gated delta rule through the PyPTO backward kernel.

    Args:
        grad_o: ``[T, HV, V]``, the gradient on o.
        grad_final_state: ``[N, HV, K, V]`` key-first, or None (no gradient on the final state).
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g (raw log decay), beta: ``[T, HV]``; fp32,
            fp16 or bf16 (computed in fp32).
        cu_seqlens: ``[N + 1]`` integer offsets, ``cu_seqlens[-1] == T``.
        initial_state: ``[N, HV, K, V]`` key-first, or None (zeros; then no gradient).
        chunk_states: ``[C, HV, K, V]`` fp32 key-first, the state entering each chunk of
            length ``chunk_size`` (as the forward kernel returns them), or None to compute
            them here in pure torch.
        scale: the factor on q. use_qk_l2norm_in_kernel: the forward l2-normalised q and k.
        chunk_size: l, 32, 64 or 128, the chunk length of ``chunk_states``.
        kernel_getter: returns the kernel for a configuration; defaults to
            :func:`get_gdr_bwd_kernel`.

    Returns:
        ``(dq, dk, dv, dg, dbeta, d_initial_state)``, each in its input's shape and dtype;
        ``d_initial_state`` is None when ``initial_state`` is None.
    """
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, state_v_first=False)
    if q.dim() != 3:
        raise ValueError(f"q: expected the token-major shape [T, H, K], got {list(q.shape)}")
    if cu_seqlens is None:
        raise ValueError("cu_seqlens: expected [N + 1] offsets for token-major input, got None")
    read_cu_seqlens(cu_seqlens, q.shape[0])
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: the kernel has {list(CHUNK_SIZES)}, got {chunk_size}")
    return launch_backward(grad_o, grad_final_state, q, k, v, g, beta, cu_seqlens, initial_state, chunk_states,
                           scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size,
                           kernel_getter=kernel_getter)


def launch_backward(
    grad_o: Tensor,
    grad_final_state: Optional[Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    initial_state: Optional[Tensor],
    chunk_states: Optional[Tensor],
    *,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    chunk_size: int,
    kernel_getter: KernelGetter | None = None,
    gating: Gating | None = None,
) -> tuple[Optional[Tensor], ...]:
    """:func:`pypto_chunk_gated_delta_rule_bwd` on arguments its caller has checked (the op's).

    ``gating``: fla's activation arguments (checked, :mod:`torch_gdr._gating`); g and beta
    are raw where its flags say, the kernel applies the activations and their chain rule,
    and the result has two more entries, ``dA_log`` and ``ddt_bias`` ``[HV]`` in the
    dtypes of ``A_log`` and ``dt_bias`` (None where absent or without ``use_gate_in_kernel``):
    sums over tokens of the kernel's per-token terms, in torch."""
    gating = gating if gating is not None else Gating()
    gate = gating.use_gate_in_kernel
    device = q.device
    num_tokens, num_qk_heads, head_k_dim = q.shape
    num_v_heads, head_v_dim = v.shape[1], v.shape[2]
    num_seqs = cu_seqlens.numel() - 1
    first_chunks = chunk_offsets(cu_seqlens.to("cpu"), chunk_size)
    _check_bwd_args(grad_o, grad_final_state, v, num_seqs, head_k_dim, chunk_states, int(first_chunks[-1]))

    def fp32(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=torch.float32).contiguous()

    def d_initial_from(carry: Tensor) -> Optional[Tensor]:
        return None if initial_state is None else carry.to(initial_state.dtype)

    def head_grads(d_a_log: Optional[Tensor], d_a: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        """``(dA_log, ddt_bias)`` from the per-token terms ``[T, HV]``, where the call has them."""
        if not gating.gated:
            return ()
        if not gate or d_a_log is None or d_a is None:
            return None, None
        assert gating.A_log is not None
        d_dt_bias = None if gating.dt_bias is None else d_a.sum(0).to(gating.dt_bias.dtype)
        return d_a_log.sum(0).to(gating.A_log.dtype), d_dt_bias

    if num_tokens == 0:  # every sequence is empty: the state passes through unchanged
        zeros = tuple(torch.zeros_like(t) for t in (q, k, v, g, beta))
        carry = (torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, device=device)
                 if grad_final_state is None else grad_final_state)
        empty = torch.zeros(0, num_v_heads, device=device)
        return zeros + (d_initial_from(carry),) + head_grads(empty, empty)

    q32, k32 = fp32(q), fp32(k)
    if use_qk_l2norm_in_kernel:
        q32, q_rnorm = _l2norm_with_rnorm(q32)
        k32, k_rnorm = _l2norm_with_rnorm(k32)
    if chunk_states is None:  # (the activations in torch for this recomputation only)
        g_act, beta_act = apply_gating(g, beta, use_gate_in_kernel=gate, A_log=gating.A_log, dt_bias=gating.dt_bias,
                                       use_beta_sigmoid_in_kernel=gating.use_beta_sigmoid_in_kernel,
                                       allow_neg_eigval=gating.allow_neg_eigval)
        chunk_states = chunk_states_torch(k32, v, g_act, beta_act, cu_seqlens, initial_state, chunk_size)

    on_device = device.type == "npu"
    getter = kernel_getter if kernel_getter is not None else get_gdr_bwd_kernel
    kernel = getter(
        num_seqs=num_seqs,
        num_qk_heads=num_qk_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        chunk_size=chunk_size,
        scale=float(scale),
        on_device=on_device,
        gate_in_kernel=gate,
        beta_sigmoid_in_kernel=gating.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=gating.allow_neg_eigval,
    )
    per_v_head_k = (num_tokens, num_v_heads, head_k_dim)
    outputs = [
        torch.zeros(per_v_head_k, device=device),  # dq per value head
        torch.zeros(per_v_head_k, device=device),  # dk per value head
        torch.zeros(num_tokens, num_v_heads, head_v_dim, device=device),
        torch.zeros(num_tokens, num_v_heads, device=device),
        torch.zeros(num_tokens, num_v_heads, device=device),
        *([torch.zeros(num_tokens, num_v_heads, device=device)] if gate else []),  # dA_log's terms
        torch.zeros(num_seqs, num_v_heads, head_k_dim, head_v_dim, device=device),
    ]
    args = [
        q32.view(num_tokens, -1), k32.view(num_tokens, -1), fp32(v).view(num_tokens, -1), fp32(g), fp32(beta),
        *([gate_params(gating.A_log, gating.dt_bias, num_v_heads, device)] if gate else []),
        fp32(grad_o).view(num_tokens, -1),
        cu_seqlens.to(device=device, dtype=torch.int32).contiguous(),
        first_chunks.to(device=device, dtype=torch.int32),
        bwd_chunk_masks(chunk_size).to(device),
        torch.eye(head_k_dim, device=device),
        fp32(chunk_states),
        _augmented(grad_final_state, num_seqs, num_v_heads, head_k_dim, head_v_dim, device),
        *(t.view(num_tokens, -1) if t.dim() == 3 else t for t in outputs[:-1]), outputs[-1],
    ]
    interpreter.launch(kernel, args, list(_GATED_OUTPUT_ARGS if gate else _OUTPUT_ARGS))
    _count_launch()
    dq_heads, dk_heads, dv, dg, dbeta = outputs[:5]
    d_initial, d_a_log = outputs[-1], (outputs[5] if gate else None)

    group = num_v_heads // num_qk_heads
    dq = dq_heads.view(num_tokens, num_qk_heads, group, head_k_dim).sum(2)
    dk = dk_heads.view(num_tokens, num_qk_heads, group, head_k_dim).sum(2)
    if use_qk_l2norm_in_kernel:  # y = x r: dx = r (dy - y (y . dy))
        dq = (dq - q32 * (q32 * dq).sum(-1, keepdim=True)) * q_rnorm
        dk = (dk - k32 * (k32 * dk).sum(-1, keepdim=True)) * k_rnorm
    grads = tuple(grad.to(x.dtype) for grad, x in ((dq, q), (dk, k), (dv, v), (dg, g), (dbeta, beta)))
    return grads + (d_initial_from(d_initial),) + head_grads(d_a_log, dg)


# --------------------------------------------------------------------------- cost model


def build_bwd_for_cost_model(
    lens: list[int], *, heads: int, v_heads: int, head_k_dim: int, head_v_dim: int, chunk_size: int = 128,
    has_initial_state: bool = True, seed: int = 0, gating: bool = False, **kernel_options: Any,
) -> tuple[Any, list[Tensor]]:
    """A backward kernel in stock SIM run mode and its arguments, for pypto's cost model.

    Calling ``kernel(*args)`` (with PyPTO's output redirected, see
    :func:`._env.redirected_output`) compiles the kernel and writes
    ``CostModelSimulationOutput/_simulate.stat.report.txt``. The workload mirrors the
    forward's cost-model run: random inputs for packed sequences of ``lens`` with a
    gradient on the final state when ``has_initial_state`` (a training step that carries
    a state). The cycle count does not depend on the values. ``gating``: the kernel with
    all of fla's activations (raw gate with A_log and dt_bias, beta logits, allow_neg_eigval).

    ``kernel_options`` go to :func:`.kernel_bwd.build_gdr_bwd_kernel` (``vec_rows``,
    ``stitch_function_max_num``).
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_seqs = sum(lens), len(lens)
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    offsets = chunk_offsets(cu_seqlens.to("cpu"), chunk_size)
    state_shape = (num_seqs, v_heads, head_k_dim, head_v_dim)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    kernel = build_gdr_bwd_kernel(
        num_seqs=num_seqs, num_qk_heads=heads, num_v_heads=v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        chunk_size=chunk_size, scale=head_k_dim ** -0.5, gate_in_kernel=gating, beta_sigmoid_in_kernel=gating,
        allow_neg_eigval=gating, **kernel_options)
    gates = [torch.nn.functional.logsigmoid(randn(num_tokens, v_heads)), torch.sigmoid(randn(num_tokens, v_heads))]
    if gating:  # raw gate and beta logits, then gate_params [2, HV]
        gates = [randn(num_tokens, v_heads), randn(num_tokens, v_heads),
                 gate_params(torch.rand(v_heads, generator=gen).log(), randn(v_heads), v_heads, torch.device("cpu"))]
    args = [
        randn(num_tokens, heads * head_k_dim), randn(num_tokens, heads * head_k_dim),
        randn(num_tokens, v_heads * head_v_dim), *gates,
        randn(num_tokens, v_heads * head_v_dim),
        cu_seqlens, offsets.to(torch.int32), bwd_chunk_masks(chunk_size), torch.eye(head_k_dim),
        0.1 * randn(int(offsets[-1]), v_heads, head_k_dim, head_v_dim),
        _augmented(randn(*state_shape) if has_initial_state else None, num_seqs, v_heads, head_k_dim, head_v_dim,
                   torch.device("cpu")),
        torch.zeros(num_tokens, v_heads * head_k_dim), torch.zeros(num_tokens, v_heads * head_k_dim),
        torch.zeros(num_tokens, v_heads * head_v_dim), torch.zeros(num_tokens, v_heads),
        torch.zeros(num_tokens, v_heads), *([torch.zeros(num_tokens, v_heads)] if gating else []),
        torch.zeros(state_shape),
    ]
    return kernel, args
