"""The short depthwise causal convolution of a Gated DeltaNet layer, with a carried state.

The conv state of a sequence is the ``K - 1`` inputs that precede its next token,
``[N, C, K - 1]``, oldest first (zeros before the first token). Passing a sequence's final
state as the initial state of its continuation gives the same outputs as one long call,
which is what the decode cache relies on.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}


def _packed_conv(x: torch.Tensor, weight: torch.Tensor, initial_state: Optional[torch.Tensor],
                 cu_seqlens: torch.Tensor, output_final_state: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal depthwise conv of packed sequences ``x [T, C]``, ``weight [C, K]``: every tap
    reads a row of one table (the tokens, then each sequence's initial state, then a zero
    row), so no sequence ever reads another's tokens."""
    num_tokens, channels = x.shape
    kernel = weight.shape[-1]
    hist = kernel - 1
    device = x.device
    offsets = cu_seqlens.to(device=device, dtype=torch.int64)
    num_seqs = offsets.shape[0] - 1
    rows = [x]
    if initial_state is not None:
        rows.append(initial_state.to(x.dtype).transpose(1, 2).reshape(num_seqs * hist, channels))
    rows.append(x.new_zeros(1, channels))
    table = torch.cat(rows)
    zero_row = table.shape[0] - 1

    def source(seq: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        """Table row of position ``rel`` (relative to the sequence start) of sequence ``seq``."""
        inside = offsets[seq] + rel
        if initial_state is None:
            before = torch.full_like(inside, zero_row)
        else:
            before = num_tokens + seq * hist + (hist + rel).clamp(min=0)
            before = torch.where(rel >= -hist, before, zero_row)
        return torch.where(rel >= 0, inside, before)

    positions = torch.arange(num_tokens, device=device)
    seq = torch.bucketize(positions, offsets[1:], right=True).clamp(max=max(num_seqs - 1, 0))
    rel = positions - offsets[seq]
    taps = torch.arange(-hist, 1, device=device)  # tap i reads position rel + (i - hist)
    index = source(seq[:, None], rel[:, None] + taps[None, :])  # [T, K]
    y = torch.einsum("tkc,ck->tc", table[index], weight)

    final_state = None
    if output_final_state:
        lengths = offsets[1:] - offsets[:-1]
        seqs = torch.arange(num_seqs, device=device)
        last = lengths[:, None] + torch.arange(-hist, 0, device=device)[None, :]  # [N, K - 1]
        final_state = table[source(seqs[:, None], last)].transpose(1, 2)  # [N, C, K - 1]
    return y, final_state


def _batched_conv(x: torch.Tensor, weight: torch.Tensor, initial_state: Optional[torch.Tensor],
                  output_final_state: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal depthwise conv of ``x [B, T, C]``, ``weight [C, K]``, as ``K`` shifted
    multiply-adds along T in the token-major layout: ``y`` is a contiguous ``[B, T, C]``.

    Not ``F.conv1d``: that wants channel-first ``[B, C, T]``, and under ``torch.compile`` a
    convolution turns on inductor's CPU layout optimisation, which gives the 4-d tensors
    around it (the layer's ``[B, T, H, K]`` q, k, v, z) "channels-last" strides
    ``(H*K*T, 1, K*T, T)``. With a dynamic T inductor cannot order stride 1 against T
    (``cannot determine truth value of Relational: 1 < s0``) and the compile of a training
    step failed at the second sequence length. The shifted sum is also faster in eager mode.
    """
    batch, num_tokens, channels = x.shape
    hist = weight.shape[-1] - 1
    prefix = (x.new_zeros(batch, hist, channels) if initial_state is None
              else initial_state.to(x.dtype).transpose(1, 2))
    full = torch.cat([prefix, x], dim=1)  # [B, K - 1 + T, C]
    y = full[:, hist:] * weight[:, hist]
    for tap in range(hist):
        y = y.addcmul_(full[:, tap : tap + num_tokens], weight[:, tap])
    final_state = None
    if output_final_state:  # a copy: a view would keep the whole of ``full`` alive in a cache
        final_state = full[:, full.shape[1] - hist:].transpose(1, 2).contiguous()
    return y, final_state


def causal_depthwise_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Depthwise causal conv along T: ``y[t] = act(bias + sum_i weight[:, i] * x[t - K + 1 + i])``.

    Args:
        x: ``[B, T, C]``; with ``cu_seqlens``, ``[1, T, C]`` packed sequences.
        weight: ``[C, 1, K]`` (an ``nn.Conv1d(C, C, K, groups=C)`` weight) or ``[C, K]``.
        bias: ``[C]`` or None.
        activation: ``"silu"`` or None.
        initial_state: ``[N, C, K - 1]``: the inputs before each sequence's first token
            (N = B, or the number of packed sequences); zeros when None.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (B must be 1); taps never
            cross a sequence boundary.

    Returns:
        ``y`` in the shape and dtype of x, and the final state ``[N, C, K - 1]`` (dtype of
        x) or None.
    """
    if x.dim() != 3:
        raise ValueError(f"x: expected shape [B, T, C], got {list(x.shape)}")
    weight = weight.reshape(weight.shape[0], -1).to(x.dtype)
    channels, kernel = weight.shape
    hist = kernel - 1
    if x.shape[-1] != channels:
        raise ValueError(f"x: expected {channels} channels (the conv's), got shape {list(x.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation: expected one of {list(_ACTIVATIONS)}, got {activation!r}")
    num_states = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None and list(initial_state.shape) != [num_states, channels, hist]:
        raise ValueError(f"initial_state: expected shape [N, C, K - 1] = {[num_states, channels, hist]}, "
                         f"got {list(initial_state.shape)}")

    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens: requires x of shape [1, T, C], got {list(x.shape)}")
        y, final_state = _packed_conv(x[0], weight, initial_state, cu_seqlens, output_final_state)
        y = y.unsqueeze(0)
    else:
        y, final_state = _batched_conv(x, weight, initial_state, output_final_state)
    if bias is not None:
        y = y + bias.to(y.dtype)
    act = _ACTIVATIONS[activation]
    if act is not None:
        y = act(y)
    return y, final_state


class ShortConvolution(nn.Conv1d):
    """Depthwise causal conv over ``[B, T, C]`` inputs, with SiLU and a carried state.

    An ``nn.Conv1d(C, C, K, groups=C, padding=K - 1)``, so its parameters are those of
    the conv of Qwen3-Next / flash-linear-attention (``weight [C, 1, K]``, optional
    ``bias [C]``), but called on ``[B, T, C]`` and causal by construction.

    Args:
        channels: C.
        kernel_size: K (4 in Qwen3-Next).
        bias: whether the conv has a bias.
        activation: ``"silu"`` or None.
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False, activation: Optional[str] = "silu",
                 *, device=None, dtype=None) -> None:
        super().__init__(channels, channels, kernel_size, groups=channels, padding=kernel_size - 1, bias=bias,
                         device=device, dtype=dtype)
        self.activation = activation

    def forward(self, x: torch.Tensor, initial_state: Optional[torch.Tensor] = None,  # type: ignore[override]
                output_final_state: bool = False,
                cu_seqlens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """See :func:`causal_depthwise_conv1d`: ``x [B, T, C]`` -> ``(y [B, T, C], state [N, C, K - 1] | None)``."""
        return causal_depthwise_conv1d(x, self.weight, self.bias, self.activation, initial_state,
                                       output_final_state, cu_seqlens)
