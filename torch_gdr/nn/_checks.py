"""Checks of the settings that the layer and the transformers patch take when they are built,
so that a bad ``backend`` or ``chunk_size`` fails there, not at the first forward.

The backend and chunk-size rules are the op's own (``torch_gdr.dispatch.BACKENDS``,
``torch_gdr._validate.CHUNK_SIZES``); these are the only two places that read them.
"""

from __future__ import annotations

from typing import Optional

import torch


def check_positive_int(argument: str, value: object) -> int:
    """``value`` as an int >= 1; ``TypeError`` for a non-int (a bool included), ``ValueError`` below 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument}: expected a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{argument}: expected a positive int, got {value}")
    return value


def check_non_negative_int(argument: str, value: object) -> int:
    """``value`` as an int >= 0; ``TypeError`` for a non-int (a bool included), ``ValueError`` below 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{argument}: expected an int >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{argument}: expected an int >= 0, got {value}")
    return value


def check_backend(argument: str, backend: object) -> Optional[str]:
    """``backend`` if it is None (the op's default), else the name of one of the op's backends
    it names, as the op reads it (without surrounding blanks, in lower case: ``" CPU "`` is
    ``"cpu"``)."""
    from torch_gdr.dispatch import BACKENDS
    from torch_gdr.dispatch.registry import backend_name

    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"{argument}: expected None or one of {sorted(BACKENDS)}, got {backend!r} "
                        f"({type(backend).__name__})")
    if backend_name(backend) not in BACKENDS:
        raise ValueError(f"{argument}: expected None or one of {sorted(BACKENDS)}, got {backend!r}")
    return backend_name(backend)


#: The parameter dtypes the layer takes (those of the op's inputs).
LAYER_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_dtype(argument: str, dtype: object) -> Optional[torch.dtype]:
    """``dtype`` if it is None (torch's default) or a dtype the layer's parameters may have
    (:data:`LAYER_DTYPES`); ``TypeError`` otherwise (an integer dtype, a string...)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in LAYER_DTYPES):
        return dtype
    names = ", ".join(str(d).replace("torch.", "") for d in LAYER_DTYPES)
    raise TypeError(f"{argument}: expected None or a floating torch.dtype ({names}), got {dtype!r}"
                    f"{'' if isinstance(dtype, torch.dtype) else f' ({type(dtype).__name__})'}")


def check_chunk_size(argument: str, chunk_size: object) -> int:
    """``chunk_size`` if it is an int the op takes (16, 32, 64 or 128)."""
    from torch_gdr._validate import CHUNK_SIZES

    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"{argument}: expected an int, one of {list(CHUNK_SIZES)}, got {chunk_size!r} "
                        f"({type(chunk_size).__name__})")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"{argument}: expected one of {list(CHUNK_SIZES)}, got {chunk_size}")
    return chunk_size


def check_attention_mask(attention_mask: torch.Tensor) -> None:
    """A padding mask holds 1 (or True) for real tokens and 0 for padding, nothing else: a
    fractional value would scale the token's input silently. Bool masks need no look at the
    values; the others are checked in eager mode (under ``torch.compile`` the check would be
    a data-dependent branch, so it is skipped there)."""
    if attention_mask.dtype == torch.bool:
        return
    if attention_mask.is_complex():
        raise TypeError(f"attention_mask: expected a bool, integer or float tensor of 0 and 1, "
                        f"got {attention_mask.dtype}")
    if torch.compiler.is_compiling():
        return
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        raise ValueError(f"attention_mask: expected 0 (padding) and 1 (real tokens) only, got the value "
                         f"{attention_mask[bad][0].item()!r}; pass a bool mask")
