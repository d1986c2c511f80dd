"""Inputs and error measures shared by the tests."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


#: Device the inputs are made on: ``TORCH_GDR_TEST_DEVICE=cuda`` runs the suite on a GPU.
TEST_DEVICE = torch.device(os.environ.get("TORCH_GDR_TEST_DEVICE", "cpu"))


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
) -> dict:
    """Realistic random inputs in fla's layout (q, k l2-normalisable, ``beta = sigmoid``).

    ``gate``: ``"logsigmoid"`` (realistic), ``"strong"`` (g ≈ -30) or ``"zero"`` (no decay).
    ``seqlens``: packed varlen lengths (then B = 1 and ``cu_seqlens`` is returned).
    Tensors are made on the CPU from a seeded generator, then moved to ``TEST_DEVICE``.
    """
    gen = torch.Generator().manual_seed(seed)
    if seqlens is not None:
        batch_size, seq_len = 1, sum(seqlens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    lead = (batch_size, seq_len)
    q, k = randn(*lead, num_qk_heads, head_k_dim), randn(*lead, num_qk_heads, head_k_dim)
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
        out["initial_state"] = randn(num_seqs, num_v_heads, head_k_dim, head_v_dim)
    for name in ("q", "k", "v", "g", "beta"):
        out[name] = out[name].to(dtype)
        if token_major:
            out[name] = out[name].squeeze(0)
    return {name: t.to(TEST_DEVICE) for name, t in out.items()}


def rmse_ratio(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """``rms(reference - actual) / rms(reference)``, the error measure of fla's tests."""
    reference, actual = reference.double(), actual.double()
    return ((reference - actual).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def canonical(inputs: dict, *, scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
              chunk_size: int = 64, state_v_first: bool = False):
    """The :class:`torch_gdr._layout.GdrCall` of ``inputs`` (as :func:`make_inputs` gives them),
    what the raw functions of ``torch_gdr.ref`` take."""
    from torch_gdr._layout import canonical_call

    return canonical_call(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale,
                          inputs.get("initial_state"), use_qk_l2norm_in_kernel, inputs.get("cu_seqlens"), chunk_size,
                          state_v_first)


def chunked_reference(inputs: dict, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` of the pure-torch chunked forward, called directly (no op)."""
    from torch_gdr.ref.chunk import chunk_gated_delta_rule_fwd

    call = canonical(inputs, **options)
    o, final_state, _ = chunk_gated_delta_rule_fwd(call)
    return call.public_outputs(o, final_state)
