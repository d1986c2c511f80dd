"""The inference cache of Gated DeltaNet layers: per layer, a conv state and a recurrent state."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterator, Optional, Union

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


#: What an entry of the cache is filed under: a layer's ``layer_idx``, or, for a layer built
#: without one, the layer's own identifier (a ``str``, see ``GatedDeltaNet.cache_key``).
#: Not the layer object: a copy of the cache (``copy.deepcopy``, pickle) must still find the
#: entry of the layer that filled it.
CacheKey = Union[int, str]


class GatedDeltaNetCache:
    """Decode cache of a stack of :class:`~torch_gdr.nn.GatedDeltaNet` layers, one entry per layer.

    Pass the same object to every layer's ``forward(..., cache=cache)``: the first call
    (the prompt, through the chunked op) fills each layer's entry, and every later call
    continues from it: a ``[N, 1, hidden]`` call is one decode step of each of the N
    sequences, with no re-run of the prompt. Entries are replaced, never written in place,
    so autograd flows through a whole decode.

    A layer built with ``layer_idx=i`` (as transformers numbers its layers) files its entry
    under ``i``; a layer built without one files it under an identifier of its own, drawn
    when it is built (a deep copy of the layer draws a new one), so two layers never share
    an entry by accident. An entry belongs to the first layer that filled it: another layer
    with the same key that reads or writes it gets a ``ValueError`` (two layers built with
    one index), not the other layer's state. The cache holds no reference to its layers.

    A copy of the cache (``copy.deepcopy`` or pickle: forking beams or a shared prefix)
    holds the same states under the same keys, so the layers continue from it as from the
    original. The copy forgets which layer owns which entry: the first layer to use an entry
    of the copy owns it.

    Example::

        cache = GatedDeltaNetCache()
        y = layer(prompt, cache=cache)             # [B, T, hidden], fills the cache
        for _ in range(n):
            y_t = layer(x_t, cache=cache)          # [B, 1, hidden], one token per sequence
    """

    def __init__(self) -> None:
        self.layers: dict[CacheKey, LayerState] = {}
        self._owners: dict[CacheKey, weakref.ref] = {}

    def __getstate__(self) -> dict:
        # Weak references do not pickle: a copy (deep copy or pickle) forgets its entries' owners.
        return {"layers": self.layers, "_owners": {}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @staticmethod
    def _key(key: Union[CacheKey, torch.nn.Module]) -> CacheKey:
        """A layer given as the key stands for its ``cache_key``."""
        return key.cache_key if isinstance(key, torch.nn.Module) else key

    def _check_owner(self, key: CacheKey, owner: Optional[torch.nn.Module]) -> None:
        if owner is None or key not in self._owners:
            return
        filled_by = self._owners[key]()
        if filled_by is not owner:
            other = "since deleted" if filled_by is None else f"{type(filled_by).__name__} at {hex(id(filled_by))}"
            if isinstance(key, int):
                raise ValueError(
                    f"layer_idx: entry {key} of this GatedDeltaNetCache was filled by another layer ({other}); "
                    "give every layer that shares a cache its own layer_idx (or none: then each layer has its "
                    "own entry)")
            raise ValueError(
                f"cache: entry {key!r} of this GatedDeltaNetCache was filled by another layer ({other}) with the "
                "same cache_key (a layer restored from one pickle twice?); give the layers distinct layer_idx")

    def get(self, key: Union[CacheKey, torch.nn.Module], owner: Optional[torch.nn.Module] = None) -> Optional[LayerState]:
        """The state filed under ``key`` (a layer's ``cache_key``, or the layer), or None
        before its first call. With ``owner`` (the layer asking), raise ``ValueError`` if
        another layer filled that entry."""
        key = self._key(key)
        self._check_owner(key, owner)
        return self.layers.get(key)

    def update(self, key: CacheKey, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
               num_new_tokens: int, owner: Optional[torch.nn.Module] = None) -> LayerState:
        """Replace the state filed under ``key`` after a call that saw ``num_new_tokens``
        tokens; ``owner`` (the layer writing) becomes the owner of an entry that has none."""
        key = self._key(key)
        self._check_owner(key, owner)
        previous = self.layers.get(key)
        seen = (previous.num_tokens if previous is not None else 0) + num_new_tokens
        state = LayerState(conv_state, recurrent_state, seen)
        self.layers[key] = state
        if owner is not None and key not in self._owners:
            self._owners[key] = weakref.ref(owner)
        return state

    def _keys(self) -> list[CacheKey]:
        """Index keys in increasing order, then the keys of layers without an index in the order
        they were filled."""
        return (sorted(k for k in self.layers if isinstance(k, int))
                + [k for k in self.layers if not isinstance(k, int)])

    def get_seq_length(self, key: Union[CacheKey, torch.nn.Module, None] = None) -> int:
        """Tokens seen per sequence by the layer filed under ``key`` (when None: the lowest
        ``layer_idx``, else the first layer filled); 0 when empty."""
        if not self.layers:
            return 0
        key = self._keys()[0] if key is None else self._key(key)
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
        """Forget every layer's state (and which layer filled which index)."""
        self.layers.clear()
        self._owners.clear()

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, key: object) -> bool:
        return (self._key(key) if isinstance(key, torch.nn.Module) else key) in self.layers

    def __iter__(self) -> Iterator[CacheKey]:
        return iter(self._keys())
