"""The inference cache of Gated DeltaNet layers: per layer, a conv state and a recurrent state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch


@dataclass
class LayerState:
    """What one Gated DeltaNet layer carries from one call to the next.

    Attributes:
        conv_state: ``[N, conv_dim, K - 1]``, dtype of the activations: the last ``K - 1``
            inputs of the short conv (q, k, v channels before the conv), oldest first.
        recurrent_state: ``[N, HV, K_head, V_head]`` float32 (float64 for float64 models),
            key-first: the gated delta rule state.
        num_tokens: tokens seen per sequence so far (the longest, with packed sequences).
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor
    num_tokens: int = 0


class GatedDeltaNetCache:
    """Decode cache of a stack of :class:`~torch_gdr.nn.GatedDeltaNet` layers, keyed by ``layer_idx``.

    Pass the same object to every layer's ``forward(..., cache=cache)``: the first call
    (the prompt, through the chunked op) fills each layer's entry, and every later call
    continues from it: a ``[N, 1, hidden]`` call is one decode step of each of the N
    sequences, with no re-run of the prompt. Entries are replaced, never written in place,
    so autograd flows through a whole decode.

    Example::

        cache = GatedDeltaNetCache()
        y = layer(prompt, cache=cache)             # [B, T, hidden], fills the cache
        for _ in range(n):
            y_t = layer(x_t, cache=cache)          # [B, 1, hidden], one token per sequence
    """

    def __init__(self) -> None:
        self.layers: dict[int, LayerState] = {}

    def get(self, layer_idx: int) -> Optional[LayerState]:
        """The state of layer ``layer_idx``, or None before its first call."""
        return self.layers.get(layer_idx)

    def update(self, layer_idx: int, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
               num_new_tokens: int) -> LayerState:
        """Replace the state of layer ``layer_idx`` after a call that saw ``num_new_tokens`` tokens."""
        previous = self.layers.get(layer_idx)
        seen = (previous.num_tokens if previous is not None else 0) + num_new_tokens
        state = LayerState(conv_state, recurrent_state, seen)
        self.layers[layer_idx] = state
        return state

    def get_seq_length(self, layer_idx: Optional[int] = None) -> int:
        """Tokens seen per sequence by layer ``layer_idx`` (the first cached layer when None); 0 when empty."""
        if not self.layers:
            return 0
        key = min(self.layers) if layer_idx is None else layer_idx
        return self.layers[key].num_tokens if key in self.layers else 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep or permute sequences: every state becomes ``state[index]`` (beam search, dropping finished rows)."""
        for state in self.layers.values():
            state.conv_state = state.conv_state.index_select(0, index.to(state.conv_state.device))
            state.recurrent_state = state.recurrent_state.index_select(0, index.to(state.recurrent_state.device))

    def detach(self) -> "GatedDeltaNetCache":
        """Cut the autograd history of every state (truncated backprop through time), in place."""
        for state in self.layers.values():
            state.conv_state = state.conv_state.detach()
            state.recurrent_state = state.recurrent_state.detach()
        return self

    def reset(self) -> None:
        """Forget every layer's state."""
        self.layers.clear()

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer_idx: object) -> bool:
        return layer_idx in self.layers

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.layers))
