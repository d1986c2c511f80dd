"""A pool-backed inference cache of Gated DeltaNet layers: every request's states live in a row.

Serving engines keep the states of all running requests in preallocated pools and pick rows
per call; :class:`GatedDeltaNetPoolCache` does that for a stack of
:class:`~torch_gdr.nn.GatedDeltaNet` layers, on the state-pool calls of
:func:`torch_gdr.chunk_gated_delta_rule` (prefill) and
:func:`torch_gdr.fused_recurrent_gated_delta_rule` (decode).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Mapping, Optional, Sequence, Union

import torch

from torch_gdr import functional as _functional
from torch_gdr._pool import POOL_DTYPES
from torch_gdr.nn.cache import CacheKey

RequestId = Hashable


@dataclass
class PoolLayerState:
    """The pools of one layer and where each request's states are in them.

    Attributes:
        recurrent_pool: ``[slots, HV, K_head, V_head]`` key-first, the cache's ``dtype`` (or
            the caller's tensor, any strides).
        conv_pool: ``[slots, conv_dim, K - 1]``, dtype of the activations: the last ``K - 1``
            conv inputs of each row, oldest first.
        rows: request -> the row holding its states in this layer's pools (absent before the
            request's first call through this layer: it starts from zeros).
        num_tokens: request -> tokens this layer has seen of it.
    """

    recurrent_pool: torch.Tensor
    conv_pool: torch.Tensor
    rows: dict[RequestId, int] = field(default_factory=dict)
    num_tokens: dict[RequestId, int] = field(default_factory=dict)


class GatedDeltaNetPoolCache:
    """Inference cache of a stack of :class:`~torch_gdr.nn.GatedDeltaNet` layers over state pools.

    Each layer lazily allocates, on its first call, a recurrent pool ``[slots, HV, K, V]``
    (float32) and a conv-state pool ``[slots, conv_dim, K - 1]`` (the activations' dtype);
    they are never reallocated: every later call reads and writes rows in place, as serving
    engines' pools are. Requests get rows with :meth:`allocate` and give them back with
    :meth:`free`; the cache keeps which row holds which request's states.

    A call covers the requests of :meth:`batch` (or the cache's current order, set by
    :meth:`reorder`): row ``i`` of ``hidden_states [B, T, hidden]``, or packed sequence
    ``i`` of ``[1, T, hidden]`` with ``cu_seqlens``, belongs to ``request_ids[i]``. A request
    that has tokens in the layer's pools continues from them; a new one starts from zeros.
    Calls in which every request has one token and a state run the pool decode step; the
    others (prompts, mixed batches) the chunked call over the pool.

    :meth:`fork` makes a request that shares its source's rows (beam search, a shared
    prefix) without copying them: the first call that writes one of the sharers gives it a
    fresh row (the call reads the shared row and writes the new one), so the other keeps its
    states. Two sharers written in one call need a free row each while the stack's later
    layers still read the shared one (one spare slot).

    ``copy.deepcopy`` or pickle of the cache copies its pools and row table. Inference
    only: a call with grad enabled raises (pools are updated in place).

    Example::

        cache = GatedDeltaNetPoolCache(slots=64)
        cache.allocate(["a", "b"])
        with torch.no_grad():
            y = layer(prompts, cache=cache.batch(["a", "b"]))      # [2, T, hidden]
            cache.fork("a", "a2")                                 # a beam
            y = layer(step, cache=cache.batch(["a", "a2", "b"]))  # [3, 1, hidden]
        cache.free("b")

    Args:
        slots: the most requests whose states the cache holds at once (rows of every pool).
        dtype: the dtype of the recurrent pools the cache allocates (one of
            :data:`torch_gdr._pool.POOL_DTYPES`); states are computed in float32 and rounded
            to it when stored.
        recurrent_pools: the caller's recurrent pools, by the layers' ``cache_key``
            (``layer_idx``): a tensor ``[slots, HV, K, V]`` of any strides (a view of the
            engine's own cache allocation) and any pool dtype, used in place of an allocated
            one (checked at the layer's first call; its rows are treated as zeros until
            written). Layers not named get an allocated pool.
    """

    def __init__(self, slots: int, *, dtype: torch.dtype = torch.float32,
                 recurrent_pools: Optional[Mapping[CacheKey, torch.Tensor]] = None) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected a positive int (rows of every pool), got {slots!r}")
        if dtype not in POOL_DTYPES:
            raise TypeError(f"dtype: expected one of {', '.join(str(d) for d in POOL_DTYPES)} (the recurrent "
                            f"pools' dtype), got {dtype!r}")
        given = dict(recurrent_pools or {})
        for key, pool in given.items():
            if not isinstance(pool, torch.Tensor):
                raise TypeError(f"recurrent_pools: expected a torch.Tensor for layer {key!r}, got "
                                f"{type(pool).__name__}")
            if pool.dtype not in POOL_DTYPES:
                raise TypeError(f"recurrent_pools: expected the pool of layer {key!r} of dtype "
                                f"{', '.join(str(d) for d in POOL_DTYPES)}, got {pool.dtype}")
            if pool.dim() != 4 or pool.shape[0] != slots:
                raise ValueError(f"recurrent_pools: expected the pool of layer {key!r} of shape [slots = {slots}, "
                                 f"HV, K, V], got {list(pool.shape)}")
        self.slots = slots
        self.dtype = dtype
        #: the caller's recurrent pools by layer key (taken at each layer's first call).
        self.given_pools: dict[CacheKey, torch.Tensor] = given
        self.layers: dict[CacheKey, PoolLayerState] = {}
        #: request -> the row its next write goes to (shared by forked requests until one writes).
        self.home_rows: dict[RequestId, int] = {}
        #: the requests a call with ``cache=self`` covers, in order (see :meth:`reorder`).
        self.request_ids: list[RequestId] = []

    # -- requests -------------------------------------------------------------------------

    def _used_rows(self) -> set[int]:
        """Rows some request's states are in or will be written to, in any layer."""
        used = set(self.home_rows.values())
        for state in self.layers.values():
            used.update(state.rows.values())
        return used

    def _free_rows(self, count: int, what: str) -> list[int]:
        used = self._used_rows()
        free = [row for row in range(self.slots) if row not in used][:count]
        if len(free) < count:
            raise ValueError(f"{what}: needs {count} free slot(s), but {self.slots - len(used)} of the cache's "
                             f"{self.slots} slots are free; free finished requests or build the cache with more slots")
        return free

    def _check_known(self, name: str, request_ids: Sequence[RequestId]) -> None:
        for request_id in request_ids:
            if request_id not in self.home_rows:
                raise ValueError(f"{name}: unknown request id {request_id!r} (allocate it first; known: "
                                 f"{list(self.home_rows)})")
        duplicates = [r for r, n in Counter(request_ids).items() if n > 1]
        if duplicates:
            raise ValueError(f"{name}: expected distinct request ids, got {duplicates!r} more than once")

    def allocate(self, request_ids: Iterable[RequestId]) -> torch.Tensor:
        """Give each new request a row; its states start from zeros.

        Returns:
            ``[len(request_ids)]`` int64, the rows (the same row in every layer's pools).

        Raises:
            TypeError: a ``str`` or ``bytes`` of ids (its characters would be taken as ids).
            ValueError: a request id already allocated or given twice, or fewer free slots
                than requests (nothing is allocated then).
        """
        if isinstance(request_ids, (str, bytes, bytearray)):
            raise TypeError(f"request_ids: expected an iterable of request ids (a list, e.g. [{request_ids!r}]), got a "
                            f"{type(request_ids).__name__}, {request_ids!r}, whose characters would be taken as ids")
        request_ids = list(request_ids)
        for request_id in request_ids:
            if request_id in self.home_rows:
                raise ValueError(f"request_ids: request id {request_id!r} is already allocated (free it first)")
        duplicates = [r for r, n in Counter(request_ids).items() if n > 1]
        if duplicates:
            raise ValueError(f"request_ids: expected distinct request ids, got {duplicates!r} more than once")
        rows = self._free_rows(len(request_ids), "request_ids")
        self.home_rows.update(zip(request_ids, rows))
        return torch.tensor(rows, dtype=torch.int64)

    def free(self, request_id: RequestId) -> None:
        """Forget a request; its rows become free once no other request shares them."""
        self._check_known("request_id", [request_id])
        del self.home_rows[request_id]
        for state in self.layers.values():
            state.rows.pop(request_id, None)
            state.num_tokens.pop(request_id, None)
        self.request_ids = [r for r in self.request_ids if r != request_id]

    def fork(self, src_request_id: RequestId, new_request_id: RequestId) -> None:
        """A new request that continues from ``src_request_id``'s states, sharing its rows until
        one of the two is written (copy-on-write). Counts as a request for :attr:`slots`."""
        self._check_known("src_request_id", [src_request_id])
        if new_request_id in self.home_rows:
            raise ValueError(f"new_request_id: request id {new_request_id!r} is already allocated (free it first)")
        if len(self.home_rows) >= self.slots:
            raise ValueError(f"new_request_id: the cache already holds {len(self.home_rows)} requests, its "
                             f"{self.slots} slots; free finished requests or build the cache with more slots")
        self.home_rows[new_request_id] = self.home_rows[src_request_id]
        for state in self.layers.values():
            if src_request_id in state.rows:
                state.rows[new_request_id] = state.rows[src_request_id]
                state.num_tokens[new_request_id] = state.num_tokens[src_request_id]

    def reorder(self, request_ids: Iterable[RequestId]) -> None:
        """Set the requests (and their order) that calls with ``cache=self`` cover."""
        request_ids = list(request_ids)
        self._check_known("request_ids", request_ids)
        self.request_ids = request_ids

    def batch(self, request_ids: Iterable[RequestId]) -> "GatedDeltaNetPoolBatch":
        """The cache restricted to ``request_ids`` (in that order), to pass as a layer's ``cache``."""
        request_ids = list(request_ids)
        self._check_known("request_ids", request_ids)
        return GatedDeltaNetPoolBatch(self, request_ids)

    def get_seq_length(self, request_id: RequestId, key: Optional[CacheKey] = None) -> int:
        """Tokens of ``request_id`` seen by the layer filed under ``key`` (None: the first layer filled)."""
        self._check_known("request_id", [request_id])
        if not self.layers:
            return 0
        state = self.layers[next(iter(self.layers)) if key is None else key]
        return state.num_tokens.get(request_id, 0)

    def __len__(self) -> int:
        return len(self.home_rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.home_rows

    # -- the layer's call -----------------------------------------------------------------

    def _call_layer(self, layer: Any, hidden_states: torch.Tensor,
                    cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        """A layer's call with ``cache=self``: over the requests of :meth:`reorder`."""
        return self._forward(layer, hidden_states, cu_seqlens, self.request_ids)

    def _layer_state(self, layer: Any, device: torch.device, conv_dtype: torch.dtype) -> PoolLayerState:
        """The layer's pools, allocated on its first call; ValueError if they do not fit it."""
        shape = (self.slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
        conv_shape = (self.slots, layer.conv_dim, layer.conv_kernel_size - 1)
        state = self.layers.get(layer.cache_key)
        if state is None:
            pool = self.given_pools.get(layer.cache_key)
            if pool is None:
                pool = torch.zeros(shape, dtype=self.dtype, device=device)
            elif tuple(pool.shape) != shape or pool.device != device:
                raise ValueError(f"recurrent_pools: the pool given for layer {layer.cache_key!r} "
                                 f"({list(pool.shape)} on {pool.device}) does not fit it ({list(shape)} on {device})")
            state = PoolLayerState(pool, torch.zeros(conv_shape, dtype=conv_dtype, device=device))
            self.layers[layer.cache_key] = state
        elif (tuple(state.recurrent_pool.shape) != shape or tuple(state.conv_pool.shape) != conv_shape
              or state.conv_pool.dtype != conv_dtype or state.recurrent_pool.device != device):
            raise ValueError(f"cache: the pools filed under {layer.cache_key!r} ({list(state.recurrent_pool.shape)}, "
                             f"conv {list(state.conv_pool.shape)} {state.conv_pool.dtype} on "
                             f"{state.recurrent_pool.device}) do not fit this layer ({list(shape)}, conv "
                             f"{list(conv_shape)} {conv_dtype} on {device}); two layers with one layer_idx?")
        return state

    def _write_rows(self, state: PoolLayerState, request_ids: Sequence[RequestId]) -> list[int]:
        """The row each request of a call writes in this layer: its home row, unless another
        request shares it (a fork) or this layer still reads it for another request; then a
        fresh row, which becomes the request's home row."""
        home_users = Counter(self.home_rows.values())
        readers: dict[int, set] = {}
        for request_id, row in state.rows.items():
            readers.setdefault(row, set()).add(request_id)
        writes = []
        for request_id in request_ids:
            row = self.home_rows[request_id]
            if home_users[row] > 1 or readers.get(row, set()) - {request_id}:
                home_users[row] -= 1
                row = self._free_rows(1, "request_ids")[0]
                self.home_rows[request_id] = row
                home_users[row] += 1
            writes.append(row)
        return writes

    def _forward(self, layer: Any, hidden_states: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                 request_ids: Sequence[RequestId]) -> torch.Tensor:
        """``layer``'s forward over the pools (called by ``GatedDeltaNet.forward``; shapes checked there).

        Args:
            hidden_states: ``[B, T, hidden]`` (B requests), or ``[1, T, hidden]`` packed with
                ``cu_seqlens [N + 1]`` (N requests).
            request_ids: the B (or N) requests, in order.

        Returns:
            ``[B, T, hidden]``, dtype of hidden_states.
        """
        if torch.is_grad_enabled():
            raise ValueError("cache: a GatedDeltaNetPoolCache is for inference (its pools are updated in place); "
                             "call the layer under torch.no_grad() or torch.inference_mode()")
        batch, seq_len = hidden_states.shape[:2]
        if cu_seqlens is None:
            num_seqs, seq_lens = batch, [seq_len] * batch
        else:
            offsets = [int(o) for o in cu_seqlens.tolist()]
            num_seqs, seq_lens = len(offsets) - 1, [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        if len(request_ids) != num_seqs:
            raise ValueError(f"request_ids: expected one request per sequence, {num_seqs} (hidden_states "
                             f"{list(hidden_states.shape)}{'' if cu_seqlens is None else ' with cu_seqlens'}), got "
                             f"{len(request_ids)}: {list(request_ids)!r}")
        self._check_known("request_ids", request_ids)
        device = hidden_states.device
        mixed, z, b, a = layer._project(hidden_states)
        state = self._layer_state(layer, device, mixed.dtype)
        reads = [state.rows.get(request_id, -1) for request_id in request_ids]
        writes = self._write_rows(state, request_ids)
        read_rows = torch.tensor(reads, dtype=torch.int64, device=device)
        write_rows = torch.tensor(writes, dtype=torch.int64, device=device)

        # A request's first call starts its conv window from zeros.
        started = (read_rows >= 0)[:, None, None]
        conv_initial = state.conv_pool.index_select(0, read_rows.clamp(min=0)) * started
        mixed, conv_final = layer.conv1d(mixed, initial_state=conv_initial, output_final_state=True,
                                         cu_seqlens=cu_seqlens)
        q, k, v = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        q = q.unflatten(-1, (layer.num_k_heads, layer.head_k_dim))
        k = k.unflatten(-1, (layer.num_k_heads, layer.head_k_dim))
        v = v.unflatten(-1, (layer.num_v_heads, layer.head_v_dim))
        gating = dict(use_gate_in_kernel=True, A_log=layer.A_log, dt_bias=layer.dt_bias,
                      use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        if all(n == 1 for n in seq_lens) and min(reads) >= 0:
            # Decode: read row ssm_state_indices[n, 1], write the state after the token to
            # ssm_state_indices[n, 0] (the same row unless a fork moves the request).
            o, _ = _functional.fused_recurrent_gated_delta_rule(
                q, k, v, a, b, initial_state=state.recurrent_pool,
                ssm_state_indices=torch.stack([write_rows, read_rows], dim=1),
                num_accepted_tokens=torch.full((num_seqs,), 2, dtype=torch.int64, device=device),
                backend=layer.decode_backend or layer.backend, **gating)
        else:
            o, _ = _functional.chunk_gated_delta_rule(
                q, k, v, a, b, initial_state=state.recurrent_pool, initial_state_indices=read_rows,
                final_state_indices=write_rows, chunk_size=layer.chunk_size, backend=layer.backend, **gating)
        state.conv_pool.index_copy_(0, write_rows, conv_final.to(state.conv_pool.dtype))
        for request_id, row, new_tokens in zip(request_ids, writes, seq_lens):
            state.rows[request_id] = row
            state.num_tokens[request_id] = state.num_tokens.get(request_id, 0) + new_tokens
        o = layer.norm(o, z)
        return layer.out_proj(o.flatten(-2))


@dataclass
class GatedDeltaNetPoolBatch:
    """:class:`GatedDeltaNetPoolCache` restricted to some requests, in order: pass it as a
    layer's ``cache`` (from :meth:`GatedDeltaNetPoolCache.batch`)."""

    cache: GatedDeltaNetPoolCache
    request_ids: list[RequestId]

    def _call_layer(self, layer: Any, hidden_states: torch.Tensor,
                    cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        return self.cache._forward(layer, hidden_states, cu_seqlens, self.request_ids)


PoolCacheLike = Union[GatedDeltaNetPoolCache, GatedDeltaNetPoolBatch]
