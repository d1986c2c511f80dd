"""Gated DeltaNet token mixer (the linear-attention layer of Qwen3-Next) on torch_gdr's op."""

from __future__ import annotations

import copy
import functools
import uuid
from typing import Any, Optional, Union

import torch
from torch import nn

from torch_gdr import functional as _functional
from torch_gdr._inplace import inplace_problem
from torch_gdr._layout import compute_dtype_for
from torch_gdr.dispatch.registry import smallest_chunk_size
from torch_gdr.nn._checks import (check_attention_mask, check_backend, check_chunk_size, check_dtype,
                                  check_non_negative_int, check_positive_int)
from torch_gdr.nn.cache import CacheKey, GatedDeltaNetCache
from torch_gdr.nn.norm import GatedRMSNorm
from torch_gdr.nn.pool_cache import GatedDeltaNetPoolBatch, GatedDeltaNetPoolCache
from torch_gdr.nn.short_conv import ShortConvolution

# Like fla's layer: out of training, calls of at most this many tokens run token by token.
RECURRENT_MAX_LEN = 64


def _last_real_inputs(conv_initial: Optional[torch.Tensor], conv_input: torch.Tensor, mask: torch.Tensor,
                      history: int) -> torch.Tensor:
    """The conv state after a padded call: per row, the inputs at its last ``history`` real
    tokens, preceded by the row's previous state when it has fewer real tokens than that.
    With left padding (or none) these are the last ``history`` inputs, as the conv returns;
    with right padding or a padded decode token, the padding is skipped.

    Args:
        conv_initial: ``[B, C, history]``, the state the call started from, or None (zeros).
        conv_input: ``[B, T, C]``, the conv's inputs.
        mask: ``[B, T]``, nonzero at real tokens.
        history: ``K - 1`` of the conv.

    Returns:
        ``[B, C, history]`` in the dtype of ``conv_input``, oldest first.
    """
    batch, num_tokens, channels = conv_input.shape
    prefix = (conv_input.new_zeros(batch, history, channels) if conv_initial is None
              else conv_initial.to(conv_input.dtype).transpose(1, 2))
    full = torch.cat([prefix, conv_input], dim=1)  # [B, history + T, C]
    positions = torch.arange(history + num_tokens, device=conv_input.device)
    real = torch.cat([mask.new_ones(batch, history), mask], dim=1) != 0
    # The history largest positions of real tokens (the prefix counts as real, so there are enough).
    ranked = torch.where(real, positions, -1).topk(history, dim=1).values.flip(1)  # [B, history]
    picked = full.gather(1, ranked[..., None].expand(batch, history, channels))
    return picked.transpose(1, 2).contiguous()


class GatedDeltaNet(nn.Module):
    r"""The Gated DeltaNet token mixer: projections, short conv, gated delta rule, gated norm.

    Per token, with ``H`` query/key heads of size ``dk`` and ``HV`` value heads of size ``dv``
    (``HV % H == 0``; value head ``h`` reads q/k head ``h // (HV // H)``)::

        q, k, v, z = in_proj_qkvz(x)       b, a = in_proj_ba(x)
        q, k, v    = silu(causal_depthwise_conv1d([q, k, v]))
        o          = chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True,
                                            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                            use_beta_sigmoid_in_kernel=True)
        (the op computes g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b))
        y          = out_proj(GatedRMSNorm(o, gate=z))

    **Weights of transformers' ``Qwen3NextGatedDeltaNet`` load by name**
    (``layer.load_state_dict(hf_layer.state_dict())``; build the layer with
    :meth:`from_config` on the model's config). The mapping, name for name:

    ==================== ================================ ====================================
    parameter            shape                            meaning
    ==================== ================================ ====================================
    ``in_proj_qkvz``     ``[2*H*dk + 2*HV*dv, hidden]``   per q/k head group ``[q dk | k dk |
                                                          v r*dv | z r*dv]``, ``r = HV // H``
    ``in_proj_ba``       ``[2*HV, hidden]``               per q/k head group ``[b r | a r]``
    ``conv1d.weight``    ``[2*H*dk + HV*dv, 1, K]``       channels ``[q (H*dk) | k | v (HV*dv)]``
    ``dt_bias``          ``[HV]``                         added to ``a`` before the softplus
    ``A_log``            ``[HV]``                         ``log`` of the decay rate ``A > 0``
    ``norm.weight``      ``[dv]``                         gated RMSNorm scale, shared by heads
    ``out_proj``         ``[hidden, HV*dv]``              output projection
    ==================== ================================ ====================================

    Config fields (``from_config``): ``hidden_size``, ``linear_num_key_heads`` (H),
    ``linear_num_value_heads`` (HV), ``linear_key_head_dim`` (dk), ``linear_value_head_dim``
    (dv), ``linear_conv_kernel_dim`` (K), ``rms_norm_eps``. Initialisation follows the
    Qwen3-Next module: default ``nn.Linear``/``nn.Conv1d`` init, ``dt_bias = 1``,
    ``A = U(0.01, 16)``, norm weight 1.

    Args:
        hidden_size: model width.
        num_heads: H, query/key heads.
        num_v_heads: HV, value heads (H when None).
        head_k_dim: dk.
        head_v_dim: dv.
        conv_kernel_size: K of the short conv.
        norm_eps: eps of the gated RMSNorm.
        layer_idx: this layer's entry in a :class:`GatedDeltaNetCache` (transformers' numbering);
            None (the default): the entry is filed under an identifier of the layer's own
            (:attr:`cache_key`), so layers built without an index never share one. Two
            layers built with the same index that use one cache raise ``ValueError``.
        chunk_size: chunk size of the op for multi-token calls.
        backend: the op's backend (``"torch"``, ``"recurrent"``, ...; None: the op's default).
        decode_backend: backend of single-token decode steps (``backend`` when None).
        recurrent_max_len: out of training (``layer.eval()``), a call of at most this many
            tokens per sequence runs the token-by-token step
            (:func:`torch_gdr.fused_recurrent_gated_delta_rule`, same backend) instead of the
            chunked op, as fla's layer does: no chunk padding, a few ops a token. 0 turns it off.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_v_heads: Optional[int] = None, head_k_dim: int = 128,
                 head_v_dim: int = 128, conv_kernel_size: int = 4, norm_eps: float = 1e-6,
                 layer_idx: Optional[int] = None, *,
                 chunk_size: int = 64, backend: Optional[str] = None, decode_backend: Optional[str] = None,
                 recurrent_max_len: int = RECURRENT_MAX_LEN, device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for argument, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_v_heads", num_v_heads),
                                ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim),
                                ("conv_kernel_size", conv_kernel_size)):
            check_positive_int(argument, value)
        if num_v_heads % num_heads != 0:
            raise ValueError(f"num_v_heads: expected a multiple of num_heads ({num_heads}), got {num_v_heads}")
        if layer_idx is not None and (isinstance(layer_idx, bool) or not isinstance(layer_idx, int)):
            raise TypeError(f"layer_idx: expected None or an int >= 0, got {layer_idx!r} ({type(layer_idx).__name__})")
        if layer_idx is not None and layer_idx < 0:
            raise ValueError(f"layer_idx: expected None or an int >= 0, got {layer_idx}")
        check_chunk_size("chunk_size", chunk_size)
        backend = check_backend("backend", backend)
        decode_backend = check_backend("decode_backend", decode_backend)
        check_non_negative_int("recurrent_max_len", recurrent_max_len)
        check_dtype("dtype", dtype)
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_k_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.key_dim = num_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.layer_idx = layer_idx
        self._cache_uid = self._new_cache_uid()
        self.chunk_size = chunk_size
        self.backend = backend
        self.decode_backend = decode_backend
        self.recurrent_max_len = recurrent_max_len

        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False, **factory)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **factory)
        self.conv1d = ShortConvolution(self.conv_dim, conv_kernel_size, bias=False, activation="silu", **factory)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads, **factory))
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **factory).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps, **factory)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)

    @classmethod
    def from_config(cls, config: Any, layer_idx: Optional[int] = None, **kwargs: Any) -> "GatedDeltaNet":
        """Build the layer from a Qwen3-Next-style config (any object with the fields listed in
        the class docstring, e.g. ``transformers.Qwen3NextConfig``); ``kwargs`` go to ``__init__``."""
        return cls(
            hidden_size=config.hidden_size,
            num_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            head_k_dim=config.linear_key_head_dim,
            head_v_dim=config.linear_value_head_dim,
            conv_kernel_size=config.linear_conv_kernel_dim,
            norm_eps=config.rms_norm_eps,
            layer_idx=layer_idx,
            **kwargs,
        )

    @staticmethod
    def _new_cache_uid() -> str:
        return f"GatedDeltaNet-{uuid.uuid4().hex}"

    @property
    def cache_key(self) -> CacheKey:
        """What this layer's entry in a :class:`GatedDeltaNetCache` is filed under: ``layer_idx``,
        or, when it has none, an identifier drawn when the layer was built (a ``str``). Not the
        layer object, so that a deep copy or a pickle of the cache still finds the entry."""
        return self._cache_uid if self.layer_idx is None else self.layer_idx

    def __deepcopy__(self, memo: dict) -> "GatedDeltaNet":
        """A deep copy of the layer is another layer (``nn.ModuleList`` of copies, as stacks are
        often built): it draws its own cache identifier, so the copies sharing a cache keep
        their own entries. (Pickling keeps the identifier: a saved model and its saved cache
        still match.)"""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__(copy.deepcopy(self.__dict__, memo))
        clone.__dict__["_cache_uid"] = self._new_cache_uid()
        return clone

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, hidden]`` -> conv input ``[B, T, conv_dim]`` (q | k | v), z ``[B, T, HV, dv]``,
        b, a ``[B, T, HV]``, undoing the per-head-group interleaving of the fused projections."""
        batch, seq_len = x.shape[:2]
        ratio = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (self.num_k_heads, -1))
        q, k, v, z = qkvz.split([self.head_k_dim, self.head_k_dim, ratio * self.head_v_dim,
                                 ratio * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).unflatten(-1, (self.num_k_heads, -1)).split([ratio, ratio], dim=-1)
        mixed = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        z = z.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        return mixed, z, b.reshape(batch, seq_len, self.num_v_heads), a.reshape(batch, seq_len, self.num_v_heads)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None,
                cache: Union[GatedDeltaNetCache, GatedDeltaNetPoolCache, GatedDeltaNetPoolBatch, None] = None, *,
                cp_context: Optional[Any] = None) -> torch.Tensor:
        """Mix tokens.

        Args:
            hidden_states: ``[B, T, hidden]``, or ``[1, T, hidden]`` packed sequences with
                ``cu_seqlens``; float32, float16, bfloat16 or float64 (the parameters' dtype).
            attention_mask: ``[B, T]`` padding mask, 1 (or True) for real tokens and 0 for
                padding, or None. Padded tokens are zeroed before the projections and leave
                the recurrent state untouched (no decay, no write), and the cached conv state
                holds each row's last real inputs, so with left padding (as in generation) or
                right padding every real token's output and the cached states equal those of
                the unpadded sequence. (Padding between real tokens leaves the state right
                but feeds zeros to the conv of the tokens after it.) Outputs at padded
                positions are not meaningful. Any other value raises (checked in eager
                mode unless the mask is bool).
            cu_seqlens: ``[N + 1]`` int offsets of sequences packed along T (B must be 1):
                neither the conv nor the recurrence crosses a boundary.
            cache: a :class:`GatedDeltaNetCache`. The layer starts from its entry
                (:attr:`cache_key`) when there is one, else from zeros, and stores its states
                after the call: N = B (or the number of packed sequences) sequences.
                A call with T = 1 on a filled cache is a decode step. Or a
                :class:`~torch_gdr.nn.GatedDeltaNetPoolCache` (or one of its ``batch(...)``):
                row (or packed sequence) i belongs to its i-th request, whose states are
                read and updated in the cache's pools in place (inference only; no
                attention_mask, no cp_context).
            cp_context: a :class:`torch_gdr.distributed.CPContext` (context parallelism):
                hidden_states is this rank's slice ``[1, T_local, hidden]`` of a packed batch
                split over the context's group; the conv gets the earlier ranks' last inputs
                (a halo exchange) and the recurrence their state. No cache; ``cu_seqlens``
                None or the context's local offsets.

        Returns:
            ``[B, T, hidden]``, dtype of hidden_states.

        Raises:
            TypeError: hidden_states of another dtype than the parameters (outside autocast).
            ValueError: a shape that does not fit (B = 0 or T = 0 included), a mask value
                other than 0 and 1, a cache entry that holds another number of sequences or
                was filled by another layer with the same ``layer_idx``.
        """
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got {list(hidden_states.shape)}")
        expected_dtype = self.in_proj_qkvz.weight.dtype
        if hidden_states.dtype != expected_dtype and not torch.is_autocast_enabled(hidden_states.device.type):
            raise TypeError(f"hidden_states: expected dtype {expected_dtype} (the layer's parameters'), got "
                            f"{hidden_states.dtype}; cast the input, or the layer with layer.to(dtype)")
        batch, seq_len = hidden_states.shape[:2]
        if batch == 0 or seq_len == 0:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}] with B >= 1 and T >= 1, "
                             f"got {list(hidden_states.shape)}")
        if cu_seqlens is not None and batch != 1:
            raise ValueError(f"cu_seqlens: requires hidden_states of shape [1, T, hidden], got {list(hidden_states.shape)}")
        if isinstance(cache, (GatedDeltaNetPoolCache, GatedDeltaNetPoolBatch)):
            for name, value in (("attention_mask", attention_mask), ("cp_context", cp_context)):
                if value is not None:
                    raise ValueError(f"{name}: not supported with a GatedDeltaNetPoolCache (pack sequences of "
                                     "different lengths with cu_seqlens instead), got one")
            return cache._call_layer(self, hidden_states, cu_seqlens)
        mask = None
        if attention_mask is not None:
            if list(attention_mask.shape) != [batch, seq_len]:
                raise ValueError(f"attention_mask: expected shape [B, T] = {[batch, seq_len]}, "
                                 f"got {list(attention_mask.shape)}")
            check_attention_mask(attention_mask)
            mask = attention_mask.to(hidden_states.dtype)
            hidden_states = hidden_states * mask[..., None]

        previous = cache.get(self.cache_key, owner=self) if cache is not None else None
        if previous is not None:
            num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
            held = previous.recurrent_state.shape[0]
            if num_seqs != held:
                raise ValueError(f"cache: the cache holds {held} sequences and {num_seqs} were given "
                                 f"(hidden_states {list(hidden_states.shape)}"
                                 f"{'' if cu_seqlens is None else ' with cu_seqlens'}); pass a new cache for a "
                                 "new batch, or cache.reorder(index) to keep some of its sequences")
        mixed, z, b, a = self._project(hidden_states)
        conv_initial, op = (None if previous is None else previous.conv_state), _functional.chunk_gated_delta_rule
        if cp_context is not None:
            from torch_gdr.distributed.layer import context_parallel_layer_inputs
            conv_initial, cu_seqlens, cp_context = context_parallel_layer_inputs(cp_context, mixed,
                                                                                 self.conv_kernel_size, cu_seqlens,
                                                                                 cache)
            op = functools.partial(_functional.chunk_gated_delta_rule, cp_context=cp_context)
        conv_input = mixed
        mixed, conv_state = self.conv1d(mixed, initial_state=conv_initial,
                                        output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if conv_state is not None and mask is not None and cu_seqlens is None:
            # Padding anywhere (right padding, a padded decode token) must not enter the conv
            # window that the next call continues from.
            conv_state = _last_real_inputs(conv_initial, conv_input, mask, self.conv_kernel_size - 1)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))

        # The op applies the activations (fla's in-kernel gating, in float32 at least):
        # g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b). A padded token gets
        # a = b = -inf, whose activations are exactly 0 (no decay, no write) with zero
        # gradients, as multiplying the activated g and beta by the mask gave.
        if mask is not None:
            keep = mask[..., None] > 0
            a = a.masked_fill(~keep, float("-inf"))
            b = b.masked_fill(~keep, float("-inf"))
        gating = dict(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                      use_beta_sigmoid_in_kernel=True)

        is_step = previous is not None and seq_len == 1 and cu_seqlens is None
        backend = (self.decode_backend or self.backend) if is_step else self.backend
        initial_state = None if previous is None else previous.recurrent_state
        # inference on a state the cache owns: updated in place (no new state per step)
        inplace = (previous is not None and previous.owned and cp_context is None
                   and inplace_problem(initial_state, compute_dtype_for(v.dtype),
                                       (q, k, v, a, b, self.A_log, self.dt_bias)) is None)
        if cp_context is None and self._use_recurrent_step(seq_len, cu_seqlens, backend):
            o, recurrent_state = _functional.fused_recurrent_gated_delta_rule(
                q, k, v, a, b, initial_state=initial_state, output_final_state=cache is not None,
                use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, backend=backend, inplace_final_state=inplace,
                **gating)
        else:
            if inplace:
                op = functools.partial(op, inplace_final_state=True)
            o, recurrent_state = op(
                q, k, v, a, b, **gating,
                initial_state=initial_state,
                output_final_state=cache is not None,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu_seqlens,
                chunk_size=smallest_chunk_size(backend, hidden_states.device) if is_step else self.chunk_size,
                backend=backend,
            )

        if cache is not None:
            assert conv_state is not None and recurrent_state is not None
            # the op's new final state, or the cache's own one updated in place
            cache.update(self.cache_key, conv_state, recurrent_state, seq_len, owner=self, owned=True)

        o = self.norm(o, z)
        return self.out_proj(o.flatten(-2))

    def _use_recurrent_step(self, seq_len: int, cu_seqlens: Optional[torch.Tensor], backend: Optional[str]) -> bool:
        """Whether a call runs the token-by-token step (through the same backend): out of
        training, at most ``recurrent_max_len`` tokens per sequence (the packed total bounds it)."""
        return not self.training and 0 < seq_len <= self.recurrent_max_len

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_k_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, "
                f"conv_kernel_size={self.conv_kernel_size}, layer_idx={self.layer_idx}, backend={self.backend}")
