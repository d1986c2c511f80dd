"""State pools (serving): decode and prefill over a pool of rows, in place, against the
float64 recurrence run on each request alone.

Everything goes through the exported calls: the decode step
(``torch_gdr.fused_recurrent_gated_delta_rule(..., ssm_state_indices=...)``) and the prefill
(``torch_gdr.chunk_gated_delta_rule(..., initial_state_indices=...)``), each on the
``"torch"`` backend (pure torch, any device), the ``"cpu"`` backend (the fused kernels) and
the ``"pypto"`` backend (its decode kernel, and its chunk kernel between row gathers and
scatters, run by PyPTO's CPU interpreter). One table of cases and one of errors serves all
three; PyPTO takes head dims 64, 128 and 256 only, so its cases run at K=64, V=128 (K != V: a
transposed state cannot pass), and the interpreter takes seconds a call, so most of them are
slow-marked.
"""

from __future__ import annotations

import random
import re
import warnings
from typing import Callable, Optional

import pytest
import torch

import torch_gdr
from torch_gdr import _pool
from torch_gdr._fallback import PyptoBackendError, PyptoFallbackWarning, reset_warnings
from torch_gdr.dispatch.registry import select
from torch_gdr.ops._backend import CallSpec
from torch_gdr.ops.pypto import is_pypto_available
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule
from torch_gdr.testing import make_inputs, rmse_ratio

FIELDS = ("q", "k", "v", "g", "beta")

#: Backends every pool test runs on.
BACKENDS = ("cpu", "pypto", "torch")
#: Head dims (K, V) of the pool tests on each backend: K != V, so a transposed state cannot
#: pass; PyPTO's kernels take K, V in {64, 128, 256}. The C++ step runs V in blocks of 32 columns,
#: each in vector registers where its width is a multiple of the vector's: V = 56 gives a
#: block of 32 and one of 24 (three AVX2 registers; the scalar loop under AVX-512).
DIMS = {"torch": (8, 6), "cpu": (8, 56), "pypto": (64, 128)}
#: Chunk size of the prefill calls: the smallest each backend takes.
CHUNK = {"torch": 16, "cpu": 16, "pypto": 32}
needs_pypto = pytest.mark.skipif(not is_pypto_available(), reason="pypto==0.2.0 is not importable")


def backend_params(cases, fast_on_pypto=(), skip_on_pypto=()) -> list:
    """``(backend, case)`` for every backend and case. PyPTO's interpreter takes seconds a
    call: its cases are slow-marked but those of ``fast_on_pypto``; ``skip_on_pypto`` are
    cases it refuses (tested as errors instead)."""
    params = []
    for case in cases:
        for backend in BACKENDS:
            marks = []
            if backend == "pypto":
                if case in skip_on_pypto:
                    continue
                marks.append(needs_pypto)
                if case not in fast_on_pypto:
                    marks.append(pytest.mark.slow)
            params.append(pytest.param(backend, case, marks=marks, id=f"{case}-{backend}"))
    return params


def _public_step(backend: str) -> Callable:
    """The exported decode call over a pool on ``backend``; returns ``o`` (the pool is
    returned too, and must be the pool passed in)."""

    def step(q, k, v, g, beta, scale, pool, idx, acc=None, **kw):
        o, returned = torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, scale=scale, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
            backend=backend, **kw)
        assert returned is pool
        return o

    return step


STEPS: dict[str, Callable] = {backend: _public_step(backend) for backend in BACKENDS}


def prefill(q, k, v, g, beta, scale, pool, *, chunk_size: int = 64, backend: Optional[str] = None, **kw):
    """The exported chunked call over a pool; returns ``o``."""
    o, returned = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, scale, pool, chunk_size=chunk_size,
                                                   backend=backend, **kw)
    assert returned is pool
    return o


def _key_first(x: torch.Tensor, v_first: bool) -> torch.Tensor:
    return x.transpose(-1, -2) if v_first else x


def make_pool(slots: int, heads: int, dk: int, dv: int, dtype=torch.float32, v_first: bool = False,
              pad: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A random pool and the buffer under it (``pad`` extra elements per row)."""
    inner = (heads, dv, dk) if v_first else (heads, dk, dv)
    row = heads * dk * dv
    gen = torch.Generator().manual_seed(seed)
    buffer = (torch.randn(slots, row + pad, generator=gen) * 0.5).to(dtype)
    return buffer[:, :row].view(slots, *inner), buffer


def reference_tokens(x: dict, tokens: list[int], state: torch.Tensor, scale: Optional[float],
                     l2norm: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and states after each of ``tokens`` (indices into the flattened token axis),
    one request alone, float64, from the key-first ``state [HV, K, V]``."""
    outs, states = [], []
    s = state.double()[None]
    for t in tokens:
        pieces = [x[f].reshape(-1, *x[f].shape[2:])[t:t + 1][None].double() for f in FIELDS]
        o, s = naive_recurrent_gated_delta_rule(*pieces, scale, s, True, l2norm)
        outs.append(o[0, 0])
        states.append(s[0])
    return outs, states


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((ref.double() - out.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _rounded(state: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return state.to(dtype).double()


# ------------------------------------------------------------------------------------------------
# Decode.

DECODE_CASES = {
    # name: (lens per sequence, width S (None: 1-D indices), accepted (None: no num_accepted_tokens), options)
    "one_token": ([1, 1, 1, 1], None, None, {}),
    "one_token_minus1": ([1, 1, 1], None, None, dict(rows=[[2], [-1], [5]])),
    "fork": ([1, 1], 2, [2, 2], dict(rows=[[3, 0], [4, 1]])),
    "spec_all_acceptance": ([3, 3, 3, 2, 0], 3, [1, 2, 3, 3, 1], {}),
    "spec_minus1_slots": ([3, 2, 3], 3, [3, 1, 2], dict(rows=[[0, -1, 2], [3, 4, -1], [-1, 7, 8]])),
    "long_spec": ([11, 9], 12, [12, 5], {}),
    "value_first": ([2, 3, 1], 3, [2, 3, 1], dict(v_first=True)),
    "padded_stride": ([2, 1, 3], 3, [1, 3, 2], dict(pad=7)),
    "gqa_l2norm_scale": ([2, 2], 2, [2, 1], dict(heads=(2, 4), l2norm=True, scale=0.3)),
    "token_major": ([1, 3, 2], 3, [3, 3, 1], dict(token_major=True)),
    "bf16_pool": ([3, 2, 1], 3, [2, 1, 3], dict(pool_dtype=torch.bfloat16)),
    "fp16_pool_v_first": ([2, 3], 3, [3, 2], dict(pool_dtype=torch.float16, v_first=True)),
    "bf16_inputs": ([2, 1], 2, [1, 2], dict(dtype=torch.bfloat16)),
    "swapped_head_dims": ([3, 1, 2], 3, [2, 1, 3], dict(swap_dims=True)),  # K > V
    # inplace_final_state=False: the pool only read, the state after every token returned
    "out_of_place": ([2, 0, 3, 1], 3, [2, 1, 3, 1], dict(out_of_place=True, rows=[[4, 9, 1], [-1, 3, 3], [5, 5, 2],
                                                                                 [-1, 0, 0]])),
    "out_of_place_1d_several_tokens": ([4, 1, 3], None, None, dict(out_of_place=True, token_major=True)),
    "out_of_place_bf16_v_first": ([1, 2], 2, None, dict(out_of_place=True, pool_dtype=torch.bfloat16, v_first=True,
                                                        pad=3)),
}


def _default_rows(lens: list[int], width: int, slots: int, seed: int) -> list[list[int]]:
    rows = random.Random(seed).sample(range(slots), len(lens) * width)
    return [rows[n * width:(n + 1) * width] for n in range(len(lens))]


def run_decode_case(backend: str, lens: list[int], width: Optional[int], accepted: Optional[list[int]],
                    opts: dict, seed: int = 0) -> None:
    """One decode call over a pool on ``backend`` against each request alone: outputs, every
    written row, and every other byte of the pool's buffer unchanged."""
    h, hv = opts.get("heads", (2, 2))
    dk, dv = DIMS[backend][::-1] if opts.get("swap_dims") else DIMS[backend]
    v_first, pad = opts.get("v_first", False), opts.get("pad", 0)
    pool_dtype, in_dtype = opts.get("pool_dtype", torch.float32), opts.get("dtype", torch.float32)
    scale, l2norm = opts.get("scale"), opts.get("l2norm", False)
    slots = 40
    cols = width or 1
    rows = opts.get("rows") or _default_rows(lens, cols, slots, seed)
    # unit-norm keys unless the op normalises them (raw keys of K = 64 make the state explode)
    x = make_inputs(seqlens=lens, num_qk_heads=h, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, dtype=in_dtype,
                    normalize_qk=not l2norm, seed=seed)
    cu = x.pop("cu_seqlens")
    bos = cu.tolist()[:-1]
    pool, buffer = make_pool(slots, hv, dk, dv, pool_dtype, v_first, pad, seed=seed + 1)
    before = buffer.clone()
    idx = torch.tensor(rows if width else [r[0] for r in rows], dtype=torch.int32)
    acc = None if accepted is None else torch.tensor(accepted, dtype=torch.int64)
    args = [x[f] for f in FIELDS]
    if opts.get("token_major"):
        args = [t.squeeze(0) for t in args]
    out_of_place = opts.get("out_of_place", False)
    with torch.no_grad():
        if out_of_place:
            o, token_states = torch_gdr.fused_recurrent_gated_delta_rule(
                *args[:4], beta=args[4], scale=scale, initial_state=pool, ssm_state_indices=idx,
                num_accepted_tokens=acc, inplace_final_state=False, backend=backend, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=l2norm, state_v_first=v_first)
            assert token_states.shape == (sum(lens), *pool.shape[1:]) and token_states.dtype == pool_dtype
        else:
            o = STEPS[backend](*args, scale, pool, idx, acc, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                               state_v_first=v_first)
    assert o.shape == args[2].shape and o.dtype == in_dtype
    o = o.reshape(-1, hv, dv)

    before_pool = before[:, :pool[0].numel()].view(pool.shape)
    expected_rows: dict[int, torch.Tensor] = {}  # pool row -> state
    expected_tokens: dict[int, torch.Tensor] = {}  # out of place: flattened token -> state
    ref_o, out_o = [], []
    for n, length in enumerate(lens):
        if length == 0:
            continue
        start = rows[n][(accepted[n] - 1) if accepted else 0]
        state = (torch.zeros(hv, dk, dv, dtype=torch.float64) if start < 0
                 else _key_first(before_pool[start], v_first).double())
        outs, states = reference_tokens(x, list(range(bos[n], bos[n] + length)), state, scale, l2norm)
        ref_o += outs
        out_o += [o[t] for t in range(bos[n], bos[n] + length)]
        for j, s in enumerate(states):
            if out_of_place:
                expected_tokens[bos[n] + j] = _rounded(s, pool_dtype)
            elif rows[n][j] >= 0:
                expected_rows[rows[n][j]] = _rounded(s, pool_dtype)
    low_precision = pool_dtype != torch.float32 or in_dtype != torch.float32
    if ref_o:
        ref, out = torch.stack(ref_o), torch.stack(out_o)
        if low_precision:
            assert rmse_ratio(ref, out) < 0.005
        else:
            assert rel_err(ref, out) < 1e-5
    got_states = [(row, pool[row]) for row in expected_rows]
    if out_of_place:
        got_states = [(t, token_states[t]) for t in expected_tokens]
    for (row, got), state in zip(got_states, [*expected_rows.values(), *expected_tokens.values()]):
        got = _key_first(got, v_first).double()
        if low_precision:
            assert rmse_ratio(state, got) < 0.005, f"row {row}"
        else:
            assert rel_err(state, got) < 1e-5, f"row {row}"
    # Every byte not in a written row is untouched: other rows, the row padding.
    untouched = torch.ones(buffer.shape, dtype=torch.bool)
    row_numel = pool[0].numel()
    for row in expected_rows:
        untouched[row, :row_numel] = False
    assert torch.equal(buffer[untouched], before[untouched])


#: PyPTO's decode kernel takes at most 16 tokens per sequence
#: (``test_pypto_decode_refuses_more_than_16_tokens_per_sequence``); ``long_spec`` (S = 12) runs on it.
PYPTO_REFUSES: tuple[str, ...] = ()


@pytest.mark.parametrize("impl, case", backend_params(sorted(DECODE_CASES), skip_on_pypto=PYPTO_REFUSES))
def test_decode_against_each_request_alone(impl: str, case: str) -> None:
    lens, width, accepted, opts = DECODE_CASES[case]
    run_decode_case(impl, lens, width, accepted, opts)


@pytest.mark.parametrize("impl, case", backend_params(["batched"]))
def test_decode_batched_layout_and_steps_chain(impl: str, case: str) -> None:
    """B sequences of T tokens (no cu_seqlens), several steps in a row through the same pool:
    equals one long run per request; rows are reused in place."""
    step = STEPS[impl]
    (dk, dv), batch, hv, steps = DIMS[impl], 3, 2, 4
    pool, _ = make_pool(10, hv, dk, dv)
    start = pool.clone()
    rows = torch.tensor([7, 2, 5])
    x = make_inputs(batch_size=batch, seq_len=steps, num_qk_heads=hv, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32, normalize_qk=True, seed=3)
    outs = []
    with torch.no_grad():
        for t in range(steps):
            outs.append(step(*(x[f][:, t:t + 1] for f in FIELDS), None, pool, rows))
    o = torch.cat(outs, dim=1)
    ref_o, ref_s = naive_recurrent_gated_delta_rule(*(x[f].double() for f in FIELDS), None,
                                                    start[rows].double(), True)
    assert rel_err(ref_o, o) < 1e-5
    assert rel_err(ref_s, pool[rows]) < 1e-5


# ------------------------------------------------------------------------------------------------
# Prefill with checkpoints.


def run_prefill_case(lens: list[int], initial: list[int], final: Optional[list[int]],
                     offsets: Optional[list[list[int]]], ck_rows: Optional[list[list[int]]], *,
                     backend: str = "cpu", v_first: bool = False, pad: int = 0, pool_dtype=torch.float32,
                     swap_dims: bool = False, seed: int = 0) -> None:
    """One prefill call over a pool on ``backend`` against each request alone: outputs, the
    final and checkpoint rows, and every other byte of the pool's buffer unchanged.
    ``swap_dims``: the backend's test head dims swapped (K > V)."""
    (dk, dv), hv, slots = (DIMS[backend][::-1] if swap_dims else DIMS[backend]), 2, 40
    x = make_inputs(seqlens=lens, num_qk_heads=1, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, dtype=torch.float32,
                    normalize_qk=True, seed=seed)
    cu = x.pop("cu_seqlens")
    bos = cu.tolist()[:-1]
    pool, buffer = make_pool(slots, hv, dk, dv, pool_dtype, v_first, pad, seed=seed + 5)
    before = buffer.clone()
    before_pool = before[:, :pool[0].numel()].view(pool.shape)
    with torch.no_grad():
        o = prefill(
            *(x[f] for f in FIELDS), None, pool, initial_state_indices=torch.tensor(initial),
            final_state_indices=None if final is None else torch.tensor(final),
            checkpoint_offsets=None if offsets is None else torch.tensor(offsets),
            checkpoint_indices=None if ck_rows is None else torch.tensor(ck_rows), cu_seqlens=cu,
            chunk_size=CHUNK[backend], backend=backend, state_v_first=v_first)
    o = o.reshape(-1, hv, dv)
    finals = final if final is not None else initial
    expected: dict[int, torch.Tensor] = {}
    tol = 1e-5 if pool_dtype == torch.float32 else None
    for n, length in enumerate(lens):
        state = (torch.zeros(hv, dk, dv, dtype=torch.float64) if initial[n] < 0
                 else _key_first(before_pool[initial[n]], v_first).double())
        outs, states = reference_tokens(x, list(range(bos[n], bos[n] + length)), state, None, False)
        states = [state] + states  # states[p]: after p tokens
        if length:
            ref, out = torch.stack(outs), o[bos[n]:bos[n] + length]
            assert (rel_err(ref, out) < tol) if tol else (rmse_ratio(ref, out) < 0.005), f"o of sequence {n}"
        if finals[n] >= 0:
            expected[finals[n]] = _rounded(states[length], pool_dtype)
        if offsets is not None:
            per_seq = lambda a: a[n] if isinstance(a[n], list) else [a[n]]  # noqa: E731  ([N] is [N, 1])
            for off, row in zip(per_seq(offsets), per_seq(ck_rows)):
                if row >= 0:
                    expected[row] = _rounded(states[off], pool_dtype)
    for row, state in expected.items():
        got = _key_first(pool[row], v_first).double()
        assert (rel_err(state, got) < tol) if tol else (rmse_ratio(state, got) < 0.005), f"row {row}"
    untouched = torch.ones(buffer.shape, dtype=torch.bool)
    for row in expected:
        untouched[row, :pool[0].numel()] = False
    assert torch.equal(buffer[untouched], before[untouched])


PREFILL_CASES = {
    # name: (lens, initial rows, final rows, checkpoint offsets, checkpoint rows, options)
    "in_place": ([20, 7, 33], [3, 9, 1], None, None, None, {}),
    "fork_and_minus1": ([20, 7, 33, 5], [3, -1, 1, 3], [10, 11, -1, 12], None, None, {}),
    "empty_sequence_copies": ([6, 0, 9], [4, 5, 6], [7, 8, 9], None, None, {}),
    "checkpoints_any_offsets": ([37, 21, 50], [0, 1, 2], [3, 4, 5],
                               [[1, 16, 17, 37], [0, 20, -1, -1], [49, 3, 31, 3]],
                               [[10, 11, 12, 13], [14, 15, -1, -1], [16, 17, 18, 19]], {}),
    "checkpoints_1d": ([9, 30], [0, -1], [2, 3], [5, 0], [6, 7], {}),
    "checkpoint_empty_sequence": ([0, 12], [1, 2], [3, 4], [[0], [12]], [[5], [6]], {}),
    "v_first_padded": ([25, 14], [0, 1], [2, 3], [[7, 19], [13, -1]], [[4, 5], [6, -1]], dict(v_first=True, pad=5)),
    "bf16_pool": ([30, 18], [0, 1], None, [[11, 29], [3, 17]], [[4, 5], [6, 7]], dict(pool_dtype=torch.bfloat16)),
    "swapped_head_dims": ([40, 9], [2, -1], [5, 6], [[33], [4]], [[7], [8]], dict(swap_dims=True)),  # K > V
}


@pytest.mark.parametrize("impl, case", backend_params(sorted(PREFILL_CASES), fast_on_pypto=()))
def test_prefill_against_each_request_alone(impl: str, case: str) -> None:
    lens, initial, final, offsets, rows, opts = PREFILL_CASES[case]
    run_prefill_case(lens, initial, final, offsets, rows, backend=impl, **opts)


def test_prefill_checkpoints_one_pass(monkeypatch) -> None:
    """Checkpoints cost no re-run: every token goes through the chunked op once, in one call
    more than the most inner offsets of one sequence."""
    import torch_gdr.functional as functional

    calls: list[int] = []
    real = functional.run_chunk

    def counting(args, *rest, **kwargs):
        calls.append(args.q.shape[1])
        return real(args, *rest, **kwargs)

    monkeypatch.setattr(functional, "run_chunk", counting)
    run_prefill_case([37, 21, 50], [0, 1, 2], [3, 4, 5], [[1, 16, 17, 37], [0, 20, -1, -1], [49, 3, 31, 3]],
                     [[10, 11, 12, 13], [14, 15, -1, -1], [16, 17, 18, 19]])
    assert sum(calls) == 37 + 21 + 50
    assert len(calls) == 4  # sequence 0 has three inner offsets (1, 16, 17)


# ------------------------------------------------------------------------------------------------
# Errors.


def _decode(impl: str = "torch", lens=(2, 1), idx=None, acc=None, pool=None, grad: bool = False, **changes):
    """A decode call on ``impl`` at its test head dims (``DIMS``); ``pool``: a tensor, or a
    function of ``(K, V)`` making one (default: a valid pool of 6 rows)."""
    dk, dv = DIMS[impl]
    x = make_inputs(seqlens=list(lens), num_qk_heads=1, num_v_heads=2, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32)
    cu = x.pop("cu_seqlens")
    if grad:
        x["v"].requires_grad_()
    pool = make_pool(6, 2, dk, dv)[0] if pool is None else pool(dk, dv) if callable(pool) else pool
    idx = torch.tensor([[0, 1], [2, 3]]) if idx is None else idx
    args = dict(cu_seqlens=cu)
    args.update(changes)
    STEPS[impl](*(x[f] for f in FIELDS), None, pool, idx, acc, **args)


def _prefill(impl: str = "cpu", lens=(5, 3), initial=(0, 1), final=None, offsets=None, rows=None, grad: bool = False,
             **changes):
    """A prefill call on ``impl`` at its test head dims, over a pool of 6 rows."""
    dk, dv = DIMS[impl]
    x = make_inputs(seqlens=list(lens), num_qk_heads=1, num_v_heads=2, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32)
    cu = x.pop("cu_seqlens")
    if grad:
        x["k"].requires_grad_()
    t = lambda a: None if a is None else torch.tensor(a)  # noqa: E731
    kw = dict(initial_state_indices=t(initial), final_state_indices=t(final), checkpoint_offsets=t(offsets),
              checkpoint_indices=t(rows), cu_seqlens=cu, chunk_size=CHUNK[impl], backend=impl)
    kw.update(changes)
    prefill(*(x[f] for f in FIELDS), None, make_pool(6, 2, dk, dv)[0], **kw)


def _pattern(pattern: str, dk: int, dv: int) -> str:
    """A message regex with the head dims of the call filled in: ``<K>``, ``<V>``, ``<KV>``
    (K * V) and ``<HKV>`` (2 heads * K * V)."""
    for name, value in (("<HKV>", 2 * dk * dv), ("<KV>", dk * dv), ("<K>", dk), ("<V>", dv)):
        pattern = pattern.replace(name, str(value))
    return pattern


DECODE_ERRORS = {
    "pool_dtype": (dict(pool=lambda dk, dv: torch.zeros(6, 2, dk, dv, dtype=torch.float64)), TypeError,
                   r"initial_state: expected a pool of dtype float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, "
                   r"got torch.float64"),
    "pool_transposed_shape": (dict(pool=lambda dk, dv: torch.zeros(6, 2, dv, dk)), ValueError,
                              r"initial_state: expected a pool of shape \[slots, HV, K, V\] = "
                              r"\[slots >= 1, 2, <K>, <V>\], got \[6, 2, <V>, <K>\]"),
    "pool_v_first_shape": (dict(state_v_first=True), ValueError, r"\[slots, HV, V, K\] \(state_v_first=True\)"),
    "pool_overlapping": (dict(pool=lambda dk, dv: torch.zeros(1, 2, dk, dv).expand(6, 2, dk, dv)), ValueError,
                         r"initial_state: expected a pool whose elements do not overlap .*got shape "
                         r"\[6, 2, <K>, <V>\] with strides \[0, <KV>, <V>, 1\]"),
    "pool_device": (dict(pool=lambda dk, dv: torch.zeros(6, 2, dk, dv, device="meta")), ValueError,
                    r"initial_state: expected the pool on cpu"),
    "grad": (dict(grad=True), ValueError, r"v: requires grad, but state pools are for inference"),
    "grad_dt_bias": (dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2, requires_grad=True)),
                     ValueError, r"dt_bias: requires grad, but state pools are for inference"),
    "in_place_type": (dict(inplace_final_state=1), TypeError, r"inplace_final_state: expected a bool, got int 1 \(or None"),
    # out of place the rows are only read: still in range, acceptance still 1..S
    "out_of_place_index_past_pool": (dict(idx=torch.tensor([[0, 1], [7, 3]]), inplace_final_state=False), ValueError,
                                     r"ssm_state_indices: expected pool rows in \[-1, slots\) = \[-1, 6\), got 7"),
    "out_of_place_accepted_zero": (dict(acc=torch.tensor([0, 1]), inplace_final_state=False), ValueError,
                                   r"num_accepted_tokens: expected values in 1..S = 1..2 .*got 0 at index 0"),
    "index_dtype": (dict(idx=torch.tensor([[0.0, 1.0], [2.0, 3.0]])), TypeError,
                    r"ssm_state_indices: expected dtype int32 or int64, got torch.float32"),
    "index_rank": (dict(idx=torch.zeros(2, 2, 1, dtype=torch.int64)), ValueError,
                   r"ssm_state_indices: expected shape \[N\] or \[N, S\], got \[2, 2, 1\]"),
    "index_count": (dict(idx=torch.tensor([[0, 1]])), ValueError,
                    r"ssm_state_indices: expected shape .*N = 2 sequences, got \[1, 2\]"),
    "index_past_pool": (dict(idx=torch.tensor([[0, 6], [2, 3]])), ValueError,
                        r"ssm_state_indices: expected pool rows in \[-1, slots\) = \[-1, 6\), got 6 at \[0, 1\]"),
    "index_below_minus1": (dict(idx=torch.tensor([[0, 1], [-2, 3]])), ValueError, r"got -2 at \[1, 0\]"),
    "one_d_many_tokens": (dict(idx=torch.tensor([0, 1])), ValueError,
                          r"ssm_state_indices: 1-D indices \[N\] take at most one token per sequence, but sequence 0 "
                          r"has 2"),
    "more_tokens_than_rows": (dict(lens=(3, 1)), ValueError,
                              r"ssm_state_indices: expected at most S = 2 tokens per sequence .*sequence 0 has 3"),
    "accepted_zero": (dict(acc=torch.tensor([1, 0])), ValueError,
                      r"num_accepted_tokens: expected values in 1..S = 1..2 .*got 0 at index 1"),
    "accepted_past_width": (dict(acc=torch.tensor([3, 1])), ValueError, r"got 3 at index 0"),
    "accepted_shape": (dict(acc=torch.tensor([1, 1, 1])), ValueError,
                       r"num_accepted_tokens: expected shape \[N\] = \[2\], got \[3\]"),
    "accepted_dtype": (dict(acc=torch.tensor([1.0, 1.0])), TypeError,
                       r"num_accepted_tokens: expected dtype int32 or int64"),
    "two_sequences_write_a_row": (dict(idx=torch.tensor([[0, 1], [1, 3]])), ValueError,
                                  r"ssm_state_indices\[1, 0\]: row 1 is written twice in one call"),
    "one_sequence_writes_a_row_twice": (dict(idx=torch.tensor([[4, 4], [2, 3]])), ValueError,
                                        r"row 4 is written twice"),
    "read_row_written_by_other": (dict(idx=torch.tensor([[0, 1], [2, 0]]), acc=torch.tensor([1, 2])), ValueError,
                                  r"ssm_state_indices\[1, 1\]: row 0 is read by sequence 1 and written by sequence 0"),
}


@pytest.mark.parametrize("impl, name", backend_params(sorted(DECODE_ERRORS), fast_on_pypto=sorted(DECODE_ERRORS)))
def test_decode_errors(impl: str, name: str) -> None:
    changes, exc, pattern = DECODE_ERRORS[name]
    with pytest.raises(exc, match=_pattern(pattern, *DIMS[impl])):
        _decode(impl, **changes)


@needs_pypto
def test_pypto_decode_refuses_more_than_16_tokens_per_sequence() -> None:
    """The PyPTO decode kernel takes S <= 16 tokens per sequence: S = 17 is named, the
    registry's reason, before any work."""
    with pytest.raises(PyptoBackendError, match=r"at most 16 tokens per sequence in a step \(ssm_state_indices "
                                                r"\[N, S\]\), got S = 17"):
        _decode("pypto", lens=(17, 1), idx=torch.arange(34).view(2, 17),
                pool=lambda dk, dv: make_pool(34, 2, dk, dv)[0])


@needs_pypto
@pytest.mark.parametrize("width, expected", [(16, "pypto"), (17, "torch")])
def test_wide_pool_step_on_an_npu_falls_back_by_default(width: int, expected: str) -> None:
    """On an accelerator the default serves a step wider than the decode kernel on torch,
    with the fallback warning naming the reason (the device is faked in the call's spec: no
    NPU here)."""
    spec = CallSpec("pool_step", torch.device("privateuseone"), torch.float32, torch.float32, 128, 128, 32, False,
                    2 * width, tokens_per_sequence=width)
    reset_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = select(spec).backend.name
    assert chosen == expected
    messages = [str(w.message) for w in caught if issubclass(w.category, PyptoFallbackWarning)]
    assert bool(messages) == (expected == "torch")
    assert all("at most 16 tokens per sequence" in m for m in messages)


def test_minus1_and_unused_entries_are_not_conflicts() -> None:
    """-1 in several sequences, and entries past a sequence's length that repeat other rows,
    are fine: only rows actually written count."""
    with torch.no_grad():
        _decode(idx=torch.tensor([[-1, -1], [-1, 0]]), lens=(2, 1))
        _decode(idx=torch.tensor([[0, 1], [2, 1]]), lens=(2, 1))


def _check(**kw) -> None:
    """The common check of a pool call (what every backend's entry point runs first)."""
    x = make_inputs(seqlens=[5, 3], num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=6, dtype=torch.float32)
    cu = x.pop("cu_seqlens")
    _pool.check_pool_args(*(x[f] for f in FIELDS), None, make_pool(6, 2, 8, 6)[0], cu_seqlens=cu, **kw)


CHECK_ERRORS = {  # the common check's own rules, which no public call reaches (each takes one kind)
    "both_kinds": (dict(ssm_state_indices=torch.tensor([0, 1]), initial_state_indices=torch.tensor([0, 1])),
                   ValueError, r"expected exactly one of them .*got both"),
    "neither_kind": (dict(), ValueError, r"expected exactly one of them .*got neither"),
    "accepted_in_prefill": (dict(initial_state_indices=torch.tensor([0, 1]), num_accepted_tokens=torch.tensor([1, 1])),
                            ValueError, r"num_accepted_tokens: is a decode argument"),
    "prefill_argument_in_decode": (dict(ssm_state_indices=torch.tensor([0, 1]),
                                        final_state_indices=torch.tensor([0, 1])),
                                   ValueError, r"final_state_indices: is a prefill argument"),
}


@pytest.mark.parametrize("name", sorted(CHECK_ERRORS))
def test_check_errors(name: str) -> None:
    kw, exc, pattern = CHECK_ERRORS[name]
    with pytest.raises(exc, match=pattern):
        _check(**kw)


PREFILL_ERRORS = {
    "grad": (dict(grad=True), ValueError, r"k: requires grad, but state pools are for inference"),
    "grad_A_log": (dict(use_gate_in_kernel=True, A_log=torch.zeros(2, requires_grad=True)), ValueError,
                   r"A_log: requires grad, but state pools are for inference"),
    "no_initial_rows": (dict(initial=None, final=[2, 3]), ValueError,
                        r"initial_state_indices: required with final_state_indices or checkpoints"),
    "checkpoint_every": (dict(checkpoint_every=64), ValueError,
                         r"checkpoint_every: not available with a state pool .*got checkpoint_every=64"),
    "initial_shape": (dict(initial=[[0, 1]]), ValueError,
                      r"initial_state_indices: expected shape \[N\], got \[1, 2\]"),
    "initial_count": (dict(initial=[0]), ValueError,
                      r"initial_state_indices: expected shape \[N\] = \[2\], got \[1\]"),
    "initial_range": (dict(initial=[-2, 1]), ValueError,
                      r"initial_state_indices: expected pool rows in \[-1, slots\) = \[-1, 6\), got -2 at 0"),
    "final_range": (dict(final=[0, 9]), ValueError,
                    r"final_state_indices: expected pool rows in \[-1, slots\) = \[-1, 6\), got 9 at 1"),
    "final_shared": (dict(final=[4, 4]), ValueError, r"final_state_indices\[1\]: row 4 is written twice"),
    "final_read_by_other": (dict(final=[1, 2]), ValueError,
                            r"initial_state_indices\[1\]: row 1 is read by sequence 1 and written by sequence 0"),
    "offsets_without_rows": (dict(offsets=[1, 2]), ValueError,
                             r"checkpoint_indices: expected together with checkpoint_offsets"),
    "rows_without_offsets": (dict(rows=[3, 4]), ValueError,
                             r"checkpoint_offsets: expected together with checkpoint_indices"),
    "checkpoint_shapes": (dict(offsets=[[1, 2], [1, 2]], rows=[3, 4]), ValueError,
                          r"checkpoint_indices: expected the shape of checkpoint_offsets \[2, 2\], got \[2\]"),
    "checkpoint_past_end": (dict(offsets=[[1], [4]], rows=[[3], [4]]), ValueError,
                            r"checkpoint_offsets: expected a position in 0..3 \(the length of sequence 1\), got 4 at "
                            r"\[1, 0\]"),
    "checkpoint_negative": (dict(offsets=[-1, 2], rows=[3, 4]), ValueError,
                            r"expected a position in 0..5 .*got -1 at \[0\]"),
    "checkpoint_row_range": (dict(offsets=[1, 2], rows=[3, 6]), ValueError,
                             r"checkpoint_indices: expected pool rows in \[-1, slots\) = \[-1, 6\), got 6 at 1"),
    "checkpoint_row_is_final_row": (dict(offsets=[1, 2], rows=[3, 1]), ValueError,
                                    r"checkpoint_indices\[1\]: row 1 is written twice"),
    "checkpoint_rows_shared": (dict(offsets=[[1, 2], [1, 2]], rows=[[3, 4], [5, 4]]), ValueError,
                               r"checkpoint_indices\[1, 1\]: row 4 is written twice"),
    "checkpoint_row_read_by_other": (dict(offsets=[1, 2], rows=[1, 4], final=[2, 3]), ValueError,
                                     r"row 1 is read by sequence 1 and written by sequence 0"),
    "checkpoint_dtype": (dict(offsets=[1.0, 2.0], rows=[3, 4]), TypeError,
                         r"checkpoint_offsets: expected dtype int32 or int64"),
}


@pytest.mark.parametrize("impl, name",
                         backend_params(sorted(PREFILL_ERRORS), fast_on_pypto=sorted(PREFILL_ERRORS)))
def test_prefill_errors(impl: str, name: str) -> None:
    changes, exc, pattern = PREFILL_ERRORS[name]
    with pytest.raises(exc, match=pattern):
        _prefill(impl, **changes)


@pytest.mark.parametrize("impl, case", backend_params(["rejected"], fast_on_pypto=["rejected"]))
def test_rejected_call_leaves_pool_untouched(impl: str, case: str) -> None:
    pool, buffer = make_pool(6, 2, *DIMS[impl])
    before = buffer.clone()
    with pytest.raises(ValueError, match=re.escape("num_accepted_tokens")):
        _decode(impl, pool=pool, acc=torch.tensor([0, 1]))
    assert torch.equal(buffer, before)


# ------------------------------------------------------------------------------------------------
# A serving simulation.


class Request:
    """One request's token stream (inputs fixed up front) and its bookkeeping."""

    def __init__(self, rid: int, prompt: int, total: int, x: dict, hit: Optional[tuple[int, int]],
                 own_checkpoint: int):
        self.rid, self.prompt, self.total, self.x = rid, prompt, total, x  # x: q..beta of [1, total, ...]
        self.hit = hit  # (source request, stream position of its checkpoint) or None
        self.start = hit[1] if hit else 0  # first stream position this request computes itself
        self.own_checkpoint = own_checkpoint  # stream position of the checkpoint its prefill writes
        self.done = self.start  # stream positions processed so far
        self.outputs: dict[int, torch.Tensor] = {}
        self.block: list[int] = []  # its decode rows
        self.accepted = 1


def simulate_serving(backend: str, num_requests: int = 64, seed: int = 0, spec_width: int = 3, max_running: int = 12,
                     head_dims: tuple[int, int] = (16, 8), hit_from: int = 4, hit_rate: float = 0.35,
                     min_hits: int = 5) -> None:
    """The continuous-batching loop of :func:`test_serving_simulation` on ``backend``: its
    prefills and decode steps through the public calls. Requests from ``hit_from`` on share a
    prefix with an earlier one with probability ``hit_rate``; at least ``min_hits`` do."""
    step = STEPS[backend]
    rng = random.Random(seed)
    (dk, dv), h, hv = head_dims, 1, 2
    cache_rows = list(range(num_requests))  # prefix cache: one checkpoint row per request, kept
    free_rows = list(range(num_requests, num_requests + max_running * spec_width + 8))
    pool = torch.zeros(free_rows[-1] + 1, hv, dk, dv)
    pool[num_requests:] = float("nan")  # a row read before it is written poisons the outputs
    storage = pool.untyped_storage().data_ptr()

    requests: list[Request] = []
    checkpoints: dict[int, int] = {}  # request -> stream position of its checkpoint
    for rid in range(num_requests):
        prompt = rng.randint(1, 40)
        hit = None
        if rid >= hit_from and rng.random() < hit_rate:
            source = rng.randrange(rid)
            hit = (source, checkpoints[source])
            prompt = max(prompt, hit[1])  # a prompt may be all cached (prefill of no tokens)
        total = prompt + rng.randint(1, 10)
        x = make_inputs(seqlens=[total], num_qk_heads=h, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                        dtype=torch.float32, normalize_qk=True, seed=seed * 1000 + rid)
        x.pop("cu_seqlens")
        if hit:  # the shared prefix: the source's first tokens
            for f in FIELDS:
                x[f][:, :hit[1]] = requests[hit[0]].x[f][:, :hit[1]]
        start = hit[1] if hit else 0
        checkpoints[rid] = rng.randint(start, prompt)
        requests.append(Request(rid, prompt, total, x, hit, checkpoints[rid]))

    waiting = list(requests)
    prefilled: set[int] = set()
    running: list[Request] = []
    steps = 0
    while waiting or running:
        steps += 1
        assert steps < 10 * num_requests, "the loop does not progress"
        # Admit: a prefix hit waits until its source's checkpoint was written by an earlier call.
        admitted: list[Request] = []
        while waiting and len(running) + len(admitted) < max_running:
            r = waiting[0]
            if r.hit and r.hit[0] not in prefilled:
                break
            waiting.pop(0)
            r.block = [free_rows.pop() for _ in range(spec_width)]
            admitted.append(r)
        if admitted:  # one prefill call, packed
            pieces = [{f: r.x[f][:, r.start:r.prompt] for f in FIELDS} for r in admitted]
            lens = [r.prompt - r.start for r in admitted]
            cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))])
            with torch.no_grad():
                o = prefill(
                    *(torch.cat([p[f] for p in pieces], dim=1) for f in FIELDS), None, pool,
                    initial_state_indices=torch.tensor([cache_rows[r.hit[0]] if r.hit else -1 for r in admitted]),
                    final_state_indices=torch.tensor([r.block[0] for r in admitted]),
                    checkpoint_offsets=torch.tensor([[r.own_checkpoint - r.start] for r in admitted]),
                    checkpoint_indices=torch.tensor([[cache_rows[r.rid]] for r in admitted]), cu_seqlens=cu,
                    chunk_size=CHUNK[backend], backend=backend)
            for i, r in enumerate(admitted):
                for p in range(lens[i]):
                    r.outputs[r.start + p] = o[0, cu[i] + p]
                r.done, r.accepted = r.prompt, 1
                prefilled.add(r.rid)
            running.extend(admitted)
        decoding = [r for r in running if r.rid in prefilled and r.done < r.total and r not in admitted]
        if decoding:  # one decode step: plain or speculative, plus a padding sequence
            widths = [rng.choice([1, spec_width]) for _ in decoding]
            counts = [min(w, r.total - r.done) for w, r in zip(widths, decoding)]
            tokens = {f: torch.cat([r.x[f][:, r.done:r.done + c] for r, c in zip(decoding, counts)]
                                   + [torch.randn(1, 1, *r.x[f].shape[2:]) for r in decoding[:1]], dim=1)
                      for f in FIELDS}
            tokens["g"] = -tokens["g"].abs()
            lens = counts + [1]
            cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))])
            indices = torch.tensor([r.block for r in decoding] + [[-1] * spec_width])
            accepted = torch.tensor([r.accepted for r in decoding] + [1])
            with torch.no_grad():
                o = step(*(tokens[f] for f in FIELDS), None, pool, indices, accepted, cu_seqlens=cu)
            for i, (r, c) in enumerate(zip(decoding, counts)):
                keep = rng.randint(1, c)  # drafts past the accepted ones are thrown away
                for p in range(keep):
                    r.outputs[r.done + p] = o[0, cu[i] + p]
                r.done += keep
                r.accepted = keep
        for r in [r for r in running if r.done >= r.total]:
            running.remove(r)
            for row in r.block:
                pool[row] = float("nan")  # freed: any later read of it would show
            free_rows.extend(r.block)
        assert pool.untyped_storage().data_ptr() == storage

    for r in requests:
        ref, _ = naive_recurrent_gated_delta_rule(*(r.x[f].double() for f in FIELDS), None, None, False)
        positions = list(range(r.start, r.total))
        assert sorted(r.outputs) == positions, f"request {r.rid} skipped tokens"
        out = torch.stack([r.outputs[p] for p in positions])
        assert rel_err(ref[0, r.start:], out) < 1e-5, f"request {r.rid}"
        # The prefix cache row holds the request's state at its checkpoint, nothing else's.
        _, state = naive_recurrent_gated_delta_rule(*(r.x[f][:, :r.own_checkpoint].double() for f in FIELDS), None,
                                                    None, True)
        assert rel_err(state[0], pool[cache_rows[r.rid]]) < 1e-5, f"checkpoint of request {r.rid}"
    assert bool(pool[num_requests:].isnan().all()), "a decode row was written after its request left"
    assert sum(1 for r in requests if r.hit) >= min_hits


@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_serving_simulation(impl: str) -> None:
    """64 requests of random lengths arrive and leave over a continuous-batching loop: packed
    prefills (prefix hits restored from checkpoint rows other requests wrote), decode steps
    mixing one-token and speculative sequences with random acceptance and a padding sequence
    of -1 rows; every output equals its request run alone, the pool is never reallocated, and
    freed rows (poisoned with NaN) never leak into another request."""
    simulate_serving(impl)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("impl", ["cpu", "torch"])
def test_serving_simulation_more_seeds(impl: str, seed: int) -> None:
    simulate_serving(impl, seed=seed, spec_width=4, max_running=20)


@needs_pypto
@pytest.mark.slow
def test_serving_simulation_pypto() -> None:
    """The serving loop, smaller, on ``"pypto"`` (its decode kernel and its chunk kernel run
    by the interpreter): 8 requests at K = V = 64, prefix hits more frequent so that a few
    occur."""
    simulate_serving("pypto", num_requests=8, seed=0, spec_width=3, max_running=4, head_dims=(64, 64), hit_from=2,
                     hit_rate=0.7, min_hits=2)
