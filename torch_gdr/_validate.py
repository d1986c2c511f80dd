"""Argument checking shared by the public call, the op and every backend.

Shape, dtype and device checks need no tensor data, so they run everywhere, also
while ``torch.compile`` traces. The checks on the values of ``cu_seqlens`` read data
and run only where real tensors are at hand (the op's implementations).
"""

from __future__ import annotations

import numbers
import os
from typing import Optional, Sequence

import torch

CHUNK_SIZES: tuple[int, ...] = (16, 32, 64, 128)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _expect_shape(name: str, tensor: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    if list(tensor.shape) != list(expected):
        raise ValueError(
            f"{name}: expected shape {layout} = {list(expected)}, got {_shape(tensor)}"
        )


def _expect_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), got {tensor.dtype}"
        )


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    chunk_size: int,
    state_v_first: bool,
) -> None:
    """Check shapes, dtypes and devices of a call; raise ``ValueError``/``TypeError``.

    Accepted layouts: batched ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``,
    ``g, beta [B, T, HV]``; or token-major (TND) without the batch dim,
    ``q, k [T, H, K]``, ``v [T, HV, V]``, ``g, beta [T, HV]``.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise TypeError(f"initial_state: expected a torch.Tensor or None, got {type(initial_state).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _expect_float(name, t)
    if k.dtype != q.dtype:  # v may differ, as fla's kernels take it: o comes back in v's dtype
        raise TypeError(f"k: expected the dtype of q ({q.dtype}), got {k.dtype} (v may differ from q and k; "
                        f"q and k may not differ from each other)")

    if q.dim() not in (3, 4):
        raise ValueError(
            f"q: expected shape [B, T, H, K] or token-major [T, H, K], got {_shape(q)} ({q.dim()}-D)"
        )
    token_major = q.dim() == 3
    lead = list(q.shape[:-2])  # [B, T] or [T]
    lead_layout = "[T" if token_major else "[B, T"
    num_qk_heads, head_k_dim = q.shape[-2], q.shape[-1]
    _expect_shape("k", k, q.shape, f"{lead_layout}, H, K] (as q)")
    if v.dim() != q.dim() or list(v.shape[:-2]) != lead:
        raise ValueError(
            f"v: expected shape {lead_layout}, HV, V] with leading dims {lead} as q, got {_shape(v)}"
        )
    num_v_heads, head_v_dim = v.shape[-2], v.shape[-1]
    for name, tensor, size, what in (("q", q, num_qk_heads, "q/k heads H"), ("q", q, head_k_dim, "key dim K"),
                                     ("v", v, num_v_heads, "value heads HV"), ("v", v, head_v_dim, "value dim V")):
        if size == 0:
            raise ValueError(f"{name}: expected at least one {what}, got shape {_shape(tensor)}")
    if not token_major and q.shape[0] == 0:
        raise ValueError(f"q: expected a batch of at least one sequence (B >= 1), got shape {_shape(q)}")
    if num_v_heads % num_qk_heads != 0:
        raise ValueError(
            f"v: the number of value heads HV = {num_v_heads} must be a positive multiple of the "
            f"number of q/k heads H = {num_qk_heads} (q shape {_shape(q)}, v shape {_shape(v)})"
        )
    for name, t in (("g", g), ("beta", beta)):
        _expect_shape(name, t, lead + [num_v_heads], f"{lead_layout}, HV]")

    device = q.device
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {t.device}")

    check_scale(scale)
    check_chunk_size(chunk_size)

    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens: expected an integer torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in INDEX_DTYPES:
            raise TypeError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(
                f"cu_seqlens: expected shape [N + 1] with N >= 1 (offsets 0, ..., T), got {_shape(cu_seqlens)}"
            )
        if cu_seqlens.device.type != "cpu" and cu_seqlens.device != device:
            raise ValueError(
                f"cu_seqlens: expected a tensor on the CPU or on {device} (the device of q), got {cu_seqlens.device}"
            )
        if not token_major and q.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens: requires batch size B = 1 (sequences packed along T), got q of shape {_shape(q)}"
            )
        num_seqs = cu_seqlens.shape[0] - 1
    else:
        num_seqs = 1 if token_major else q.shape[0]

    if initial_state is not None:
        _expect_float("initial_state", initial_state)
        if state_v_first:
            expected, layout = [num_seqs, num_v_heads, head_v_dim, head_k_dim], "[N, HV, V, K] (state_v_first=True)"
        else:
            expected, layout = [num_seqs, num_v_heads, head_k_dim, head_v_dim], "[N, HV, K, V]"
        _expect_shape("initial_state", initial_state, expected, layout)


def check_scale(scale: object) -> None:
    """``scale``: None, a real number (Python or NumPy scalar, not a bool) or a 0-d floating
    tensor that needs no gradient (the op's schema reads it as a float, as it reads the
    others; a gradient for it would be lost)."""
    if scale is None:
        return
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or not scale.is_floating_point() or scale.requires_grad:
            raise TypeError(f"scale: expected a float or None (or a 0-d floating tensor without grad), got a tensor "
                            f"of shape {_shape(scale)}, dtype {scale.dtype}, requires_grad={scale.requires_grad}")
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__} {scale!r}")


def check_chunk_size(chunk_size: object) -> None:
    """``chunk_size``: an int (not a bool or a float) among :data:`CHUNK_SIZES`."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size: expected an int, one of {list(CHUNK_SIZES)}, got {type(chunk_size).__name__} "
                        f"{chunk_size!r}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {list(CHUNK_SIZES)}, got {chunk_size!r}")


def read_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[int, ...]:
    """The offsets of ``cu_seqlens [N + 1]`` on the host, checked: they start at 0, never
    decrease and end at T. This is a call's one read of ``cu_seqlens`` (a host sync on
    accelerators); call it only on real tensors."""
    offsets = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens: expected the first offset to be 0, got {offsets[0]}")
    for where, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        if end < start:
            raise ValueError(
                f"cu_seqlens: expected non-decreasing offsets, got {start} followed by {end} at index {where}"
            )
    if offsets[-1] != num_tokens:
        raise ValueError(
            f"cu_seqlens: expected the last offset to equal the number of tokens T = {num_tokens}, got {offsets[-1]}"
        )
    return tuple(offsets)


#: Set to 1 to have a call read metadata that lives on an accelerator (``cu_seqlens``,
#: ``chunk_indices``) to check it against its host copy: a host sync per call, which
#: ``cu_seqlens_cpu`` exists to avoid, so it is off by default. Metadata on the CPU is
#: always checked (reading it costs no sync).
VALIDATE_ENV_VAR = "TORCH_GDR_VALIDATE"


def _readable(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether the values of ``tensors`` may be read for a check: not while ``torch.compile``
    traces, and on an accelerator only with :data:`VALIDATE_ENV_VAR` set."""
    if torch.compiler.is_compiling():
        return False
    if all(t is None or t.device.type == "cpu" for t in tensors):
        return True
    return os.environ.get(VALIDATE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def _expect_index(name: str, tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected an integer torch.Tensor or None, got {type(tensor).__name__}")
    if tensor.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {tensor.dtype}")
    return tensor


def expected_chunk_indices(offsets: Sequence[int], chunk_size: int) -> list[list[int]]:
    """fla's ``chunk_indices`` of packed sequences: one ``[sequence, chunk within it]`` row per
    chunk of ``chunk_size`` tokens, sequences in order (empty sequences have none)."""
    rows = []
    for seq, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        rows.extend([seq, chunk] for chunk in range(-(-(end - start) // chunk_size)))
    return rows


def resolve_varlen_metadata(cu_seqlens: Optional[torch.Tensor], cu_seqlens_cpu: Optional[torch.Tensor],
                            chunk_indices: Optional[torch.Tensor], chunk_size: int,
                            device: torch.device) -> Optional[torch.Tensor]:
    """Check fla's precomputed varlen metadata and return the offsets tensor the call reads.

    ``cu_seqlens_cpu [N + 1]`` (CPU, int32/int64): the host copy of ``cu_seqlens``; the call
    reads it instead of ``cu_seqlens`` (no host sync) and so it is returned. ``chunk_indices
    [num_chunks, 2]`` (int32/int64, on the CPU or ``device``): fla's per-chunk ``[sequence,
    chunk]`` rows for ``chunk_size``; accepted for compatibility and otherwise unused (the
    backends chunk by themselves). Both need ``cu_seqlens``; their values are compared with it
    where :func:`_readable` allows. ``cu_seqlens`` itself is checked by :func:`check_inputs`.
    """
    if cu_seqlens is None:
        for name, tensor in (("cu_seqlens_cpu", cu_seqlens_cpu), ("chunk_indices", chunk_indices)):
            if tensor is not None:
                raise ValueError(f"{name}: describes packed sequences and needs cu_seqlens, got cu_seqlens=None")
        return None
    reads = cu_seqlens
    if cu_seqlens_cpu is not None:
        _expect_index("cu_seqlens_cpu", cu_seqlens_cpu)
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu: expected a CPU tensor (the host copy of cu_seqlens), got one on "
                             f"{cu_seqlens_cpu.device}")
        if list(cu_seqlens_cpu.shape) != list(cu_seqlens.shape):
            raise ValueError(f"cu_seqlens_cpu: expected the shape of cu_seqlens {_shape(cu_seqlens)}, got "
                             f"{_shape(cu_seqlens_cpu)}")
        if _readable(cu_seqlens) and not torch.equal(cu_seqlens.detach().cpu().long(), cu_seqlens_cpu.long()):
            raise ValueError(f"cu_seqlens_cpu: expected the values of cu_seqlens {cu_seqlens.tolist()}, got "
                             f"{cu_seqlens_cpu.tolist()}")
        reads = cu_seqlens_cpu
    if chunk_indices is not None:
        _expect_index("chunk_indices", chunk_indices)
        if chunk_indices.device.type != "cpu" and chunk_indices.device != device:
            raise ValueError(f"chunk_indices: expected a tensor on the CPU or on {device} (the device of q), got "
                             f"{chunk_indices.device}")
        if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
            raise ValueError(f"chunk_indices: expected shape [num_chunks, 2] (fla's [sequence, chunk] rows), got "
                             f"{_shape(chunk_indices)}")
        if _readable(reads, chunk_indices):
            offsets = reads.detach().to("cpu", torch.int64).tolist()
            expected = expected_chunk_indices(offsets, chunk_size)
            if chunk_indices.detach().cpu().tolist() != expected:
                raise ValueError(f"chunk_indices: expected fla's [sequence, chunk] rows of cu_seqlens {offsets} at "
                                 f"chunk_size={chunk_size} ({len(expected)} rows), got {_shape(chunk_indices)} "
                                 f"rows that differ")
    return reads
