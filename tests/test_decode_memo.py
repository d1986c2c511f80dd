"""The decode step's memo of checked signatures (:mod:`torch_gdr._decode_memo`).

A pool step whose shapes, strides, dtypes and flags passed every check before skips those
checks and tests only its index values. These tests hold the memo to the full rules:
the quick value test against :func:`torch_gdr._pool.check_pool_args` on random index
tables; every bad index value after a good call of the same signature, through the
exported call, against the message the first call would get; results of calls served
from the memo against the float64 recurrence; and what must change a signature (strides,
grad mode, the backend variable).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

import torch_gdr
from torch_gdr import _pool
from torch_gdr._decode_memo import SignatureMemo, quick_start_rows, signature
from torch_gdr.dispatch import BackendError
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

H, HV, K, V, SLOTS = 1, 2, 8, 40, 8


def _inputs(num_seqs: int, tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Batched ``[N, T, ...]`` float32 decode inputs (no ``cu_seqlens``)."""
    gen = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(num_seqs, tokens, H, K, generator=gen), k=torch.randn(num_seqs, tokens, H, K, generator=gen),
                v=torch.randn(num_seqs, tokens, HV, V, generator=gen),
                g=torch.nn.functional.logsigmoid(torch.randn(num_seqs, tokens, HV, generator=gen)),
                beta=torch.rand(num_seqs, tokens, HV, generator=gen))


def _pool6(seed: int = 1) -> torch.Tensor:
    return torch.randn(SLOTS, HV, K, V, generator=torch.Generator().manual_seed(seed)) * 0.5


def _step(x: dict, pool: torch.Tensor, idx: torch.Tensor, backend: str = "cpu", **kw) -> torch.Tensor:
    o, returned = torch_gdr.fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=pool, ssm_state_indices=idx, backend=backend,
        use_qk_l2norm_in_kernel=True, **kw)
    assert returned is pool
    return o


# --- the quick value test against the full rules ---------------------------------------------


def _full_rules(table, accepted, starts, seq_len: int, width_1d: bool):
    """The start rows :func:`check_pool_args` derives, or None where it raises ValueError."""
    num = len(table)
    x = _inputs(num, seq_len)
    idx = torch.tensor([row[0] for row in table] if width_1d else table)
    try:
        plan = _pool.check_pool_args(*x.values(), None, torch.zeros(SLOTS, HV, K, V), ssm_state_indices=idx,
                                     num_accepted_tokens=None if accepted is None else torch.tensor(accepted),
                                     start_indices=None if starts is None else torch.tensor(starts))
    except ValueError:
        return None
    return plan.start_rows.tolist()


def test_quick_start_rows_agrees_with_the_full_rules() -> None:
    """On random tables (rows in -2..SLOTS, repeats likely), the quick test returns exactly
    the full checks' start rows where they pass, and None where they raise."""
    rng = random.Random(0)
    passed = refused = 0
    for _ in range(600):
        num, width = rng.randint(1, 4), rng.randint(1, 3)
        width_1d = width == 1 and rng.random() < 0.5
        seq_len = rng.randint(1, width)
        table = [[rng.randint(-2, SLOTS) if rng.random() < 0.1 else rng.randint(-1, 7) for _ in range(width)]
                 for _ in range(num)]
        accepted = starts = None
        kind = rng.random()
        if kind < 0.35:
            accepted = [rng.randint(0, width + 1) if rng.random() < 0.1 else rng.randint(1, width) for _ in range(num)]
        elif kind < 0.6:
            starts = [rng.randint(-1, 7) for _ in range(num)]
        expected = _full_rules(table, accepted, starts, seq_len, width_1d)
        values = [row[0] for row in table] if width_1d else table
        got = quick_start_rows(values, accepted, starts, seq_len, SLOTS)
        assert got == expected, (table, accepted, starts, seq_len, width_1d)
        passed += expected is not None
        refused += expected is None
    assert passed > 100 and refused > 100  # both sides of every rule were met


# --- bad index values after a good call of the same signature -------------------------------

#: name -> (ssm_state_indices [2, 3] of two sequences of two tokens, num_accepted_tokens or None,
#: message regex); the good calls before each have rows [[0, 1, -1], [2, 3, -1]] and
#: [[5, 6, -1], [2, 3, -1]], with num_accepted_tokens [1, 1] where the case has one.
MEMO_ERRORS = {
    "past_pool": ([[0, SLOTS, -1], [2, 3, -1]], None,
                  rf"ssm_state_indices: expected pool rows in \[-1, slots\) = \[-1, {SLOTS}\), got {SLOTS} at \[0, 1\]"),
    "unused_entry_past_pool": ([[0, 1, SLOTS], [2, 3, -1]], None, rf"got {SLOTS} at \[0, 2\]"),
    "below_minus1": ([[0, 1, -1], [-2, 3, -1]], None, r"got -2 at \[1, 0\]"),
    "two_sequences_write_a_row": ([[0, 1, -1], [1, 3, -1]], None, r"ssm_state_indices\[1, 0\]: row 1 is written twice"),
    "one_sequence_writes_twice": ([[4, 4, -1], [2, 3, -1]], None, r"row 4 is written twice"),
    "accepted_zero": ([[0, 1, -1], [2, 3, -1]], [1, 0], r"num_accepted_tokens: expected values in 1..S = 1..3 .*got 0 "
                                                        r"at index 1"),
    "accepted_past_width": ([[0, 1, -1], [2, 3, -1]], [4, 1], r"got 4 at index 0"),
    "read_row_written_by_other": ([[0, 1, -1], [2, 3, 0]], [1, 3], r"ssm_state_indices\[1, 2\]: row 0 is read by "
                                                                   r"sequence 1 and written by sequence 0"),
}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", sorted(MEMO_ERRORS))
def test_bad_index_values_after_a_good_call_of_the_same_signature(backend: str, name: str) -> None:
    rows, accepted, pattern = MEMO_ERRORS[name]
    x = _inputs(2, 2)
    pool = _pool6()
    good_acc = None if accepted is None else torch.tensor([1, 1])
    _step(x, pool, torch.tensor([[0, 1, -1], [2, 3, -1]]), backend, num_accepted_tokens=good_acc)
    _step(x, pool, torch.tensor([[5, 6, -1], [2, 3, -1]]), backend, num_accepted_tokens=good_acc)  # from the memo
    before = pool.clone()
    with pytest.raises(ValueError, match=pattern):
        _step(x, pool, torch.tensor(rows), backend, num_accepted_tokens=None if accepted is None else
              torch.tensor(accepted))
    assert torch.equal(pool, before)  # refused before anything was written


#: name -> (ssm_state_indices [4] of four one-token sequences, message regex); the good calls
#: before each have rows [0, 1, 2, 3] and [7, -1, 5, 4] (the extension's one-row step).
ONE_ROW_ERRORS = {
    "past_pool": ([0, 1, SLOTS, 3], rf"ssm_state_indices: expected pool rows in \[-1, slots\) = \[-1, {SLOTS}\), "
                                    rf"got {SLOTS} at 2$"),
    "below_minus1": ([0, -2, 2, 3], r"got -2 at 1$"),
    "written_twice": ([6, 1, 2, 6], r"row 6 is written twice"),
    "written_twice_apart": ([0, 5, 7, 5], r"row 5 is written twice"),
}


@pytest.mark.parametrize("layout", ["int32", "int64", "strided"])
@pytest.mark.parametrize("name", sorted(ONE_ROW_ERRORS))
def test_bad_one_row_values_after_a_good_call(name: str, layout: str) -> None:
    """One token a sequence with ``[N]`` rows (vLLM's decode): the values are checked in the
    extension's step; a bad one gets the full checks' message and leaves the pool as it was."""
    rows, pattern = ONE_ROW_ERRORS[name]

    def as_rows(values: list) -> torch.Tensor:
        if layout == "strided":  # every other element of an int64 tensor
            return torch.tensor([x for value in values for x in (value, -7)])[::2]
        return torch.tensor(values, dtype=torch.int32 if layout == "int32" else torch.int64)

    x = _inputs(4, 1)
    pool = _pool6()
    _step(x, pool, as_rows([0, 1, 2, 3]))
    _step(x, pool, as_rows([7, -1, 5, 4]))  # from the memo
    before = pool.clone()
    with pytest.raises(ValueError, match=pattern):
        _step(x, pool, as_rows(rows))
    assert torch.equal(pool, before)  # refused before anything was written


#: name -> (cu_seqlens of four one-token sequences' call, message regex): vLLM's decode call,
#: [1, N, ...] inputs with offsets; the good calls before each have offsets 0, 1, 2, 3, 4.
VARLEN_ERRORS = {
    "two_tokens": ([0, 2, 3, 4, 4], r"ssm_state_indices: 1-D indices \[N\] take at most one token per sequence, but "
                                    r"sequence 0 has 2"),
    "empty_then_two": ([0, 0, 1, 2, 4], r"but sequence 3 has 2"),
    "not_from_zero": ([1, 2, 3, 4, 4], r"cu_seqlens: expected the first offset to be 0, got 1"),
    "decreasing": ([0, 2, 1, 3, 4], r"cu_seqlens: expected non-decreasing offsets, got 2 followed by 1 at index 1"),
    "short": ([0, 1, 2, 3, 3], r"cu_seqlens: expected the last offset to equal the number of tokens T = 4, got 3"),
    "long": ([0, 1, 2, 3, 5], r"got 5"),
}


def _varlen(x: dict) -> dict:
    """Batched one-token inputs ``[N, 1, ...]`` as one packed row ``[1, N, ...]`` (views)."""
    return {name: t.transpose(0, 1) for name, t in x.items()}


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", sorted(VARLEN_ERRORS))
def test_bad_offsets_after_good_varlen_calls(name: str, cu_dtype: torch.dtype) -> None:
    """The offsets of a varlen decode call served from the memo are checked in the
    extension's step: any but one token a sequence gets the full checks' message and leaves
    the pool as it was."""
    offsets, pattern = VARLEN_ERRORS[name]
    x = _varlen(_inputs(4, 1))
    pool = _pool6()
    good = torch.arange(5, dtype=cu_dtype)
    _step(x, pool, torch.tensor([0, 1, 2, 3]), cu_seqlens=good)
    _step(x, pool, torch.tensor([7, -1, 5, 4]), cu_seqlens=good)  # from the memo
    before = pool.clone()
    with pytest.raises(ValueError, match=pattern):
        _step(x, pool, torch.tensor([0, 1, 2, 3]), cu_seqlens=torch.tensor(offsets, dtype=cu_dtype))
    assert torch.equal(pool, before)
    with pytest.raises(ValueError, match=r"row 6 is written twice"):  # and the rows, with good offsets
        _step(x, pool, torch.tensor([6, 1, 2, 6]), cu_seqlens=good)
    assert torch.equal(pool, before)


def test_start_rows_read_by_another_sequence_after_a_good_call() -> None:
    x = _inputs(2, 1)
    pool = _pool6()
    good = dict(initial_state_indices=torch.tensor([4, 5]))
    _step(x, pool, torch.tensor([0, 1]), **good)
    _step(x, pool, torch.tensor([2, 3]), **good)
    with pytest.raises(ValueError, match=r"initial_state_indices\[1\]: row 0 is read by sequence 1 and written by "
                                         r"sequence 0"):
        _step(x, pool, torch.tensor([0, 1]), initial_state_indices=torch.tensor([4, 0]))


# --- calls served from the memo compute the recurrence ---------------------------------------


def _reference_step(x: dict, pool64: torch.Tensor, table: list, accepted=None) -> torch.Tensor:
    """The float64 recurrence of one decode call on ``pool64`` (updated); returns ``o``."""
    outs = []
    num, tokens = x["q"].shape[:2]
    for n in range(num):
        column = 0 if accepted is None else accepted[n] - 1
        start = table[n][column] if isinstance(table[n], list) else table[n]
        state = (torch.zeros(HV, K, V, dtype=torch.float64) if start < 0 else pool64[start].clone())[None]
        seq_out = []
        for j in range(tokens):
            piece = [x[f][n:n + 1, j:j + 1].double() for f in ("q", "k", "v", "g", "beta")]
            o, state = naive_recurrent_gated_delta_rule(*piece, None, state, True, True)
            row = table[n][j] if isinstance(table[n], list) else table[n]
            if row >= 0:
                pool64[row] = state[0]
            seq_out.append(o[0, 0])
        outs.append(torch.stack(seq_out))
    return torch.stack(outs)


def _count_full_checks(monkeypatch) -> list:
    """A list that gets an entry per full run of the pool checks, with the CPU step's memo
    emptied first."""
    from torch_gdr.ops.cpu import pool as cpu_pool

    full_checks: list = []
    original = _pool.check_pool_args
    monkeypatch.setattr(_pool, "check_pool_args", lambda *a, **kw: full_checks.append(1) or original(*a, **kw))
    cpu_pool._CHECKED.clear()
    return full_checks


@pytest.mark.parametrize("token_major,rows_layout", [(False, "int32"), (False, "column"), (False, "varlen"),
                                                     (False, "varlen_cast"), (True, "int32")])
def test_memo_served_steps_follow_the_recurrence(monkeypatch, token_major: bool, rows_layout: str) -> None:
    """A serving loop of one signature: every call after the first skips the metadata
    checks (counted) and still matches the float64 recurrence, pool rows included. "column":
    the rows are column 0 of an int64 ``[N, 2]`` table whose column 1 holds other valid rows;
    "varlen": vLLM's decode call, ``[1, N, ...]`` inputs with ``cu_seqlens`` 0, 1, ..., N;
    "varlen_cast": the same with g and beta in bfloat16 (vLLM's gating gives beta in the
    model's dtype), cast to float32 for the kernel."""
    full_checks = _count_full_checks(monkeypatch)
    pool = _pool6()
    pool64 = pool.double()
    rng = random.Random(3)
    for step in range(6):
        x = _inputs(3, 1, seed=step)
        if rows_layout == "varlen_cast":
            x.update({name: x[name].to(torch.bfloat16) for name in ("g", "beta")})
        table = rng.sample(range(-1, SLOTS), 3)
        if token_major:  # one sequence of one token a call, [T, ...] inputs
            x = {f: t[0] for f, t in x.items()}
            table = table[:1]
        expected = _reference_step({f: (t[None] if token_major else t) for f, t in x.items()}, pool64, table)
        rows = torch.tensor(table, dtype=torch.int32)
        if rows_layout == "column":
            others = [row for row in range(SLOTS) if row not in table][:len(table)]
            rows = torch.tensor(list(zip(table, others)))[:, 0]
            assert rows.stride() == (2,)
        if rows_layout.startswith("varlen"):
            x = _varlen(x)
            o = _step(x, pool, rows, cu_seqlens=torch.arange(len(table) + 1, dtype=torch.int32))
        else:
            o = _step(x, pool, rows)
        assert o.shape == x["v"].shape
        torch.testing.assert_close(o.reshape(expected.shape).double(), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool.double(), pool64, rtol=1e-4, atol=1e-5)
    assert len(full_checks) == 1


def _reference_varlen(x: dict, pool64: torch.Tensor, table: list, accepted: list, offsets: list) -> torch.Tensor:
    """The float64 recurrence of a varlen pool call (``[1, T, ...]`` inputs, sequence n the
    tokens ``offsets[n]:offsets[n + 1]``, starting from ``table[n][accepted[n] - 1]``,
    token j writing ``table[n][j]``) on ``pool64`` (updated); returns ``o`` ``[1, T, HV, V]``."""
    outs = []
    for n in range(len(table)):
        state = pool64[table[n][accepted[n] - 1]].clone()[None]
        for j, t in enumerate(range(offsets[n], offsets[n + 1])):
            piece = [x[f][:, t:t + 1].double() for f in ("q", "k", "v", "g", "beta")]
            o, state = naive_recurrent_gated_delta_rule(*piece, None, state, True, True)
            pool64[table[n][j]] = state[0]
            outs.append(o[0, 0])
    return torch.stack(outs)[None]


def test_memo_served_speculative_varlen_steps(monkeypatch) -> None:
    """vLLM's speculative decode call: [1, N * L, ...] inputs, ``cu_seqlens`` 0, L, 2L, ...,
    ``[N, S]`` rows and ``num_accepted_tokens``. Served from the memo while the offsets repeat
    (one full check in a loop, results of the float64 recurrence); other valid offsets get every
    check again (and their results), invalid ones the full checks' errors."""
    full_checks = _count_full_checks(monkeypatch)
    pool = _pool6()
    pool64 = pool.double()
    rng = random.Random(5)
    offsets = [0, 2, 4]
    for step in range(5):
        x = _varlen(_inputs(4, 1, seed=10 + step))  # [1, 4, ...]: two sequences of two tokens
        rows = rng.sample(range(SLOTS), 6)
        table, accepted = [rows[:3], rows[3:]], [rng.randint(1, 3), rng.randint(1, 3)]
        expected = _reference_varlen(x, pool64, table, accepted, offsets)
        o = _step(x, pool, torch.tensor(table, dtype=torch.int32), num_accepted_tokens=torch.tensor(accepted),
                  cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
        torch.testing.assert_close(o.double(), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool.double(), pool64, rtol=1e-4, atol=1e-5)
    assert len(full_checks) == 1
    # other valid offsets (three tokens, then one): checked again, and computed with them
    x = _varlen(_inputs(4, 1, seed=20))
    table, accepted = [[0, 1, 2], [3, 4, 5]], [1, 1]
    expected = _reference_varlen(x, pool64, table, accepted, [0, 3, 4])
    o = _step(x, pool, torch.tensor(table, dtype=torch.int32), num_accepted_tokens=torch.tensor(accepted),
              cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32))
    torch.testing.assert_close(o.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool.double(), pool64, rtol=1e-4, atol=1e-5)
    assert len(full_checks) == 2
    # offsets under which sequence 0 writes (its third token) the row sequence 1 starts from
    before = pool.clone()
    with pytest.raises(ValueError, match=r"row 4 is read by sequence 1 and written by sequence 0"):
        _step(x, pool, torch.tensor([[0, 1, 4], [3, 4, 5]], dtype=torch.int32), num_accepted_tokens=torch.tensor([1, 2]),
              cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens: expected the last offset to equal the number of tokens T = 4"):
        _step(x, pool, torch.tensor(table, dtype=torch.int32), num_accepted_tokens=torch.tensor(accepted),
              cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32))
    assert torch.equal(pool, before)


def test_memo_tells_strides_apart() -> None:
    """A q that is a strided view (every other element) after a contiguous q of the same
    shape: a new signature, so the kernel gets a contiguous copy, not the view."""
    x = _inputs(2, 1)
    pool = _pool6()
    pool64 = pool.double()
    _reference_step(x, pool64, [0, 1])
    _step(x, pool, torch.tensor([0, 1]))
    wide = torch.randn(2, 1, H, 2 * K)
    x["q"] = wide[..., ::2]
    expected = _reference_step(x, pool64, [2, 3])
    o = _step(x, pool, torch.tensor([2, 3]))
    torch.testing.assert_close(o.double(), expected, rtol=1e-4, atol=1e-5)


def test_memo_sees_grad_mode() -> None:
    """A v requiring grad passes under no_grad; the same call with grad mode on is refused."""
    x = _inputs(2, 1)
    x["v"].requires_grad_()
    pool = _pool6()
    with torch.no_grad():
        _step(x, pool, torch.tensor([0, 1]))
        _step(x, pool, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"v: requires grad, but state pools are for inference"):
        _step(x, pool, torch.tensor([0, 1]))


def test_memo_sees_the_backend_variable(monkeypatch) -> None:
    """The route of a default call is remembered with TORCH_GDR_BACKEND: naming another
    backend there after a remembered call selects that one (fla refuses CPU tensors)."""
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    x = _inputs(2, 1)
    pool = _pool6()
    for _ in range(2):
        torch_gdr.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                   initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))
    monkeypatch.setenv("TORCH_GDR_BACKEND", "fla")
    with pytest.raises(BackendError, match=r"backend 'fla' cannot serve"):
        torch_gdr.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                   initial_state=pool, ssm_state_indices=torch.tensor([0, 1]))


# --- the memo itself ---------------------------------------------------------------------------


def test_signature_tells_apart_what_the_checks_read() -> None:
    t = torch.zeros(2, 3)
    base = signature(t, None, 1.0, True)
    assert signature(torch.zeros(2, 3), None, 1.0, True) == base
    for other in (signature(torch.zeros(3, 2), None, 1.0, True), signature(t.t().contiguous().t(), None, 1.0, True),
                  signature(torch.zeros(2, 3, dtype=torch.float64), None, 1.0, True),
                  signature(torch.zeros(2, 3, requires_grad=True), None, 1.0, True),
                  signature(t, t, 1.0, True), signature(t, None, 1, True), signature(t, None, 1.0, 1)):
        assert other != base
    with torch.no_grad():
        assert signature(t, None, 1.0, True) != base
    assert signature(t, [0, 1]) is None and signature(t, object()) is None


class _TensorSubclass(torch.Tensor):
    pass


def _key_cases() -> list[tuple]:
    """Argument lists of a decode key: pairs that the checks must tell apart, and equal ones."""
    t = torch.zeros(2, 3)
    return [(t, None, 1.0, True), (torch.zeros(2, 3), None, 1.0, True), (torch.zeros(3, 2), None, 1.0, True),
            (t.t().contiguous().t(), None, 1.0, True), (torch.zeros(2, 3, dtype=torch.float64), None, 1.0, True),
            (torch.zeros(2, 3, requires_grad=True), None, 1.0, True), (torch.zeros(2, 3, device="meta"), None, 1.0, True),
            (torch.zeros(6)[:6].view(2, 3), None, 1.0, True), (torch.zeros(2, 4)[:, :3], None, 1.0, True),
            (torch.zeros(1, 2, 3), None, 1.0, True), (t, t, 1.0, True), (t, None, 1, True), (t, None, 1.0, 1),
            (t, None, 2.0, True), (t, None, 1.0, False), (t, None, "cpu", True), (t, None, "cpu ", True),
            (t, "cpu", None, True), (t, None, None, True), (t, 0, 1.0, True), (t, -1, 1.0, True), (t,)]


def test_native_signature_tells_apart_what_the_python_key_does() -> None:
    """The extension's key (C++, bytes) is equal for two argument lists exactly where the
    Python key is, and declines (None) what it does not cover, which the Python key then
    takes; once the extension is loaded, :func:`signature` gives the native key."""
    from torch_gdr import _decode_memo
    from torch_gdr.ops.cpu import _build

    ext = _build.load()
    if ext is None:
        pytest.skip(f"the fused CPU kernels are unavailable: {_build.unavailable_reason()}")
    cases = _key_cases()
    python_keys = [_decode_memo._python_signature(case) for case in cases]
    native_keys = [ext.decode_signature(*case) for case in cases]
    assert all(isinstance(key, bytes) for key in native_keys)
    for i, j in ((i, j) for i in range(len(cases)) for j in range(len(cases))):
        assert (native_keys[i] == native_keys[j]) == (python_keys[i] == python_keys[j]), (cases[i], cases[j])
    with torch.no_grad():
        assert ext.decode_signature(*cases[0]) != native_keys[0]
    sub = torch.zeros(2, 3).as_subclass(_TensorSubclass)
    for declined in ((sub,), (torch.zeros(2, 3), [0, 1]), (2 ** 70,), (torch.zeros(2, 3).to_sparse(),)):
        assert ext.decode_signature(*declined) is None, declined
    assert signature(*cases[0]) == native_keys[0]
    assert signature(sub, None) == _decode_memo._python_signature((sub, None))


def test_signature_memo_is_bounded_and_thread_safe() -> None:
    memo: SignatureMemo[int] = SignatureMemo(limit=64)
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(2000):
                key = (seed, i % 200)
                memo.put(key, i)
                got = memo.get(key)
                assert got is None or isinstance(got, int)
                assert len(memo) <= 64
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(memo) <= 64
    assert memo.get(None) is None
    memo.put(None, 1)
    memo.clear()
    assert len(memo) == 0


def test_memo_served_steps_read_this_call_s_gate_parameters() -> None:
    """fla's activations in the kernel: A_log, dt_bias and the raw g/beta of each call (same
    signature, new values) against the pure-torch step on a copy of the pool."""
    pool = _pool6()
    reference = pool.clone()
    for call in range(3):
        x = _inputs(2, 1, seed=10 + call)
        gen = torch.Generator().manual_seed(call)
        gate = dict(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV, generator=gen),
                    use_beta_sigmoid_in_kernel=True)
        x["beta"] = torch.randn(2, 1, HV, generator=gen)  # logits
        rows = torch.tensor([call, call + 3])
        o = _step(x, pool, rows, "cpu", **gate)
        expected = _step(x, reference, rows, "torch", **gate)
        torch.testing.assert_close(o, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool, reference, rtol=1e-4, atol=1e-5)


def test_memo_served_steps_take_this_call_s_scale() -> None:
    """scale as a float and as a 0-d tensor: a later call of the same signature with another
    value computes with its own (a tensor's value is not in the signature)."""
    for make in (float, torch.tensor):
        pool = _pool6()
        reference = pool.clone()
        for call, scale in enumerate((2.0, 0.5, 1.5)):
            x = _inputs(2, 1, seed=20 + call)
            rows = torch.tensor([call, call + 3])
            o = _step(x, pool, rows, "cpu", scale=make(scale))
            expected = _step(x, reference, rows, "torch", scale=scale)
            torch.testing.assert_close(o, expected, rtol=1e-4, atol=1e-5)


def test_memo_served_steps_under_a_default_device(monkeypatch) -> None:
    """Index tables the step builds stay on the CPU when another default device is set
    ([N, S] rows with num_accepted_tokens: start rows made from the values)."""
    x = _inputs(2, 1)
    pool = _pool6()
    acc = torch.tensor([1, 2])
    with torch.device("meta"):
        for rows in ([[0, 1], [2, 3]], [[4, 5], [6, 7]]):
            _step(x, pool, torch.tensor(rows, device="cpu"), num_accepted_tokens=acc)


def test_deprecated_layout_flag_warns_on_every_call() -> None:
    """transpose_state_layout (fla's deprecated name) warns on each call, the memo's too."""
    x = _inputs(2, 1)
    pool = _pool6()
    for rows in ([0, 1], [2, 3]):
        with pytest.warns(DeprecationWarning):
            _step(x, pool, torch.tensor(rows), transpose_state_layout=False)
