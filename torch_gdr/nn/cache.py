"""The inference cache of Gated DeltaNet layers: per layer, a conv state and a recurrent state."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
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
        owned: ``recurrent_state`` is a tensor of the cache's own (a layer's op made it, or a
            copy, reorder or unpickling did), which inference calls update in place; False
            for a state given by a caller or shared with a graph (:meth:`GatedDeltaNetCache.detach`),
            which the next call replaces instead.
    """

    conv_state: torch.Tensor
    recurrent_state: torch.Tensor
    num_tokens: int = 0
    owned: bool = field(default=False, compare=False)


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
    sequences, with no re-run of the prompt. In inference (autograd records nothing: no
    grad mode, or nothing requires grad) a layer updates its recurrent state in place, in
    the tensor the cache owns (no new state per step: ``inplace_final_state`` of the op), so
    ``cache.get(layer).recurrent_state`` changes with every call; ``.clone()`` it to keep a
    snapshot. Calls that autograd records replace the entry instead, so autograd flows
    through a whole decode.

    A layer built with ``layer_idx=i`` (as transformers numbers its layers) files its entry
    under ``i``; a layer built without one files it under an identifier of its own, drawn
    when it is built (a deep copy of the layer draws a new one), so two layers never share
    an entry by accident. An entry belongs to the first layer that filled it: another layer
    with the same key that reads or writes it gets a ``ValueError`` (two layers built with
    one index), not the other layer's state. The cache holds no reference to its layers.

    A copy of the cache (``copy.copy``, ``copy.deepcopy`` or pickle: forking beams or a
    shared prefix) holds copies of the states under the same keys, so the layers continue
    from it as from the original, and decoding one never changes the other. The copy
    forgets which layer owns which entry: the first layer to use an entry of the copy owns it.

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
        # unpickled or deep-copied: every state is a new tensor of this cache's own
        self.__dict__.update(state)
        for entry in self.layers.values():
            entry.owned = True

    def __copy__(self) -> "GatedDeltaNetCache":
        """A copy with states of its own (clones): decoding either never changes the other."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.layers = {key: LayerState(entry.conv_state.clone(), entry.recurrent_state.clone(), entry.num_tokens,
                                        owned=True)
                        for key, entry in self.layers.items()}
        clone._owners = {}
        return clone

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
               num_new_tokens: int, owner: Optional[torch.nn.Module] = None, *, owned: bool = False) -> LayerState:
        """Replace the state filed under ``key`` after a call that saw ``num_new_tokens``
        tokens; ``owner`` (the layer writing) becomes the owner of an entry that has none.
        ``owned``: ``recurrent_state`` is a new tensor no one else holds (an op's output, or
        the entry's own tensor updated in place), which later inference calls may write in
        place; a caller's tensor is never written."""
        key = self._key(key)
        self._check_owner(key, owner)
        previous = self.layers.get(key)
        seen = (previous.num_tokens if previous is not None else 0) + num_new_tokens
        state = LayerState(conv_state, recurrent_state, seen, owned=bool(owned))
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
            state.owned = True  # new tensors

    def detach(self) -> "GatedDeltaNetCache":
        """Cut the autograd history of every state (truncated backprop through time), in place.
        The detached states share their memory with the graph's, so the next call replaces
        them rather than writing into them."""
        for state in self.layers.values():
            state.conv_state = state.conv_state.detach()
            state.recurrent_state = state.recurrent_state.detach()
            state.owned = False
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
