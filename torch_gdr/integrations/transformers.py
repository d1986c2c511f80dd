"""Run the gated delta rule of a transformers model with Gated DeltaNet layers on torch_gdr.

Patched: every module whose class is defined in transformers and named ``*GatedDeltaNet``
(in transformers 5.24: Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid, Qwen4-Exp, Lara-Mini).

    model = Qwen3NextForCausalLM.from_pretrained(...)
    model = use_torch_gdr(model)            # prefill and decode now call torch_gdr

Only the given model changes: the patch is made on its Gated DeltaNet *instances*, never
on a class or on a module of transformers, so other models in the process keep running
transformers' own kernels. Nothing of transformers is imported here (the model is
inspected duck-typed) and none of its code is copied: the layer's own ``forward`` keeps
doing the projections, the conv and the cache bookkeeping; only its two gated delta rule
calls, the chunked one (prefill) and the recurrent one (single-token decode), are routed
to :func:`torch_gdr.chunk_gated_delta_rule`, decode steps in inference to
:func:`torch_gdr.fused_recurrent_gated_delta_rule` writing the cache's state in place
(``inplace_decode``).

Two layouts of transformers are handled:

* the layer holds its kernels as instance attributes (``self.chunk_gated_delta_rule``,
  ``self.recurrent_gated_delta_rule``; transformers 4.57 and early 5.x): those
  attributes are replaced on the instance;
* the layer's ``forward`` calls module-level functions (``torch_chunk_gated_delta_rule``,
  ``torch_recurrent_gated_delta_rule``; later 5.x): the instance gets its own ``forward``,
  the same function objects (code, closures and decorators of transformers) rebuilt over
  a private copy of their globals in which those two names point at torch_gdr. The module
  of transformers is not modified.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch

from torch_gdr import functional as _functional
from torch_gdr._inplace import inplace_problem
from torch_gdr._layout import compute_dtype_for
from torch_gdr.dispatch.registry import smallest_chunk_size
from torch_gdr.nn._checks import check_backend, check_chunk_size

__all__ = ["use_torch_gdr", "remove_torch_gdr", "is_patched"]

_PATCH_ATTR = "_torch_gdr_patch"
_CHUNK_NAMES = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")
_RECURRENT_NAMES = ("torch_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                    "recurrent_gated_delta_rule")


def _make_kernels(backend: Optional[str], default_chunk_size: int,
                  inplace_decode: bool = True) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The two replacement kernels, with the calling convention of transformers/fla:
    ``(query, key, value, g=, beta=, initial_state=, output_final_state=,
    use_qk_l2norm_in_kernel=, cu_seqlens=, **ignored) -> (o, final_state | None)``.
    ``inplace_decode``: decode steps write the final state into ``initial_state`` (the
    cache's tensor) where it can take it, and return that tensor."""

    def call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: Optional[float], initial_state: Optional[torch.Tensor], output_final_state: bool,
             use_qk_l2norm_in_kernel: bool, cu_seqlens: Optional[torch.Tensor],
             size: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return _functional.chunk_gated_delta_rule(
            query, key, value, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens, chunk_size=size, backend=backend)

    def torch_gdr_chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                         g: torch.Tensor, beta: torch.Tensor, chunk_size: Optional[int] = None,
                                         initial_state: Optional[torch.Tensor] = None,
                                         output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                         cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                         **ignored: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Prefill / multi-token calls: the chunked op."""
        return call(query, key, value, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens, default_chunk_size if chunk_size is None else chunk_size)

    def torch_gdr_recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                             g: torch.Tensor, beta: torch.Tensor,
                                             initial_state: Optional[torch.Tensor] = None,
                                             output_final_state: bool = False,
                                             use_qk_l2norm_in_kernel: bool = False,
                                             cu_seqlens: Optional[torch.Tensor] = None,
                                             scale: Optional[float] = None,
                                             **ignored: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Decode steps (usually one token): in place into the cache's state where it can
        be written (:func:`_decodes_in_place`), else the op with the smallest chunk."""
        if inplace_decode and _decodes_in_place(query, key, value, g, beta, initial_state, output_final_state):
            return _functional.fused_recurrent_gated_delta_rule(
                query, key, value, g, beta=beta, scale=scale, initial_state=initial_state, output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, backend=backend,
                inplace_final_state=True)
        return call(query, key, value, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens, smallest_chunk_size(backend, query.device))

    return torch_gdr_chunk_gated_delta_rule, torch_gdr_recurrent_gated_delta_rule


def _decodes_in_place(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, initial_state: Optional[torch.Tensor], output_final_state: bool) -> bool:
    """Whether a decode step may write its final state into ``initial_state``: transformers'
    linear-attention cache passes its own state tensor and copies the returned one into it
    (a copy onto itself is free), so in inference (nothing recorded by autograd) with a
    writable state (:mod:`torch_gdr._inplace`) the step needs no new state."""
    if initial_state is None or not output_final_state or not isinstance(initial_state, torch.Tensor):
        return False
    wide = torch.float64 if torch.float64 in (query.dtype, value.dtype) else torch.float32
    return inplace_problem(initial_state, compute_dtype_for(wide), (query, key, value, g, beta)) is None


def _is_gated_deltanet(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("GatedDeltaNet")


def _rebuild(fn: Callable[..., Any], replacements: dict[str, Callable[..., Any]]) -> Callable[..., Any]:
    """``fn`` and every decorator around it (followed through ``__wrapped__``) as new function
    objects whose innermost function resolves ``replacements`` from a private globals copy."""
    inner = getattr(fn, "__wrapped__", None)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"cannot rebuild {fn!r}: not a Python function")
    if inner is None:
        namespace = dict(fn.__globals__)
        namespace.update(replacements)
        new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        new_inner = _rebuild(inner, replacements)
        cells = fn.__closure__ or ()
        if not any(cell.cell_contents is inner for cell in cells):
            raise TypeError(f"cannot rebuild {fn.__qualname__}: the function it wraps is not in its closure")
        closure = tuple(types.CellType(new_inner) if cell.cell_contents is inner else cell for cell in cells)
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(new, fn, updated=())
    if inner is not None:
        new.__wrapped__ = new_inner  # type: ignore[attr-defined]
    return new


def _innermost(fn: Callable[..., Any]) -> Callable[..., Any]:
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return fn


def _patch(module: torch.nn.Module, chunk: Callable[..., Any], recurrent: Callable[..., Any]) -> None:
    """Route one Gated DeltaNet instance's kernels to torch_gdr; record how, for :func:`remove_torch_gdr`."""
    saved: dict[str, Any] = {}
    instance_kernels = {name: fn for name, fn in (("chunk_gated_delta_rule", chunk),
                                                  ("recurrent_gated_delta_rule", recurrent))
                        if callable(getattr(module, name, None))}
    if instance_kernels:
        for name, fn in instance_kernels.items():
            saved[name] = module.__dict__.get(name, _MISSING)
            setattr(module, name, fn)
        setattr(module, _PATCH_ATTR, saved)
        return

    # The forward to rebuild: accelerate keeps the real one as ``_old_forward`` behind its hook.
    attr = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    bound = getattr(module, attr)
    function = getattr(bound, "__func__", bound)
    names = set(_innermost(function).__code__.co_names)
    replacements = {name: chunk for name in _CHUNK_NAMES if name in names}
    replacements.update({name: recurrent for name in _RECURRENT_NAMES if name in names})
    if not replacements:
        raise TypeError(
            f"{type(module).__qualname__}: found neither gated delta rule kernels on the instance nor a call to "
            f"one of {_CHUNK_NAMES + _RECURRENT_NAMES} in its forward; this transformers version is not supported")
    saved[attr] = module.__dict__.get(attr, _MISSING)
    setattr(module, attr, types.MethodType(_rebuild(function, replacements), module))
    setattr(module, _PATCH_ATTR, saved)


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def is_patched(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a Gated DeltaNet layer) runs on torch_gdr."""
    return hasattr(module, _PATCH_ATTR)


def use_torch_gdr(model: torch.nn.Module, *, backend: Optional[str] = None, chunk_size: int = 64,
                  inplace_decode: bool = True) -> torch.nn.Module:
    """Make a transformers model with Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) use torch_gdr.

    Every ``*GatedDeltaNet`` layer of transformers inside ``model`` routes its chunked
    (prefill) and recurrent (decode) gated delta rule calls to
    :func:`torch_gdr.chunk_gated_delta_rule`; everything else, cache handling included,
    stays transformers'. Calling it again re-patches with the new settings. Packed
    sequences (``cu_seq_lens_q`` from transformers) are passed on as ``cu_seqlens``.

    Args:
        model: e.g. a ``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM`` or
            ``OlmoHybridForCausalLM``, a bare model, or one layer.
        backend: the op's backend (None: the op's default for the device).
        chunk_size: the op's chunk size for multi-token calls.
        inplace_decode: single-token decode steps in inference write the new state into the
            state tensor transformers' cache passes (``inplace_final_state``, through
            :func:`torch_gdr.fused_recurrent_gated_delta_rule`), instead of returning a new
            one the cache then copies in: no new state per step, the same tokens and logits
            (up to rounding). Steps autograd records, or states that cannot be written (see
            :mod:`torch_gdr._inplace`), take the chunked op as with False. A state tensor
            taken out of the cache during ``generate`` changes with every step (deep-copy
            the cache to keep one, as transformers' prefix caching does).

    Returns:
        ``model`` itself, patched in place.

    Raises:
        ValueError: the model has no Gated DeltaNet layer of transformers, or ``backend`` or
            ``chunk_size`` is not one the op takes (``TypeError`` for one of the wrong type,
            or an ``inplace_decode`` that is not a bool).
        TypeError: ``model`` is not a ``torch.nn.Module``, or the layers are of a layout this
            function does not know.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model or layer), got "
                        f"{type(model).__name__}")
    backend = check_backend("backend", backend)
    check_chunk_size("chunk_size", chunk_size)
    if not isinstance(inplace_decode, bool):
        raise TypeError(f"inplace_decode: expected a bool, got {type(inplace_decode).__name__} {inplace_decode!r}")
    chunk, recurrent = _make_kernels(backend, chunk_size, inplace_decode)
    layers = [m for m in model.modules() if _is_gated_deltanet(m)]
    if not layers:
        raise ValueError(f"use_torch_gdr: {type(model).__name__} has no Gated DeltaNet layer of transformers")
    for layer in layers:
        if is_patched(layer):
            _unpatch(layer)
        _patch(layer, chunk, recurrent)
    return model


def _unpatch(module: torch.nn.Module) -> None:
    saved = getattr(module, _PATCH_ATTR)
    for name, value in saved.items():
        if value is _MISSING:
            delattr(module, name)
        else:
            setattr(module, name, value)
    delattr(module, _PATCH_ATTR)


def remove_torch_gdr(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`use_torch_gdr` on ``model``; returns the model."""
    for module in model.modules():
        if is_patched(module):
            _unpatch(module)
    return model
