"""torch_gdr.nn.GatedDeltaNetPoolCache: a stack of layers serving requests from state pools.

Every output is checked against the same stack run on each request alone, on its whole
token sequence, without a cache.
"""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch

from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache, GatedDeltaNetPoolCache
from tests.test_nn import HIDDEN, inputs, make_layer

TOL = 1e-5


def make_stack(backend: str = "torch") -> list[GatedDeltaNet]:
    """Two layers (indices 0 and 1) with different weights: a fork must be resolved per layer."""
    return [make_layer(backend, seed=seed, layer_idx=seed).eval() for seed in (0, 1)]


def run_stack(stack: list[GatedDeltaNet], x: torch.Tensor, **kwargs) -> torch.Tensor:
    """The stack with residuals, so the second layer sees the first layer's outputs."""
    for layer in stack:
        x = x + layer(x, **kwargs)
    return x


def alone(stack: list[GatedDeltaNet], tokens: torch.Tensor) -> torch.Tensor:
    """One request's whole sequence ``[T, hidden]`` through the stack, no cache: ``[T, hidden]``."""
    return run_stack(stack, tokens[None])[0]


def packed_call(stack: list[GatedDeltaNet], cache: GatedDeltaNetPoolCache, pieces: dict) -> dict:
    """One call of the stack over requests -> their new tokens ``[n, hidden]``, packed with cu_seqlens."""
    ids = list(pieces)
    lengths = [pieces[r].shape[0] for r in ids]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    y = run_stack(stack, torch.cat([pieces[r] for r in ids])[None], cache=cache.batch(ids), cu_seqlens=cu)[0]
    return dict(zip(ids, y.split(lengths)))


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return (actual - expected).abs().max().item() <= TOL * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_requests_arriving_and_leaving(backend: str) -> None:
    """Continuous batching with 3 slots for 8 requests: each step packs new prompts and
    continuing requests (one token, or a few) into one call, or runs a batched decode of
    one token each; freed rows are reused. Every output equals the request run alone, and
    the pools are never reallocated."""
    stack = make_stack(backend)
    rng = random.Random(3)
    cache = GatedDeltaNetPoolCache(slots=3)
    pending = [f"r{i}" for i in range(8)]
    seen: dict[str, list[torch.Tensor]] = {}
    outputs: dict[str, list[torch.Tensor]] = {}
    left = {}
    finished = []
    pointers = None
    seed = 100
    with torch.no_grad():
        for step in range(40):
            if not pending and not left:
                break
            while pending and len(cache) < cache.slots and rng.random() < 0.7:
                request = pending.pop(0)
                cache.allocate([request])
                seen[request], outputs[request], left[request] = [], [], rng.randint(3, 9)
            running = [r for r in left if r in cache]
            if not running:
                continue
            seed += 1
            fresh = [r for r in running if not seen[r]]
            if not fresh and step % 3 == 0:  # a batched decode step: [B, 1, hidden]
                x = inputs(len(running), 1, seed=seed)
                y = run_stack(stack, x, cache=cache.batch(running))
                new = {r: (x[i], y[i]) for i, r in enumerate(running)}
            else:
                counts = {r: (rng.randint(2, 6) if not seen[r] else rng.choice([1, 1, 2])) for r in running}
                x = inputs(1, sum(counts.values()), seed=seed)[0]
                pieces = dict(zip(running, x.split(list(counts.values()))))
                y = packed_call(stack, cache, pieces)
                new = {r: (pieces[r], y[r]) for r in running}
            for request, (tokens, out) in new.items():
                seen[request].append(tokens)
                outputs[request].append(out)
                left[request] -= 1
                if left[request] == 0:
                    cache.free(request)
                    del left[request]
                    finished.append(request)
            if pointers is None:
                pointers = [(s.recurrent_pool.data_ptr(), s.conv_pool.data_ptr()) for s in cache.layers.values()]
        assert len(finished) == 8 and len(cache) == 0
        assert [(s.recurrent_pool.data_ptr(), s.conv_pool.data_ptr()) for s in cache.layers.values()] == pointers
        for request in finished:
            assert close(torch.cat(outputs[request]), alone(stack, torch.cat(seen[request]))), request


def test_fork_continues_both_branches_and_keeps_the_source() -> None:
    """A forked request (a beam) shares its source's rows; continuing either one alone, then
    both in one call, gives each the outputs of its own whole sequence: the write of one
    never reaches the other's states. Three slots suffice for two requests (one spare)."""
    stack = make_stack()
    prompt, a_tail, b_tail = inputs(1, 7)[0], inputs(1, 5, seed=2)[0], inputs(1, 5, seed=3)[0]
    cache = GatedDeltaNetPoolCache(slots=3)
    with torch.no_grad():
        cache.allocate(["a"])
        packed_call(stack, cache, {"a": prompt})
        cache.fork("a", "b")
        out = {"a": [], "b": []}
        # b alone (the source is outside the call), then a alone, then both together.
        out["b"].append(packed_call(stack, cache, {"b": b_tail[:1]})["b"])
        out["a"].append(packed_call(stack, cache, {"a": a_tail[:2]})["a"])
        for t in range(1, 4):
            y = run_stack(stack, torch.stack([b_tail[t : t + 1], a_tail[t + 1 : t + 2]]), cache=cache.batch(["b", "a"]))
            out["b"].append(y[0])
            out["a"].append(y[1])
        assert close(torch.cat(out["a"]), alone(stack, torch.cat([prompt, a_tail]))[7:])
        assert close(torch.cat(out["b"]), alone(stack, torch.cat([prompt, b_tail[:4]]))[7:])
        # A fork of a fork, both written in one call right away (prefill of two tokens each).
        cache.free("a")
        cache.fork("b", "c")
        y = packed_call(stack, cache, {"c": a_tail[:2], "b": b_tail[4:5]})
        assert close(y["b"], alone(stack, torch.cat([prompt, b_tail]))[-1:])
        assert close(y["c"], alone(stack, torch.cat([prompt, b_tail[:4], a_tail[:2]]))[-2:])


def test_fork_right_after_allocate_then_both_written_in_one_call() -> None:
    """A fork made before the source's first call shares its home row while no layer has a
    row for either yet (no reader): the first call writing both must still give one of them
    a fresh row (copy-on-write decided by the count of sharers, not by readers only), so
    both prompts in one call, then both decoded in one call, each equal its request alone."""
    stack = make_stack()
    prompt_a, prompt_b = inputs(1, 5, seed=11)[0], inputs(1, 3, seed=12)[0]
    tail_a, tail_b = inputs(1, 1, seed=13)[0], inputs(1, 1, seed=14)[0]
    cache = GatedDeltaNetPoolCache(slots=3)
    with torch.no_grad():
        cache.allocate(["a"])
        cache.fork("a", "b")
        y = packed_call(stack, cache, {"a": prompt_a, "b": prompt_b})
        step = run_stack(stack, torch.stack([tail_a, tail_b]), cache=cache.batch(["a", "b"]))
    assert close(y["a"], alone(stack, prompt_a)) and close(y["b"], alone(stack, prompt_b))
    assert close(step[0], alone(stack, torch.cat([prompt_a, tail_a]))[-1:])
    assert close(step[1], alone(stack, torch.cat([prompt_b, tail_b]))[-1:])


def test_reorder_selects_the_requests_of_a_call() -> None:
    """``cache.reorder(ids)`` then ``layer(x, cache=cache)``: row i belongs to ids[i], in any
    order and subset."""
    stack = make_stack()
    prompts, tails = inputs(3, 6), inputs(3, 3, seed=9)
    cache = GatedDeltaNetPoolCache(slots=3)
    with torch.no_grad():
        cache.allocate(["x", "y", "z"])
        cache.reorder(["x", "y", "z"])
        run_stack(stack, prompts, cache=cache)
        cache.reorder(["z", "x"])
        y = run_stack(stack, tails[[2, 0]], cache=cache)
    for i, request in enumerate([2, 0]):
        assert close(y[i], alone(stack, torch.cat([prompts[request], tails[request]]))[6:])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_cache_keeps_its_states(how: str) -> None:
    """A copy continues each request as the original does, and writing one never changes the other."""
    stack = make_stack()
    prompt, tail_1, tail_2 = inputs(2, 5), inputs(2, 2, seed=4), inputs(2, 2, seed=5)
    cache = GatedDeltaNetPoolCache(slots=2)
    with torch.no_grad():
        cache.allocate(["p", "q"])
        run_stack(stack, prompt, cache=cache.batch(["p", "q"]))
        copied = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
        y_copy = run_stack(stack, tail_2, cache=copied.batch(["p", "q"]))
        y_orig = run_stack(stack, tail_1, cache=cache.batch(["p", "q"]))
    for i in range(2):
        assert close(y_orig[i], alone(stack, torch.cat([prompt[i], tail_1[i]]))[5:])
        assert close(y_copy[i], alone(stack, torch.cat([prompt[i], tail_2[i]]))[5:])


def test_pool_equals_the_per_sequence_cache() -> None:
    """Prefill then decode steps through the pool cache == the same calls through GatedDeltaNetCache."""
    layer = make_layer("torch").eval()
    x = inputs(2, 9)
    pool_cache, cache = GatedDeltaNetPoolCache(slots=4), GatedDeltaNetCache()
    with torch.no_grad():
        pool_cache.allocate([7, 3])
        pooled = [layer(x[:, :6], cache=pool_cache.batch([7, 3]))]
        plain = [layer(x[:, :6], cache=cache)]
        for t in range(6, 9):
            pooled.append(layer(x[:, t : t + 1], cache=pool_cache.batch([7, 3])))
            plain.append(layer(x[:, t : t + 1], cache=cache))
    assert close(torch.cat(pooled, 1), torch.cat(plain, 1))
    assert pool_cache.get_seq_length(7) == 9 and cache.get_seq_length() == 9


def test_errors_name_the_argument() -> None:
    layer = make_layer("torch").eval()
    cache = GatedDeltaNetPoolCache(slots=2)
    with pytest.raises(ValueError, match="slots"):
        GatedDeltaNetPoolCache(slots=0)
    cache.allocate(["a"])
    with pytest.raises(ValueError, match="request_ids: request id 'a' is already allocated"):
        cache.allocate(["a"])
    with pytest.raises(ValueError, match="request_ids: expected distinct"):
        cache.allocate(["b", "b"])
    with pytest.raises(ValueError, match="request_ids: needs 2 free slot"):
        cache.allocate(["b", "c"])
    assert "b" not in cache  # nothing allocated by the failed call
    with pytest.raises(ValueError, match="request_ids: unknown request id 'zz'"):
        cache.batch(["a", "zz"])
    with pytest.raises(ValueError, match="request_ids: unknown request id 'zz'"):
        cache.reorder(["zz"])
    with pytest.raises(ValueError, match="request_id: unknown request id 'zz'"):
        cache.free("zz")
    with pytest.raises(ValueError, match="src_request_id: unknown request id 'zz'"):
        cache.fork("zz", "d")
    cache.fork("a", "b")
    with pytest.raises(ValueError, match="new_request_id: the cache already holds 2 requests"):
        cache.fork("a", "c")
    with pytest.raises(ValueError, match="new_request_id: request id 'b' is already allocated"):
        cache.fork("a", "b")
    with pytest.raises(ValueError, match="request_ids: expected one request per sequence, 2"):
        with torch.no_grad():
            layer(inputs(2, 3), cache=cache.batch(["a"]))
    with pytest.raises(ValueError, match="for inference"):
        layer(inputs(1, 3), cache=cache.batch(["a"]))
    with pytest.raises(ValueError, match="attention_mask: not supported"), torch.no_grad():
        layer(inputs(1, 3), attention_mask=torch.ones(1, 3), cache=cache.batch(["a"]))


@pytest.mark.parametrize("ids", ["ab", b"ab", bytearray(b"ab")], ids=["str", "bytes", "bytearray"])
def test_allocate_of_a_string_of_ids_raises_type_error(ids) -> None:
    """A ``str`` or ``bytes`` is iterable, but its characters are not the request ids meant:
    ``TypeError`` naming the argument, and nothing allocated."""
    cache = GatedDeltaNetPoolCache(slots=4)
    with pytest.raises(TypeError, match=r"^request_ids: expected an iterable of request ids .*got a "
                                        rf"{type(ids).__name__}"):
        cache.allocate(ids)
    assert len(cache) == 0 and not any(i in cache for i in ("a", "b", "ab", 97, 98))
    assert cache.allocate(["ab"]).tolist() == [0]  # the id itself, in a list
