"""GatedDeltaNetCache updated in place in inference (issue 39): the layer's decode writes each
layer's recurrent state into the tensor the cache owns, with results equal to the whole
sequence run at once (float64 layer), and copies (copy.copy, deepcopy, pickle), reorder
(beam search) and detach keeping their states; eagerly and under torch.compile(fullgraph=True)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache

HIDDEN = 32
PROMPT, TOTAL = 5, 8


def _layer(backend: str) -> GatedDeltaNet:
    """A small layer in eval mode with mild decays (the carried state matters); float64 on
    the pure-torch backend, float32 on the fused CPU kernels (which take no float64)."""
    torch.manual_seed(0)
    dtype = torch.float64 if backend == "torch" else torch.float32
    layer = GatedDeltaNet(HIDDEN, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, backend=backend).to(dtype)
    with torch.no_grad():
        layer.A_log.uniform_(-3.0, -1.0)
        layer.dt_bias.normal_(0.0, 0.5)
    return layer.eval()


def _x(layer: GatedDeltaNet, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, TOTAL, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=layer.A_log.dtype)


def _tol(layer: GatedDeltaNet) -> float:
    return 1e-10 if layer.A_log.dtype == torch.float64 else 1e-5


def _whole(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and final recurrent state of the whole sequence in one call (chunked op)."""
    cache = GatedDeltaNetCache()
    y = layer(x, cache=cache)
    return y, cache.get(layer.cache_key).recurrent_state


def _maybe_compiled(layer: GatedDeltaNet, compiled: bool):
    if not compiled:
        return layer
    torch._dynamo.reset()
    return torch.compile(layer, fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_decode_updates_the_owned_state_in_place(backend: str, compiled: bool) -> None:
    layer = _layer(backend)
    step = _maybe_compiled(layer, compiled)
    x = _x(layer)
    with torch.no_grad():
        want_y, want_state = _whole(layer, x)
        cache = GatedDeltaNetCache()
        ys = [layer(x[:, :PROMPT], cache=cache)]
        state = cache.get(layer.cache_key).recurrent_state
        pointer = state.data_ptr()
        ys += [step(x[:, t : t + 1], cache=cache) for t in range(PROMPT, TOTAL)]
    entry = cache.get(layer.cache_key)
    assert entry.recurrent_state.data_ptr() == pointer and entry.num_tokens == TOTAL
    assert (torch.cat(ys, 1) - want_y).abs().max().item() < _tol(layer)
    assert (state - want_state).abs().max().item() < _tol(layer)


@pytest.mark.parametrize(("how", "compiled"), [("copy", False), ("copy", True), ("deepcopy", False),
                                               ("pickle", False), ("pickle", True)])
def test_a_copy_keeps_its_states_while_the_original_decodes(how: str, compiled: bool) -> None:
    layer = _layer("cpu")
    step = _maybe_compiled(layer, compiled)
    x = _x(layer)
    fork_how = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c))}[how]
    with torch.no_grad():
        want_y, _ = _whole(layer, x)
        cache = GatedDeltaNetCache()
        layer(x[:, :PROMPT], cache=cache)
        snapshot = cache.get(layer.cache_key).recurrent_state.clone()
        fork = fork_how(cache)
        for t in range(PROMPT, TOTAL):  # the original decodes to the end
            step(x[:, t : t + 1], cache=cache)
        assert torch.equal(fork.get(layer.cache_key).recurrent_state, snapshot)
        assert fork.get_seq_length() == PROMPT
        # the fork continues from the prompt's states, and its decode leaves the original alone
        done = cache.get(layer.cache_key).recurrent_state.clone()
        from_fork = [step(x[:, t : t + 1], cache=fork) for t in range(PROMPT, TOTAL)]
    assert torch.equal(cache.get(layer.cache_key).recurrent_state, done)
    assert (torch.cat(from_fork, 1) - want_y[:, PROMPT:]).abs().max().item() < 1e-5


@pytest.mark.parametrize("compiled", [False, True])
def test_reorder_keeps_the_states_it_was_given(compiled: bool) -> None:
    """Beam search: ``reorder`` gives the cache new tensors, so a state held from before
    (another beam's) is not changed by decoding the reordered cache, and row i continues
    sequence ``index[i]``."""
    layer = _layer("cpu")
    step = _maybe_compiled(layer, compiled)
    x = _x(layer, batch=3)
    index = torch.tensor([2, 0, 0])
    with torch.no_grad():
        want_y, _ = _whole(layer, x[index])
        cache = GatedDeltaNetCache()
        layer(x[:, :PROMPT], cache=cache)
        held = cache.get(layer.cache_key).recurrent_state
        snapshot = held.clone()
        cache.reorder(index)
        ys = [step(x[index, t : t + 1], cache=cache) for t in range(PROMPT, TOTAL)]
    assert torch.equal(held, snapshot)
    assert cache.get(layer.cache_key).recurrent_state.data_ptr() != held.data_ptr()
    assert (torch.cat(ys, 1) - want_y[:, PROMPT:]).abs().max().item() < 1e-5


def test_detached_and_recorded_states_are_replaced_not_written() -> None:
    """After ``detach`` (a state sharing memory with a graph) the next call replaces the
    state, and calls autograd records never write in place (the graph's saved state stays
    valid: backward runs)."""
    layer = _layer("torch").train(False)
    x = _x(layer)
    cache = GatedDeltaNetCache()
    y = layer(x[:, :PROMPT], cache=cache)  # grad mode on, parameters require grad: recorded
    recorded = cache.get(layer.cache_key).recurrent_state
    assert recorded.requires_grad
    y_step = layer(x[:, PROMPT : PROMPT + 1], cache=cache)
    assert cache.get(layer.cache_key).recurrent_state.data_ptr() != recorded.data_ptr()
    (y.sum() + y_step.sum()).backward()  # the first call's saved tensors were not modified
    cache.detach()
    held = cache.get(layer.cache_key).recurrent_state
    snapshot = held.clone()
    with torch.no_grad():
        layer(x[:, PROMPT + 1 : PROMPT + 2], cache=cache)
        replaced = cache.get(layer.cache_key).recurrent_state
        assert torch.equal(held, snapshot) and replaced.data_ptr() != held.data_ptr()
        layer(x[:, PROMPT + 2 : PROMPT + 3], cache=cache)  # now its own: in place
    assert cache.get(layer.cache_key).recurrent_state.data_ptr() == replaced.data_ptr()


def test_a_state_given_by_the_caller_is_never_written() -> None:
    layer = _layer("cpu")
    x = _x(layer)
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        layer(x[:, :PROMPT], cache=cache)
        entry = cache.get(layer.cache_key)
        mine = entry.recurrent_state.clone()
        cache.update(layer.cache_key, entry.conv_state, mine, 0)
        snapshot = mine.clone()
        layer(x[:, PROMPT : PROMPT + 1], cache=cache)
    assert torch.equal(mine, snapshot)
