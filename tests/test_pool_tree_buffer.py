"""Decode over a state pool with token trees and intermediate states (issue 36 items 1 and 3):
``fused_recurrent_gated_delta_rule(..., ssm_state_indices=..., retrieve_parent_token=...,
intermediate_states_buffer=..., intermediate_state_indices=..., disable_state_update=...)``.

Checked against the float64 recurrence run per token from the parent's state (the start
state: the pool as it was, zeros for -1), on ``cpu`` and ``torch``, eagerly and under
``torch.compile(fullgraph=True)``: outputs, every written pool row and buffer slot, and
every row and slot outside them left bit for bit.
"""

from __future__ import annotations

import types
from typing import Optional

import pytest
import torch

import torch_gdr
from torch_gdr.testing import make_inputs, rmse_ratio
from tests.test_pool import FIELDS, make_pool, reference_tokens

TOL = dict(rtol=1e-4, atol=1e-5)
DIMS = {"cpu": (8, 40), "torch": (8, 6)}
BACKENDS = ("cpu", "torch")
HV = 2


def _inputs(lens: list[int], backend: str, varlen: bool, seed: int = 3,
            dims: Optional[tuple[int, int]] = None) -> tuple[dict, Optional[torch.Tensor], list]:
    dk, dv = dims or DIMS[backend]
    x = make_inputs(seqlens=lens, num_qk_heads=1, num_v_heads=HV, head_k_dim=dk, head_v_dim=dv, dtype=torch.float32,
                    seed=seed)
    cu = x.pop("cu_seqlens")
    bos = cu.tolist()[:-1]
    if not varlen:
        assert len(set(lens)) == 1
        x = {f: x[f].reshape(len(lens), lens[0], *x[f].shape[2:]) for f in FIELDS}
        cu = None
    return x, cu, bos


def _reference(x: dict, bos: list, lens: list, parents: Optional[list], starts: list) -> tuple[dict, dict]:
    """float64 outputs and states ``{(n, j): tensor}`` of every token."""
    outs, states = {}, {}
    for n, length in enumerate(lens):
        for j in range(length):
            p = parents[n][j] if parents is not None else j - 1
            state = starts[n] if p < 0 else states[n, p]
            o, s = reference_tokens(x, [bos[n] + j], state, None, True)
            outs[n, j], states[n, j] = o[0], s[0]
    return outs, states


def _step(backend: str, compiled: bool, tag: str):
    def step(q, k, v, g, beta, pool, idx, acc, cu, parents, buffer, buffer_rows, disable):
        return torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend=backend, retrieve_parent_token=parents,
            intermediate_states_buffer=buffer, intermediate_state_indices=buffer_rows, disable_state_update=disable)[0]
    if not compiled:
        return step
    code = step.__code__.replace(co_name=f"tree_{backend}_{tag}")
    return torch.compile(types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__),
                         fullgraph=True, backend="aot_eager")


def run_case(backend: str, lens: list[int], rows: list[list[int]], *, parents: Optional[list] = None,
             accepted: Optional[list] = None, buffer_rows: Optional[list] = None, buffer_shape=(5, 4),
             buffer_dtype=torch.float32, disable: bool = False, varlen: bool = False,
             compiled: bool = False, slots: int = 16, dims: Optional[tuple[int, int]] = None) -> None:
    dk, dv = dims or DIMS[backend]
    x, cu, bos = _inputs(lens, backend, varlen, dims=dims)
    pool, _ = make_pool(slots, HV, dk, dv, seed=4)
    pool[slots - 1] = float("nan")  # no case reads it
    before = pool.clone()
    buffer = None
    if buffer_rows is not None:
        buffer = torch.randn(*buffer_shape, HV, dk, dv, generator=torch.Generator().manual_seed(9)).to(buffer_dtype)
    buffer_before = None if buffer is None else buffer.clone()
    idx = torch.tensor(rows)
    acc = None if accepted is None else torch.tensor(accepted)
    step = _step(backend, compiled, f"{parents is None}_{buffer_rows is None}_{disable}_{varlen}_{acc is None}")
    with torch.no_grad():
        o = step(*(x[f] for f in FIELDS), pool, idx, acc, cu, None if parents is None else torch.tensor(parents),
                 buffer, None if buffer_rows is None else torch.tensor(buffer_rows, dtype=torch.int32), disable)
    o = o.reshape(-1, HV, dv)
    starts = []
    for n in range(len(lens)):
        row = rows[n][(accepted[n] - 1) if accepted else 0]
        starts.append(torch.zeros(HV, dk, dv, dtype=torch.float64) if row < 0 else before[row].double())
    ref_o, ref_s = _reference(x, bos, lens, parents, starts)
    half = buffer_dtype != torch.float32
    got_o = torch.stack([o[bos[n] + j] for n, j in ref_o])
    want_o = torch.stack(list(ref_o.values()))
    if half:
        assert rmse_ratio(want_o, got_o) < 0.005
    else:
        assert torch.allclose(got_o.double(), want_o, **TOL)
    written = set()
    if not disable:
        for (n, j), state in ref_s.items():
            if rows[n][j] >= 0:
                written.add(rows[n][j])
                got = pool[rows[n][j]].double()
                assert (rmse_ratio(state, got) < 0.005) if half else torch.allclose(got, state, **TOL), (n, j)
    untouched = [r for r in range(slots) if r not in written]
    assert torch.equal(pool[untouched].view(torch.int32), before[untouched].view(torch.int32))
    if buffer is not None:
        kept = torch.ones(buffer.shape[:2], dtype=torch.bool)
        for (n, j), state in ref_s.items():
            got = buffer[buffer_rows[n], j].double()
            assert (rmse_ratio(state, got) < 0.005) if half else torch.allclose(got, state, **TOL), (n, j)
            kept[buffer_rows[n], j] = False
        assert torch.equal(buffer[kept].view(torch.uint8), buffer_before[kept].view(torch.uint8))


TREE = [[-1, 0, 0, 1], [-1, -1, 1, 2], [-1, 0, 1, 2]]  # a branching tree, two roots, a chain
ROWS = [[1, 2, 3, 4], [5, -1, 6, 7], [8, 9, 10, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_writes_every_token_state_to_its_row(backend: str) -> None:
    run_case(backend, [4, 4, 4], ROWS, parents=TREE)


def test_tree_on_the_vector_path() -> None:
    """V = 48, a multiple of the vector width on AVX2 and on AVX-512, so the cpu kernel takes
    its vector path (V = 40 takes the staged one on AVX-512). Sequence 1's second root starts
    from the start row after its first root has overwritten it (the kernel stages that row)."""
    run_case("cpu", [4, 4, 4], ROWS, parents=TREE, dims=(8, 48))


def test_tree_over_a_bf16_pool_on_the_vector_path() -> None:
    """A tree over a bfloat16 pool (no buffer: on AVX2 the pool's even/odd register pairs, their
    float32 scratch in that order) with a second root after the start row was overwritten,
    V = 48: the cpu kernel against the torch backend (itself checked against the float64
    recurrence above), within fla's rmse ratio for o and every pool row."""
    x, _, _ = _inputs([4, 4, 4], "cpu", False, dims=(16, 48))
    x = {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t) for n, t in x.items()}
    before = (torch.randn(16, HV, 16, 48, generator=torch.Generator().manual_seed(2)) * 0.3).to(torch.bfloat16)
    got = {}
    for backend in BACKENDS:
        pool = before.clone()
        with torch.no_grad():
            o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
                *(x[f] for f in FIELDS[:4]), beta=x["beta"], initial_state=pool, ssm_state_indices=torch.tensor(ROWS),
                retrieve_parent_token=torch.tensor(TREE), use_qk_l2norm_in_kernel=True, backend=backend)
        got[backend] = (o.double(), pool.double())
    assert not torch.equal(got["cpu"][1], before.double())
    for what, i in (("o", 0), ("pool", 1)):
        assert rmse_ratio(got["torch"][i], got["cpu"][i]) < 0.005, what


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_varlen_with_accepted_tokens(backend: str) -> None:
    """Packed sequences of 2, 4 and 1 tokens starting after their last accepted token."""
    run_case(backend, [2, 4, 1], [[1, 2, 0, 0], [5, 11, 6, 7], [8, 12, 0, 0]],
             parents=[[-1, -1, 9, 9], [-1, 0, 0, 2], [-1, 5, 5, 5]], accepted=[1, 2, 1], varlen=True)


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_intermediate_buffer_chain(backend: str, disable: bool) -> None:
    """The state after every token in the caller's buffer (rows 3, 0, 4 of five); the pool
    written as usual, or only read with disable_state_update."""
    run_case(backend, [4, 4, 4], ROWS, buffer_rows=[3, 0, 4], disable=disable)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_into_buffer_without_state_update(backend: str) -> None:
    """SGLang's verify step: a tree, states into the buffer, the pool only read; varlen."""
    run_case(backend, [3, 1, 4], [[1, 2, 3, 0], [5, 0, 0, 0], [8, 9, 10, 11]], parents=TREE, buffer_rows=[1, 4, 2],
             disable=True, varlen=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_buffer(backend: str) -> None:
    run_case(backend, [4, 4, 4], ROWS, parents=TREE, buffer_rows=[3, 0, 4], buffer_dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_tree_and_buffer(backend: str) -> None:
    torch._dynamo.reset()
    try:
        run_case(backend, [4, 4, 4], ROWS, parents=TREE, buffer_rows=[3, 0, 4], compiled=True)
        run_case(backend, [4, 4, 4], ROWS, parents=TREE, compiled=True)
    finally:
        torch._dynamo.reset()


ERRORS = {
    "parent_after_child": (dict(parents=[[-1, 2, 0, 1]] * 3), ValueError,
                           r"retrieve_parent_token: expected a parent before its child .*got 2 at \[0, 1\]"),
    "parent_out_of_range": (dict(parents=[[-2, 0, 0, 1]] * 3), ValueError,
                            r"retrieve_parent_token: expected a parent before its child .*got -2 at \[0, 0\]"),
    "parent_shape": (dict(parents=[[-1, 0]] * 3), ValueError, r"retrieve_parent_token: expected shape \[N, S\]"),
    "buffer_shape": (dict(buffer=(5, 3)), ValueError, r"intermediate_states_buffer: expected shape \[R, S, 2, 8, 6\]"),
    "buffer_dtype": (dict(buffer=(5, 4), buffer_dtype=torch.float64), TypeError,
                     r"intermediate_states_buffer: expected dtype float32, bfloat16 or float16, got torch.float64"),
    "index_range": (dict(buffer=(5, 4), buffer_rows=[0, 5, 1]), ValueError,
                    r"intermediate_state_indices: expected buffer rows in \[0, R\) = \[0, 5\), got 5 at 1"),
    "index_twice": (dict(buffer=(5, 4), buffer_rows=[2, 0, 2]), ValueError,
                    r"intermediate_state_indices: row 2 is written twice"),
    "buffer_alone": (dict(buffer=(5, 4), buffer_rows=None), ValueError,
                     r"intermediate_state_indices: expected together with intermediate_states_buffer"),
    "pool_row_twice": (dict(rows=[[1, 2, 3, 4], [5, 2, 6, 7], [8, 9, 10, 11]]), ValueError,
                       r"row 2 is written twice"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_errors_name_the_argument(name: str, compiled: bool, backend: str) -> None:
    kw, exc, pattern = ERRORS[name]
    x, _, _ = _inputs([4, 4, 4], "torch", False)
    pool, _ = make_pool(16, HV, 8, 6)
    before = pool.clone()
    buffer = None
    if "buffer" in kw:
        buffer = torch.zeros(*kw["buffer"], HV, 8, 6, dtype=kw.get("buffer_dtype", torch.float32))
    buffer_rows = kw.get("buffer_rows", [3, 0, 4] if buffer is not None else None)
    step = _step(backend, compiled, f"errors_{name}")
    torch._dynamo.reset()
    try:
        with torch.no_grad(), pytest.raises(exc, match=pattern):
            step(*(x[f] for f in FIELDS), pool, torch.tensor(kw.get("rows", ROWS)), None, None,
                 torch.tensor(kw.get("parents", TREE)), buffer,
                 None if buffer_rows is None else torch.tensor(buffer_rows), False)
    finally:
        torch._dynamo.reset()
    assert torch.equal(pool, before)


PYPTO_EXTRAS = {
    "tree": (dict(retrieve_parent_token=torch.tensor([[-1, 0]] * 2)), r"a token tree \(retrieve_parent_token\)"),
    "buffer": (dict(intermediate_states_buffer=torch.zeros(2, 2, HV, 64, 64),
                    intermediate_state_indices=torch.tensor([0, 1])), r"intermediate states"),
    "no_update": (dict(disable_state_update=True), r"leaves the pool unwritten \(disable_state_update\)"),
    "strided": ("strided", r"a pool whose rows are not contiguous"),
    "fp8": ("fp8", r"an fp8 pool"),
}


@pytest.mark.parametrize("extra", sorted(PYPTO_EXTRAS))
def test_pypto_names_the_extra_its_decode_kernel_lacks(extra: str) -> None:
    """The PyPTO decode kernel runs plain chains over packed rows: asked by name for a step
    with a serving extra, the registry refuses it with a reason naming the extra (before any
    kernel runs), and the pool keeps its bits."""
    from torch_gdr._fallback import PyptoBackendError

    kw, pattern = PYPTO_EXTRAS[extra]
    x = make_inputs(seqlens=[2, 2], num_qk_heads=1, num_v_heads=HV, head_k_dim=64, head_v_dim=64,
                    dtype=torch.float32, seed=5)
    x.pop("cu_seqlens")
    x = {f: x[f].reshape(2, 2, *x[f].shape[2:]) for f in FIELDS}
    pool = torch.randn(6, HV, 64, 64)
    if kw == "strided":
        pool = torch.randn(6, HV, 64, 72)[..., :64]
        kw = {}
    elif kw == "fp8":
        pool = pool.to(torch.float8_e4m3fn)
        kw = {}
    before = pool.clone()
    with torch.no_grad(), pytest.raises(PyptoBackendError, match=r"backend 'pypto' cannot serve .*" + pattern):
        torch_gdr.fused_recurrent_gated_delta_rule(*(x[f] for f in FIELDS), initial_state=pool,
                                                   ssm_state_indices=torch.tensor([[1, 2], [3, 4]]),
                                                   backend="pypto", **kw)
    assert torch.equal(pool.view(torch.uint8), before.view(torch.uint8))
