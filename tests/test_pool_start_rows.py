"""Decode over a state pool that reads one row and writes others (issue 36 item 2):
``fused_recurrent_gated_delta_rule(..., ssm_state_indices=..., initial_state_indices=...)``.

Sequence n starts from row ``initial_state_indices[n]`` (-1: a zero state) and writes the
state after its token j to ``ssm_state_indices[n, j]``. Checked against the float64
recurrence run on each request alone from the pool as it was, eagerly and under
``torch.compile(fullgraph=True)``; every row outside the written ones is left bit for bit.
"""

from __future__ import annotations

import types
from typing import Optional

import pytest
import torch

import torch_gdr
from torch_gdr.ops.pypto import is_pypto_available
from torch_gdr.testing import make_inputs
from tests.test_pool import FIELDS, make_pool, reference_tokens

TOL = dict(rtol=1e-4, atol=1e-5)
DIMS = {"cpu": (8, 40), "torch": (8, 6), "pypto": (64, 64)}
BACKENDS = ["cpu", "torch", pytest.param("pypto", marks=pytest.mark.skipif(not is_pypto_available(),
                                                                            reason="pypto==0.2.0 is not importable"))]


def _call(backend: str, x: dict, pool: torch.Tensor, idx: torch.Tensor, start: torch.Tensor,
          cu: Optional[torch.Tensor], compiled: bool = False) -> torch.Tensor:
    def step(q, k, v, g, beta, pool, idx, start, cu):
        return torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=pool, ssm_state_indices=idx, initial_state_indices=start,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend=backend)[0]
    if compiled:
        code = step.__code__.replace(co_name=f"start_rows_{backend}_{cu is None}")
        step = torch.compile(types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__),
                             fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        return step(*(x[f] for f in FIELDS), pool, idx, start, cu)


def _check(backend: str, lens: list[int], rows: list[list[int]], starts: list[int], varlen: bool,
           compiled: bool = False, slots: int = 12) -> None:
    dk, dv = DIMS[backend]
    width = len(rows[0])
    if varlen:
        x = make_inputs(seqlens=lens, num_qk_heads=1, num_v_heads=2, head_k_dim=dk, head_v_dim=dv,
                        dtype=torch.float32, seed=3)
        cu = x.pop("cu_seqlens")
        bos = cu.tolist()[:-1]
    else:
        assert len(set(lens)) == 1
        x = make_inputs(seqlens=[lens[0]] * len(lens), num_qk_heads=1, num_v_heads=2, head_k_dim=dk,
                        head_v_dim=dv, dtype=torch.float32, seed=3)
        x.pop("cu_seqlens")
        x = {f: x[f].reshape(len(lens), lens[0], *x[f].shape[2:]) for f in FIELDS}
        cu, bos = None, [n * lens[0] for n in range(len(lens))]
    pool, _ = make_pool(slots, 2, dk, dv, seed=4)
    pool[0] = float("nan")  # -1 must read zeros, not row 0
    before = pool.clone()
    idx, start = torch.tensor(rows), torch.tensor(starts, dtype=torch.int32)
    o = _call(backend, x, pool, idx, start, cu, compiled).reshape(-1, 2, dv)
    written = set()
    for n, length in enumerate(lens):
        state = torch.zeros(2, dk, dv, dtype=torch.float64) if starts[n] < 0 else before[starts[n]].double()
        outs, states = reference_tokens(x, list(range(bos[n], bos[n] + length)), state, None, True)
        for j in range(length):
            assert torch.allclose(o[bos[n] + j].double(), outs[j], **TOL), (n, j)
            if rows[n][j] >= 0:
                assert torch.allclose(pool[rows[n][j]].double(), states[j], **TOL), (n, j)
                written.add(rows[n][j])
    assert width >= max(lens)
    untouched = [r for r in range(slots) if r not in written]
    assert torch.equal(pool[untouched].view(torch.int32), before[untouched].view(torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_decode_reads_other_rows(backend: str) -> None:
    """[N, S] rows, S = 2 tokens each: sequence 0 starts from a row nobody writes, 1 from -1
    (zeros; row 0 holds NaN), 2 from its own second write row (allowed: its own)."""
    _check(backend, [2, 2, 2], [[3, 4], [5, -1], [6, 7]], [9, -1, 7], varlen=False)


@pytest.mark.parametrize("backend", [*BACKENDS[:2], pytest.param("pypto", marks=[
    pytest.mark.slow, pytest.mark.skipif(not is_pypto_available(), reason="pypto==0.2.0 is not importable")])])
def test_varlen_decode_reads_other_rows(backend: str) -> None:
    """Packed sequences of 1, 3 and 2 tokens (cu_seqlens) with rows [N, 3]."""
    _check(backend, [1, 3, 2], [[2, -1, 5], [4, 8, 9], [10, 11, 3]], [6, -1, 3], varlen=True)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_compiled_decode_reads_other_rows(backend: str) -> None:
    """The same under torch.compile(fullgraph=True): one [N] row each (1-D indices)."""
    torch._dynamo.reset()
    try:
        _check(backend, [1, 1, 1], [[3], [5], [6]], [9, -1, 6], varlen=False, compiled=True)
    finally:
        torch._dynamo.reset()


ERRORS = {
    "range": (dict(start=[1, 12, 2]), r"initial_state_indices: expected pool rows in \[-1, slots\) = \[-1, 12\), "
                                      r"got 12 at 1"),
    "read_by_other": (dict(start=[1, 3, 2]), r"initial_state_indices\[1\]: row 3 is read by sequence 1 and written "
                                             r"by sequence 0"),
    "shape": (dict(start=[1, 2]), r"initial_state_indices: expected shape \[N\] = \[3\], got \[2\]"),
    "with_accepted": (dict(start=[1, 2, 4], acc=[1, 1, 1]), r"initial_state_indices: .*expected one of the two"),
    "without_pool": (dict(start=[1, 2, 4], no_pool=True), r"initial_state_indices: the decode's start rows, only "
                                                           r"with ssm_state_indices"),
    "dtype": (dict(start=[1.0, 2.0, 4.0]), r"initial_state_indices: expected dtype int32 or int64"),
}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name, compiled", [(name, False) for name in sorted(ERRORS)]
                         + [("range", True), ("read_by_other", True)])  # the checks of values, in the op
def test_errors_name_the_argument(name: str, compiled: bool, backend: str) -> None:
    kw, pattern = ERRORS[name]
    x = make_inputs(seqlens=[1, 1, 1], num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=6, dtype=torch.float32)
    x.pop("cu_seqlens")
    x = {f: x[f].reshape(3, 1, *x[f].shape[2:]) for f in FIELDS}
    pool, _ = make_pool(12, 2, 8, 6)
    before = pool.clone()
    acc = None if "acc" not in kw else torch.tensor(kw["acc"])
    idx = torch.tensor([[3, 0], [5, 0], [6, 0]]) if acc is not None else torch.tensor([3, 5, 6])

    def step(*args):
        return torch_gdr.fused_recurrent_gated_delta_rule(
            *args[:4], beta=args[4], initial_state=pool, ssm_state_indices=None if kw.get("no_pool") else idx,
            num_accepted_tokens=acc, initial_state_indices=torch.tensor(kw["start"]), backend=backend)
    if compiled:
        torch._dynamo.reset()
        code = step.__code__.replace(co_name=f"errors_{name}_{backend}")
        step = torch.compile(types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__),
                             fullgraph=True, backend="aot_eager")
    try:
        with torch.no_grad(), pytest.raises((ValueError, TypeError), match=pattern):
            step(*(x[f] for f in FIELDS))
    finally:
        if compiled:
            torch._dynamo.reset()
    assert torch.equal(pool, before)
