"""The decode step over a state pool under ``torch.compile(fullgraph=True)`` (issue 35 item 2).

Serving engines compile their decode step: the public call with ``ssm_state_indices`` (and
``num_accepted_tokens``) and the layer's eval decode over a
:class:`~torch_gdr.nn.GatedDeltaNetPoolCache` must trace into one graph, keep their checks
(an out-of-range or twice-written row still raises ``ValueError`` naming the argument, at
run time), and not recompile as the batch varies. Every compiled result is compared with the
same call run eagerly (the eager step is checked against the float64 recurrence in
``tests/test_pool.py``) and the outputs with that recurrence here as well.

Compiled with the ``aot_eager`` backend (the fakes, functionalization of the in-place pool
update and the mutation written back, without the C++ compile time of inductor); compiled
functions are shared by a module's tests.
"""

from __future__ import annotations

import types
from typing import Callable, Optional

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import torch_gdr
from torch_gdr.nn import GatedDeltaNetPoolCache
from tests.test_nn import inputs, make_layer
from tests.test_pool import FIELDS, make_pool, reference_tokens

BACKENDS = ("cpu", "torch")
HEADS, DK, DV, SLOTS = (1, 2), 8, 16, 12
#: Batch sizes across 2..64 a serving loop meets.
BATCHES = (2, 3, 4, 5, 8, 13, 31, 32, 47, 64)


def _step(backend: str, validate: bool, tag: str = "") -> Callable:
    """The public decode call for one backend and ``validate``, as a function of its own
    code object (Dynamo keeps compiled graphs per code object, up to its recompile limit)."""
    def step(q, k, v, g, beta, pool, idx, acc: Optional[torch.Tensor] = None):
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
            use_qk_l2norm_in_kernel=True, backend=backend, validate=validate)
        return o
    code = step.__code__.replace(co_name=f"step_{backend}_{validate}{tag}")
    return types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)


@pytest.fixture(scope="module")
def compiled() -> dict:
    """``(backend, validate) -> (eager step, compiled step, its compile counter)``."""
    torch._dynamo.reset()
    steps = {}
    for backend in BACKENDS:
        for validate in (True, False):
            counter = CompileCounterWithBackend("aot_eager")
            eager = _step(backend, validate)
            steps[backend, validate] = (eager, torch.compile(eager, fullgraph=True, backend=counter), counter)
    yield steps
    torch._dynamo.reset()


def _inputs(batch: int, width: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    h, hv = HEADS
    x = {"q": torch.randn(batch, width, h, DK, generator=gen), "k": torch.randn(batch, width, h, DK, generator=gen),
         "v": torch.randn(batch, width, hv, DV, generator=gen),
         "g": -torch.rand(batch, width, hv, generator=gen) * 0.5, "beta": torch.rand(batch, width, hv, generator=gen)}
    return x


def _run_both(compiled: dict, backend: str, validate: bool, x: dict, idx: torch.Tensor,
              acc: Optional[torch.Tensor] = None, seed: int = 1) -> tuple:
    """The call eagerly and compiled, each on its own copy of one pool: ``(o_eager, pool_eager,
    o_compiled, pool_compiled, pool before)``."""
    eager, step, counter = compiled[backend, validate]
    pool, _ = make_pool(SLOTS, HEADS[1], DK, DV, seed=seed)
    before = pool.clone()
    pool_e, pool_c = pool.clone(), pool.clone()
    with torch.no_grad():
        o_e = eager(*(x[f] for f in FIELDS), pool_e, idx, acc)
        o_c = step(*(x[f] for f in FIELDS), pool_c, idx, acc)
    return o_e, pool_e, o_c, pool_c, before


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_pool_step_equals_eager_and_the_recurrence(compiled: dict, backend: str, validate: bool) -> None:
    """Speculative indices ``[N, S]`` with ``num_accepted_tokens`` and a -1 slot, then 1-D
    indices with a -1 row: one graph each, the outputs and every pool row equal eager's,
    and the outputs those of the float64 recurrence from each sequence's start row."""
    x = _inputs(3, 2)
    idx = torch.tensor([[4, 6], [1, -1], [9, 2]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 1])
    o_e, pool_e, o_c, pool_c, before = _run_both(compiled, backend, validate, x, idx, acc)
    assert torch.allclose(o_c, o_e, rtol=1e-5, atol=1e-6) and torch.allclose(pool_c, pool_e, rtol=1e-5, atol=1e-6)
    for n, start in enumerate([6, 1, 9]):
        ref, states = reference_tokens(x, [2 * n, 2 * n + 1], before[start].double(), None, True)
        assert torch.allclose(o_c[n].double(), torch.stack(ref), rtol=1e-4, atol=1e-5)
        for j, row in enumerate(idx[n].tolist()):
            if row >= 0:
                assert torch.allclose(pool_c[row].double(), states[j], rtol=1e-4, atol=1e-5)
    untouched = [r for r in range(SLOTS) if r not in (4, 6, 1, 9, 2)]
    assert torch.equal(pool_c[untouched], before[untouched])

    x1 = _inputs(3, 1, seed=3)
    o_e, pool_e, o_c, pool_c, _ = _run_both(compiled, backend, validate, x1, torch.tensor([5, -1, 0]))
    assert torch.allclose(o_c, o_e, rtol=1e-5, atol=1e-6) and torch.allclose(pool_c, pool_e, rtol=1e-5, atol=1e-6)
    assert compiled[backend, validate][2].frame_count >= 1


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_pool_step_still_checks_the_rows(compiled: dict, backend: str, validate: bool) -> None:
    """Under compile the index checks run at every call (CPU indices are always checked):
    a row out of range, a row written twice and a bad ``num_accepted_tokens`` raise
    ``ValueError`` naming the argument; the pool is left as it was."""
    x = _inputs(3, 1)
    pool, _ = make_pool(SLOTS, HEADS[1], DK, DV)
    before = pool.clone()
    step = compiled[backend, validate][1]
    cases = [(torch.tensor([1, SLOTS, 2]), None, rf"ssm_state_indices: expected pool rows in \[-1, slots\) = "
                                                 rf"\[-1, {SLOTS}\), got {SLOTS} at 1"),
             (torch.tensor([1, -2, 2]), None, "ssm_state_indices: expected pool rows"),
             (torch.tensor([3, 5, 3]), None, "ssm_state_indices.*row 3 is written twice"),
             (torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([1, 3, 1]), "num_accepted_tokens: expected values")]
    with torch.no_grad():
        for idx, acc, message in cases:
            with pytest.raises(ValueError, match=message):
                step(*(x[f] for f in FIELDS), pool, idx, acc)
    assert torch.equal(pool, before)


#: torch's step with automatic dynamic shapes is slow-marked: Dynamo's recompile decision does
#: not depend on the backend (the cpu case keeps it in the default suite), and torch's op under a
#: symbolic batch runs with the batch dim marked
@pytest.mark.parametrize("backend, mark_dynamic", [("cpu", True), ("cpu", False), ("torch", True),
                                                   pytest.param("torch", False, marks=pytest.mark.slow)])
def test_batch_sizes_2_to_64_compile_at_most_twice(backend: str, mark_dynamic: bool) -> None:
    """The compiled step over batch sizes 2..64 (:data:`BATCHES`): with the batch dim marked dynamic one
    graph; with automatic dynamic shapes at most one recompile. Outputs equal eager's."""
    torch._dynamo.reset()
    # aot_eager with the batch dim marked (the fakes under a symbolic batch); Dynamo's own
    # recompile decisions without it
    counter = CompileCounterWithBackend("aot_eager" if mark_dynamic else "eager")
    eager = _step(backend, True, f"_dynamic_{mark_dynamic}")
    step = torch.compile(eager, fullgraph=True, backend=counter)
    pool, _ = make_pool(80, HEADS[1], DK, DV)
    pool_e = pool.clone()
    try:
        with torch.no_grad():
            for batch in BATCHES:
                x = _inputs(batch, 1, seed=batch)
                idx = torch.randperm(80, generator=torch.Generator().manual_seed(batch))[:batch]
                args = [x[f] for f in FIELDS]
                if mark_dynamic:
                    for t in (*args, idx):
                        torch._dynamo.mark_dynamic(t, 0)
                o_c = step(*args, pool, idx)
                o_e = eager(*args, pool_e, idx)
                assert torch.allclose(o_c, o_e, rtol=1e-5, atol=1e-6), batch
        assert torch.allclose(pool, pool_e, rtol=1e-5, atol=1e-6)
        assert counter.frame_count == (1 if mark_dynamic else 2), counter.frame_count
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["cpu", pytest.param("torch", marks=pytest.mark.slow)])  # torch's step: above
def test_layer_eval_decode_on_the_pool_cache_compiled(backend: str) -> None:
    """The layer's eval decode over a GatedDeltaNetPoolCache, compiled, against the same
    calls eagerly on a copy of the cache: two steps of two requests, then a fork and two
    steps of all three (the fork's first write moves it to a fresh row in the compiled
    call too). Prompts run eagerly on both caches."""
    torch._dynamo.reset()
    layer = make_layer(backend).eval()
    prompts, steps = inputs(2, 4, seed=5), inputs(3, 4, seed=6)
    caches = [GatedDeltaNetPoolCache(slots=4), GatedDeltaNetPoolCache(slots=4)]

    def decode(x: torch.Tensor, cache: GatedDeltaNetPoolCache, ids: list) -> torch.Tensor:
        return layer(x, cache=cache.batch(ids))

    counter = CompileCounterWithBackend("eager")  # Dynamo's graph; the op's fakes are covered above
    compiled_decode = torch.compile(decode, fullgraph=True, backend=counter)
    try:
        with torch.no_grad():
            for cache in caches:
                cache.allocate(["a", "b"])
                layer(prompts, cache=cache.batch(["a", "b"]))
            for t in range(2):
                y_c = compiled_decode(steps[:2, t:t + 1], caches[0], ["a", "b"])
                y_e = decode(steps[:2, t:t + 1], caches[1], ["a", "b"])
                assert torch.allclose(y_c, y_e, rtol=1e-5, atol=1e-6)
            for cache in caches:
                cache.fork("a", "c")
            for t in range(2, 4):
                y_c = compiled_decode(steps[:, t:t + 1], caches[0], ["a", "b", "c"])
                y_e = decode(steps[:, t:t + 1], caches[1], ["a", "b", "c"])
                assert torch.allclose(y_c, y_e, rtol=1e-5, atol=1e-6)
        assert caches[0].home_rows == caches[1].home_rows and caches[0].home_rows["c"] != caches[0].home_rows["a"]
        key = layer.cache_key
        for name in ("recurrent_pool", "conv_pool"):
            assert torch.allclose(getattr(caches[0].layers[key], name), getattr(caches[1].layers[key], name),
                                  rtol=1e-5, atol=1e-6)
        assert counter.frame_count >= 1
    finally:
        torch._dynamo.reset()


def test_cpu_pool_step_op_with_the_serving_extras_passes_opcheck() -> None:
    """``gdr::_cpu_pool_step`` with a token tree, an intermediate buffer and initial rows:
    its schema (the pool and the buffer mutated), fake and autograd registration agree with
    its eager body (torch.library.opcheck)."""
    import torch_gdr.ops.cpu.pool  # noqa: F401  (registers the op)

    gen = torch.Generator().manual_seed(4)
    n, s, hv, dk, dv = 2, 3, 2, 8, 16
    q, k = torch.randn(n, s, 1, dk, generator=gen), torch.randn(n, s, 1, dk, generator=gen)
    v = torch.randn(n, s, hv, dv, generator=gen)
    g, beta = -torch.rand(n, s, hv, generator=gen), torch.rand(n, s, hv, generator=gen)
    pool = torch.randn(6, hv, dk, dv, generator=gen)
    rows = torch.tensor([[0, 1, 2], [3, 4, -1]])
    parents = torch.tensor([[-1, 0, 0], [-1, 0, 1]])
    buffer = torch.zeros(3, s, hv, dk, dv)
    args = (q, k, v, g, beta, pool, rows, None, None, None, True, False)
    kwargs = dict(initial_state_indices=torch.tensor([5, -1]), retrieve_parent_token=parents,
                  intermediate_states_buffer=buffer, intermediate_state_indices=torch.tensor([2, 0]))
    torch.library.opcheck(torch.ops.gdr._cpu_pool_step.default, args, kwargs)
