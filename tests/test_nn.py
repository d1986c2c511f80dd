"""torch_gdr.nn: the Gated DeltaNet layer, its short conv, and decoding with the cache."""

from __future__ import annotations

import pytest
import torch

from torch_gdr.nn import GatedDeltaNet, GatedDeltaNetCache, causal_depthwise_conv1d

BACKENDS = ["torch", "recurrent"]
HIDDEN = 32


def make_layer(backend: str | None = "torch", dtype: torch.dtype = torch.float32, seed: int = 0,
               **kwargs) -> GatedDeltaNet:
    """A small layer (2 q/k heads, 4 value heads) with realistic, mild decays so that the
    carried state matters (Qwen3-Next's init, A up to 16, forgets within a token or two)."""
    torch.manual_seed(seed)
    layer = GatedDeltaNet(HIDDEN, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, backend=backend,
                          **kwargs).to(dtype)
    with torch.no_grad():
        layer.A_log.uniform_(-3.0, -1.0)  # A in [0.05, 0.37]: g about -0.1 per token
        layer.dt_bias.normal_(0.0, 0.5)
        layer.norm.weight.normal_(1.0, 0.1)
    return layer


def inputs(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def decode(layer: GatedDeltaNet, x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Prefill ``x[:, :prompt_len]`` then feed the rest one token at a time."""
    cache = GatedDeltaNetCache()
    outputs = [layer(x[:, :prompt_len], cache=cache)]
    for t in range(prompt_len, x.shape[1]):
        outputs.append(layer(x[:, t : t + 1], cache=cache))
    assert cache.get_seq_length() == x.shape[1]
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_dtypes_and_grad(backend: str) -> None:
    layer = make_layer(backend)
    x = inputs(2, 19).requires_grad_()
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_parameter_names_and_shapes() -> None:
    layer = GatedDeltaNet(HIDDEN, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel_size=3)
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "in_proj_qkvz.weight": (2 * 16 + 2 * 24, HIDDEN),
        "in_proj_ba.weight": (8, HIDDEN),
        "conv1d.weight": (2 * 16 + 24, 1, 3),
        "dt_bias": (4,),
        "A_log": (4,),
        "norm.weight": (6,),
        "out_proj.weight": (HIDDEN, 24),
    }
    assert torch.all(layer.A_log.exp() >= 0.01 - 1e-6) and torch.all(layer.A_log.exp() <= 16 + 1e-4)
    with pytest.raises(ValueError):
        GatedDeltaNet(HIDDEN, num_heads=3, num_v_heads=4)


def test_bfloat16_forward_runs() -> None:
    layer = make_layer(dtype=torch.bfloat16)
    x = inputs(2, 9, dtype=torch.bfloat16)
    reference = make_layer(dtype=torch.float32)(x.float())
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert (y.float() - reference).abs().max() < 0.1 * reference.abs().max() + 0.05


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt_len", [1, 13])
def test_decode_equals_forward(backend: str, prompt_len: int) -> None:
    """Prefill + one token at a time == one forward of the whole sequence (fp32, 1e-5); batch of 3."""
    layer = make_layer(backend)
    x = inputs(3, 24)
    with torch.no_grad():
        full = layer(x)
        stepped = decode(layer, x, prompt_len)
    assert (stepped - full).abs().max().item() < 1e-5


def test_decode_backend_and_float64() -> None:
    layer = make_layer("torch", dtype=torch.float64, decode_backend="recurrent")
    x = inputs(2, 20, dtype=torch.float64)
    with torch.no_grad():
        assert (decode(layer, x, 7) - layer(x)).abs().max().item() < 1e-12


def test_gradients_flow_through_decode() -> None:
    """Autograd through prefill and every decode step gives the full forward's gradients."""
    layer = make_layer("torch", dtype=torch.float64)
    x = inputs(2, 12, dtype=torch.float64)
    weight = torch.randn(2, 12, HIDDEN, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def grads(run):
        layer.zero_grad()
        xx = x.clone().requires_grad_()
        (run(xx) * weight).sum().backward()
        return [xx.grad] + [p.grad.clone() for p in layer.parameters()]

    for a, b in zip(grads(layer), grads(lambda xx: decode(layer, xx, 5))):
        assert (a - b).abs().max().item() < 1e-10


def test_cache_feeds_back_across_chunks() -> None:
    """Prompt in three multi-token pieces through the cache == one call."""
    layer = make_layer("torch")
    x = inputs(2, 40)
    cache = GatedDeltaNetCache()
    with torch.no_grad():
        pieces = [layer(x[:, a:b], cache=cache) for a, b in ((0, 2), (2, 21), (21, 40))]
        assert (torch.cat(pieces, 1) - layer(x)).abs().max().item() < 1e-5


@pytest.mark.parametrize("layer_idx", [None, 0])
def test_a_reordered_cache_continues_each_kept_sequence(layer_idx) -> None:
    """``cache.reorder(index)`` as beam search uses it (drop, permute and duplicate rows): row
    i of the reordered cache continues sequence ``index[i]``, so decoding from it equals
    running that sequence's prompt and continuation whole."""
    layer = make_layer("torch", layer_idx=layer_idx)
    prompts = inputs(3, 11)
    index = torch.tensor([2, 0, 0])
    continuation = inputs(3, 4, seed=7)  # row i continues prompt index[i]
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        layer(prompts, cache=cache)
        cache.reorder(index)
        steps = torch.cat([layer(continuation[:, t : t + 1], cache=cache) for t in range(4)], dim=1)
        whole = layer(torch.cat([prompts[index], continuation], dim=1))
    assert cache.get(layer.cache_key).recurrent_state.shape[0] == 3
    assert (steps - whole[:, 11:]).abs().max().item() < 1e-5


def _stack_decode(layers: list[GatedDeltaNet], x: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """A stack of layers sharing one cache: prefill ``x[:, :prompt_len]``, then one token at a time."""
    cache = GatedDeltaNetCache()

    def stack(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = layer(h, cache=cache)
        return h

    outputs = [stack(x[:, :prompt_len])] + [stack(x[:, t : t + 1]) for t in range(prompt_len, x.shape[1])]
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("indices", [(None, None), (0, 1), (None, 0)])
def test_layers_sharing_a_cache_keep_their_own_states(indices: tuple) -> None:
    """Two layers on one cache, built without layer_idx (each filed under itself), with
    distinct indices (transformers' numbering) or one of each: decoding the stack equals
    running it on the whole sequence."""
    layers = [make_layer(seed=seed, layer_idx=idx) for seed, idx in zip((0, 1), indices)]
    x = inputs(2, 12)
    with torch.no_grad():
        want = layers[1](layers[0](x))
        got = _stack_decode(layers, x, prompt_len=7)
    assert (got - want).abs().max().item() < 1e-5


def test_two_layers_with_one_layer_idx_on_one_cache_raise() -> None:
    layers = [make_layer(seed=seed, layer_idx=3) for seed in (0, 1)]
    with torch.no_grad(), pytest.raises(ValueError, match="layer_idx"):
        _stack_decode(layers, inputs(2, 6), prompt_len=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend: str) -> None:
    """Packed ``[1, T]`` + cu_seqlens == each sequence alone == a right-padded batch with a mask;
    the conv never reads across a boundary, and the packed prefill's cache decodes as a batch."""
    layer = make_layer(backend)
    lengths = [5, 0, 17, 2, 9]
    seqs = [inputs(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0)
    with torch.no_grad():
        packed_cache = GatedDeltaNetCache()
        packed = layer(torch.cat(seqs, dim=1), cu_seqlens=cu_seqlens, cache=packed_cache)
        alone = torch.cat([layer(s) for s in seqs if s.shape[1]], dim=1)
        assert (packed - alone).abs().max().item() < 1e-5

        longest = max(lengths)
        padded = torch.zeros(len(lengths), longest, HIDDEN)
        mask = torch.zeros(len(lengths), longest)
        for i, s in enumerate(seqs):
            padded[i, : s.shape[1]] = s[0]
            mask[i, : s.shape[1]] = 1
        out = layer(padded, attention_mask=mask)
        assert (out[mask.bool()] - packed[0]).abs().max().item() < 1e-5

        # Continue every packed sequence by three tokens, as one batch.
        nxt = inputs(len(lengths), 3, seed=99)
        stepped = torch.cat([layer(nxt[:, t : t + 1], cache=packed_cache) for t in range(3)], dim=1)
        for i, s in enumerate(seqs):
            whole = layer(torch.cat([s, nxt[i : i + 1]], dim=1))
            assert (whole[:, -3:] - stepped[i : i + 1]).abs().max().item() < 1e-5


def test_left_padding_mask_then_decode() -> None:
    """Left-padded batch (as in generation): real tokens' outputs and the decode afterwards
    equal those of each unpadded sequence."""
    layer = make_layer("torch")
    lengths = [11, 4, 2]
    total, extra = 11, 4
    seqs = [inputs(1, n + extra, seed=20 + i) for i, n in enumerate(lengths)]
    x = torch.zeros(3, total, HIDDEN)
    mask = torch.zeros(3, total, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        x[i, total - n :] = s[0, :n]
        x[i, : total - n] = 7.0  # garbage in the padding must not matter
        mask[i, total - n :] = 1
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        prompt_out = layer(x, attention_mask=mask, cache=cache)
        steps = [layer(torch.cat([s[:, n + t : n + t + 1] for s, n in zip(seqs, lengths)]), cache=cache)
                 for t in range(extra)]
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            whole = layer(s)
            assert (prompt_out[i, total - n :] - whole[0, :n]).abs().max().item() < 1e-5
            got = torch.cat([st[i] for st in steps])
            assert (got - whole[0, n:]).abs().max().item() < 1e-5


def test_padded_decode_token_leaves_state_alone() -> None:
    layer = make_layer("torch")
    x = inputs(2, 6)
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        layer(x[:, :4], cache=cache)
        entry = cache.get(layer.cache_key)  # its recurrent state is updated in place: keep copies
        before_state, before_conv = entry.recurrent_state.clone(), entry.conv_state.clone()
        layer(x[:, 4:5], attention_mask=torch.tensor([[0], [1]]), cache=cache)
        after = cache.get(layer.cache_key)
        assert torch.equal(after.recurrent_state[0], before_state[0])
        assert torch.equal(after.conv_state[0], before_conv[0])
        assert not torch.equal(after.recurrent_state[1], before_state[1])


@pytest.mark.parametrize("with_state", [False, True])
def test_short_conv_packed_matches_batch(with_state: bool) -> None:
    torch.manual_seed(3)
    weight, bias = torch.randn(6, 1, 4), torch.randn(6)
    lengths = [3, 0, 1, 7]
    seqs = [torch.randn(1, n, 6) for n in lengths]
    states = torch.randn(4, 6, 3) if with_state else None
    cu = torch.tensor([0] + lengths).cumsum(0)
    y, final = causal_depthwise_conv1d(torch.cat(seqs, 1), weight, bias, "silu", states, True, cu)
    pieces, finals = [], []
    for i, s in enumerate(seqs):
        init = None if states is None else states[i : i + 1]
        yi, fi = causal_depthwise_conv1d(s, weight, bias, "silu", init, True)
        pieces.append(yi)
        finals.append(fi)
    assert torch.allclose(y, torch.cat(pieces, 1), atol=1e-6)
    assert torch.allclose(final, torch.cat(finals), atol=1e-6)
    # The batch path against torch's own conv (zero left padding).
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(seqs[3].transpose(1, 2), weight, bias, padding=3,
                                                              groups=6)[..., :7]).transpose(1, 2)
    assert torch.allclose(causal_depthwise_conv1d(seqs[3], weight, bias)[0], ref, atol=1e-6)


def test_bad_inputs_raise() -> None:
    layer = make_layer()
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(inputs(2, 4), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="attention_mask"):
        layer(inputs(2, 4), attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="hidden_states"):
        layer(torch.randn(2, 4, HIDDEN + 1))



@pytest.mark.parametrize("settings, error, argument", [
    ({"head_k_dim": 0}, ValueError, "head_k_dim"),
    ({"head_v_dim": -1}, ValueError, "head_v_dim"),
    ({"num_heads": 0}, ValueError, "num_heads"),
    ({"num_v_heads": 3}, ValueError, "num_v_heads"),
    ({"hidden_size": 0}, ValueError, "hidden_size"),
    ({"conv_kernel_size": 4.0}, TypeError, "conv_kernel_size"),
    ({"layer_idx": -1}, ValueError, "layer_idx"),
    ({"layer_idx": "0"}, TypeError, "layer_idx"),
    ({"backend": "nope"}, ValueError, "backend"),
    ({"backend": 1}, TypeError, "backend"),
    ({"decode_backend": "Recurrant"}, ValueError, "decode_backend"),
    ({"dtype": torch.int32}, TypeError, "dtype"),
    ({"dtype": torch.bool}, TypeError, "dtype"),
    ({"dtype": "float32"}, TypeError, "dtype"),
    ({"chunk_size": 48}, ValueError, "chunk_size"),
    ({"chunk_size": 64.0}, TypeError, "chunk_size"),
    ({"chunk_size": True}, TypeError, "chunk_size"),
    ({"recurrent_max_len": "abc"}, TypeError, "recurrent_max_len"),
    ({"recurrent_max_len": 2.5}, TypeError, "recurrent_max_len"),
    ({"recurrent_max_len": True}, TypeError, "recurrent_max_len"),
    ({"recurrent_max_len": -5}, ValueError, "recurrent_max_len"),
])
def test_bad_settings_raise_when_the_layer_is_built(settings: dict, error: type, argument: str) -> None:
    config = {"hidden_size": HIDDEN, "num_heads": 2, "num_v_heads": 4, "head_k_dim": 8, "head_v_dim": 8, **settings}
    with pytest.raises(error, match=f"^{argument}: "):
        GatedDeltaNet(**config)


def test_backend_names_are_stripped_and_lower_cased_as_the_variable_is() -> None:
    """``backend=" CPU "`` names "cpu", as ``TORCH_GDR_BACKEND=" CPU "`` does: the layer keeps
    the name the op reads and gives the outputs of ``backend="cpu"``."""
    layer = make_layer(" CPU ", decode_backend="\tTorch\n")
    assert (layer.backend, layer.decode_backend) == ("cpu", "torch")
    x = inputs(2, 5)
    with torch.no_grad():
        got = layer(x)
        layer.backend = "cpu"
        want = layer(x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_recurrent_max_len_zero_is_allowed() -> None:
    """0 turns the fused-recurrent step off; it is a setting, not an error."""
    assert make_layer(recurrent_max_len=0).recurrent_max_len == 0


@pytest.mark.parametrize("model", ["not a model", None, [torch.nn.Linear(2, 2)]])
def test_use_torch_gdr_of_something_else_than_a_module_raises(model) -> None:
    from torch_gdr.integrations.transformers import use_torch_gdr

    with pytest.raises(TypeError, match=r"^model: expected a torch\.nn\.Module .*, got "):
        use_torch_gdr(model)


@pytest.mark.parametrize("layer_dtype, input_dtype", [(torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, torch.float32),
                                                      (torch.float32, torch.int64)])
def test_an_input_of_another_dtype_than_the_layer_raises(layer_dtype, input_dtype) -> None:
    layer = make_layer(dtype=layer_dtype)
    x = inputs(2, 3).to(input_dtype)
    pattern = f"^hidden_states: expected dtype {layer_dtype} .*got {input_dtype}"
    with pytest.raises(TypeError, match=pattern):
        layer(x)


def test_an_input_of_another_dtype_runs_under_autocast() -> None:
    """Under autocast the projections cast for themselves: no dtype check there."""
    layer = make_layer()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(inputs(2, 3).bfloat16())
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("settings, error", [
    ({"backend": "nope"}, ValueError), ({"backend": 1}, TypeError),
    ({"chunk_size": 48}, ValueError), ({"chunk_size": 64.0}, TypeError),
])
def test_use_torch_gdr_checks_its_settings(settings: dict, error: type) -> None:
    """Before it looks at the model (a model without Gated DeltaNet layers raises otherwise)."""
    from torch_gdr.integrations.transformers import use_torch_gdr

    with pytest.raises(error, match=f"^{next(iter(settings))}: "):
        use_torch_gdr(torch.nn.Linear(2, 2), **settings)


@pytest.mark.parametrize("shape", [(2, 0), (0, 4)])
def test_empty_batch_or_sequence_raises(shape: tuple) -> None:
    with pytest.raises(ValueError, match="^hidden_states: .*B >= 1 and T >= 1"):
        make_layer()(inputs(*shape))


@pytest.mark.parametrize("mask", [
    torch.tensor([[1.0, 0.5, 1.0], [1.0, 1.0, 1.0]]),
    torch.tensor([[1, 2, 1], [0, 1, 1]]),
    torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, 1.0]]),
])
def test_attention_mask_other_than_zero_and_one_raises(mask: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="^attention_mask: expected 0 .* and 1"):
        make_layer()(inputs(2, 3), attention_mask=mask)


def test_float_and_bool_masks_of_zeros_and_ones_agree() -> None:
    layer = make_layer()
    x = inputs(2, 5)
    ints = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        by_int = layer(x, attention_mask=ints)
        assert torch.equal(layer(x, attention_mask=ints.float()), by_int)
        assert torch.equal(layer(x, attention_mask=ints.bool()), by_int)


@pytest.mark.parametrize("cu_seqlens", [None, torch.tensor([0, 1, 2, 3])])
def test_decode_with_another_batch_size_than_the_cache_raises(cu_seqlens) -> None:
    layer = make_layer()
    cache = GatedDeltaNetCache()
    with torch.no_grad():
        layer(inputs(2, 5), cache=cache)
        step = inputs(3, 1) if cu_seqlens is None else inputs(1, 3)
        with pytest.raises(ValueError, match="^cache: the cache holds 2 sequences and 3 were given"):
            layer(step, cu_seqlens=cu_seqlens, cache=cache)

def test_integrations_are_reachable_without_importing_transformers() -> None:
    """``torch_gdr.integrations.transformers.use_torch_gdr`` as the README writes it, after a
    plain ``import torch_gdr``; neither that nor importing the layer and the integration
    imports transformers (one fresh process: importing torch is most of its time)."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch_gdr; use = torch_gdr.integrations.transformers.use_torch_gdr; "
            "assert callable(use), 'use_torch_gdr is not callable'; "
            "assert 'transformers' not in sys.modules, 'import torch_gdr imported transformers'; "
            "import torch_gdr.nn, torch_gdr.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'the layer or the integration imported transformers'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_layer_on_the_pypto_backend_prefills_and_decodes() -> None:
    """The layer on the PyPTO kernel (the interpreter on the CPU): prefill, then decode steps
    with a chunk size the kernel has, equal to the pure-torch layer."""
    from torch_gdr.ops.pypto import is_pypto_available  # imports pypto with its files redirected

    if not is_pypto_available():
        pytest.skip("pypto==0.2.0 (the npu extra) is not installed")
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, num_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64, backend="pypto")
    x = inputs(1, 40)
    got = decode(layer, x, prompt_len=38)
    layer.backend = "torch"
    want = decode(layer, x, prompt_len=38)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_compiled_layer_trains_across_lengths_and_packings() -> None:
    """``torch.compile(fullgraph=True)`` of the layer in training, through the recompile with
    a dynamic length and two packings: outputs and gradients equal the eager layer's. (With
    an ``F.conv1d`` in the graph, inductor's CPU layout optimisation gave the ``[B, T, H, K]``
    tensors next to it strides whose order depends on T > 1, and the compile failed at the
    second length.)"""
    torch._dynamo.reset()
    layer = make_layer(chunk_size=16)
    compiled = torch.compile(layer, fullgraph=True)
    calls = [(inputs(1, 20, seed=1), None), (inputs(1, 37, seed=2), None),
             (inputs(1, 45, seed=3), torch.tensor([0, 9, 45])), (inputs(1, 50, seed=4), torch.tensor([0, 30, 31, 50]))]
    for x, cu_seqlens in calls:
        results = []
        for module in (compiled, layer):
            layer.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_()
            y = module(leaf, cu_seqlens=cu_seqlens)
            y.square().sum().backward()
            results.append((y.detach(), leaf.grad, layer.in_proj_qkvz.weight.grad, layer.A_log.grad))
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("layer_idx", [None, 2])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_cache_continues_the_same_states(layer_idx, how: str) -> None:
    """Forking a cache (beam search, a shared prefix) by ``copy.deepcopy`` or pickle: the
    copy's decode continues the prompt's states exactly as the original's does, and it files
    the step under the same entry (one entry, not a second one from zeros)."""
    import copy
    import pickle

    layer = make_layer(layer_idx=layer_idx)
    x = inputs(2, 10)
    with torch.no_grad():
        whole = layer(x)
        cache = GatedDeltaNetCache()
        layer(x[:, :9], cache=cache)
        fork = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
        from_fork = layer(x[:, 9:], cache=fork)
        from_original = layer(x[:, 9:], cache=cache)
    assert len(fork) == 1 and fork.get_seq_length() == 10
    assert (from_fork - whole[:, 9:]).abs().max().item() < 1e-5
    assert torch.equal(from_fork, from_original)


def test_deep_copies_of_a_layer_sharing_a_cache_keep_their_own_states() -> None:
    """A stack built from deep copies of one layer (built without layer_idx), with weights
    changed after the copy: decoding the stack through one cache equals running it whole."""
    import copy

    first = make_layer(seed=0)
    second = copy.deepcopy(first)
    with torch.no_grad():
        second.in_proj_qkvz.weight.mul_(-0.5)
    assert second.cache_key != first.cache_key
    x = inputs(2, 12)
    with torch.no_grad():
        want = second(first(x))
        got = _stack_decode([first, second], x, prompt_len=7)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("decode_backend", [None, "recurrent"])
def test_right_padding_mask_then_decode(decode_backend) -> None:
    """Right-padded prompts (real tokens first, as a batch of prompts is often packed) prefilled
    into a cache, then decoded: the steps equal those of each unpadded sequence, the conv
    state included (it must hold each row's last real inputs, not the padding). Rows shorter
    than the conv's history and a row with no padding are in the batch."""
    layer = make_layer("torch", decode_backend=decode_backend)
    lengths = [9, 12, 2, 1]
    total, extra = 12, 3
    seqs = [inputs(1, n + extra, seed=40 + i) for i, n in enumerate(lengths)]
    x = torch.full((len(lengths), total, HIDDEN), 5.0)  # garbage in the padding must not matter
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, lengths)):
        x[i, :n] = s[0, :n]
        mask[i, :n] = 1
    with torch.no_grad():
        cache = GatedDeltaNetCache()
        prompt_out = layer(x, attention_mask=mask, cache=cache)
        steps = [layer(torch.cat([s[:, n + t : n + t + 1] for s, n in zip(seqs, lengths)]), cache=cache)
                 for t in range(extra)]
        for i, (s, n) in enumerate(zip(seqs, lengths)):
            whole = layer(s)
            assert (prompt_out[i, :n] - whole[0, :n]).abs().max().item() < 1e-5
            got = torch.cat([st[i] for st in steps])
            assert (got - whole[0, n:]).abs().max().item() < 1e-5, i


@pytest.mark.parametrize("training", [True, False], ids=["chunked", "token_by_token"])
def test_layer_passes_raw_gates_and_masks_padding_as_activated_gates_times_mask(training: bool) -> None:
    """The layer hands its raw gate, A_log, dt_bias and raw beta to the op; with a padding
    mask that gives the outputs and parameter gradients of the activated gates multiplied by
    the mask, written out here."""
    import torch.nn.functional as F

    import torch_gdr

    layer = make_layer(dtype=torch.float64).train(training)
    x = inputs(2, 7, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]], dtype=torch.float64)  # holes meet a carried state

    def by_hand() -> torch.Tensor:
        hidden = x * mask[..., None]
        mixed, z, b, a = layer._project(hidden)
        mixed, _ = layer.conv1d(mixed)
        q, k, v = mixed.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
        q, k = (t.unflatten(-1, (layer.num_k_heads, layer.head_k_dim)) for t in (q, k))
        v = v.unflatten(-1, (layer.num_v_heads, layer.head_v_dim))
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias) * mask[..., None]
        beta = b.sigmoid() * mask[..., None]
        o, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="recurrent")
        return layer.out_proj(layer.norm(o, z).flatten(-2))

    weights = torch.randn(2, 7, layer.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = []
    for forward in (lambda: layer(x, attention_mask=mask), by_hand):
        layer.zero_grad()
        out = forward()
        (out * weights).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (out, grads), (want, want_grads) = results
    assert torch.allclose(out, want, rtol=1e-9, atol=1e-10)
    for name in ("A_log", "dt_bias", "in_proj_ba.weight", "in_proj_qkvz.weight"):
        assert torch.allclose(grads[name], want_grads[name], rtol=1e-8, atol=1e-10), name
