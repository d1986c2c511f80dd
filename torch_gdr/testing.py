"""Inputs and error measures for checking the gated delta rule: one factory shared by the
tests, the benchmarks, ``python -m torch_gdr`` and the cost-model script."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

__all__ = ["make_inputs", "rmse_ratio"]


def make_inputs(
    batch_size: int = 1,
    seq_len: int = 64,
    num_qk_heads: int = 2,
    num_v_heads: int = 2,
    head_k_dim: int = 16,
    head_v_dim: int = 16,
    dtype: torch.dtype = torch.float64,
    seqlens: Optional[Sequence[int]] = None,
    with_initial_state: bool = False,
    gate: str = "logsigmoid",
    seed: int = 0,
    token_major: bool = False,
    normalize_qk: bool = False,
    initial_state_scale: float = 1.0,
    requires_grad: bool = False,
    device: Union[str, torch.device] = "cpu",
) -> dict[str, torch.Tensor]:
    """Realistic random inputs in fla's layout: ``beta = sigmoid(x)`` and, by ``gate``,
    ``g = logsigmoid(x)`` (``"logsigmoid"``, realistic), ``g ≈ -30`` (``"strong"``) or
    ``g = 0`` (``"zero"``).

    Args:
        seqlens: packed varlen lengths (then B = 1 and ``cu_seqlens`` int64 is returned).
        dtype: of q, k, v, g and beta; the initial state is float64 on the device (cast it).
        token_major: drop the batch dim (``[T, ...]``).
        normalize_qk: unit-norm q and k (as models feed them with the in-kernel norm off).
        initial_state_scale: multiplies the random initial state.
        requires_grad: make q, k, v, g, beta (and the initial state) leaves that require grad.
        device: made on the CPU from a seeded generator, then moved here.

    Returns:
        ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``, and
        ``cu_seqlens``/``initial_state`` when asked for.
    """
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        batch_size, seq_len = 1, sum(seqlens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    lead = (batch_size, seq_len)
    q, k = randn(*lead, num_qk_heads, head_k_dim), randn(*lead, num_qk_heads, head_k_dim)
    if normalize_qk:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = randn(*lead, num_v_heads, head_v_dim)
    raw = randn(*lead, num_v_heads)
    g = {"logsigmoid": F.logsigmoid(raw), "strong": -30.0 + 0.5 * raw, "zero": torch.zeros_like(raw)}[gate]
    beta = torch.sigmoid(randn(*lead, num_v_heads))
    out = dict(q=q, k=k, v=v, g=g, beta=beta)
    num_seqs = batch_size
    if seqlens is not None:
        offsets = [0]
        for n in seqlens:
            offsets.append(offsets[-1] + n)
        out["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int64)
        num_seqs = len(seqlens)
    if with_initial_state:
        out["initial_state"] = initial_state_scale * randn(num_seqs, num_v_heads, head_k_dim, head_v_dim)
    for name in ("q", "k", "v", "g", "beta"):
        out[name] = out[name].to(dtype)
        if token_major:
            out[name] = out[name].squeeze(0)
    out = {name: t.to(device) for name, t in out.items()}
    if requires_grad:
        for name, t in out.items():
            if t.is_floating_point():
                t.requires_grad_()
    return out


def rmse_ratio(reference: torch.Tensor, actual: torch.Tensor, floor: float = 1e-30) -> float:
    """``rms(reference - actual) / rms(reference)``, the error measure of fla's tests (the
    denominator floored at ``floor``)."""
    reference, actual = reference.double(), actual.double()
    return ((reference - actual).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt().clamp_min(floor)).item()
