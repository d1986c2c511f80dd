"""The fused-recurrent step path against the float64 per-token recurrence."""

from __future__ import annotations

import pytest
import torch

from functools import partial

import torch_gdr
from tests.helpers import make_inputs, rmse_ratio

# the pure-torch step (differentiable, every dtype); the exported function's other steps are
# checked against it and the recurrence below
fused_recurrent_gated_delta_rule = partial(torch_gdr.fused_recurrent_gated_delta_rule, backend="torch")
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

CASES = {
    # name: make_inputs keyword arguments (seq_len filled in by the test where absent)
    "plain": dict(),
    "batch_initial": dict(batch_size=3, with_initial_state=True),
    "gva": dict(num_qk_heads=1, num_v_heads=4, with_initial_state=True),
    "k_ne_v": dict(head_k_dim=8, head_v_dim=12, batch_size=2, with_initial_state=True),
    "strong_decay": dict(gate="strong", with_initial_state=True),
    "zero_decay": dict(gate="zero", with_initial_state=True),
}
VARLEN = {
    "ragged": [5, 0, 1, 7, 2],
    "decode_batch": [1, 1, 1],  # vLLM's decode batch: every sequence one token
    "all_empty": [0, 0],
}


def _leaves(inputs: dict) -> dict:
    return {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}


def _run(fn, inputs: dict, **kw):
    """Outputs, final state and the gradient of every float input of a random linear loss."""
    leaves = _leaves(inputs)
    o, s = fn(**leaves, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)
    dht = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(o.device)
    loss = (o.double() * do).sum() + (s.double() * dht).sum()
    names = [n for n, t in leaves.items() if t.requires_grad]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return o, s, dict(zip(names, grads))


def _assert_matches_recurrence(inputs: dict, atol: float = 1e-10, **kw) -> None:
    expected_o, expected_s, expected_grads = _run(naive_recurrent_gated_delta_rule, inputs, **kw)
    o, s, grads = _run(fused_recurrent_gated_delta_rule, inputs, **kw)
    assert o.shape == inputs["v"].shape and o.dtype == inputs["v"].dtype
    torch.testing.assert_close(o, expected_o, atol=atol, rtol=atol)
    torch.testing.assert_close(s, expected_s, atol=atol, rtol=atol)
    assert set(grads) == set(expected_grads)
    for name, expected in expected_grads.items():
        got = grads[name]
        if expected is None:
            assert got is None or not got.any(), name
            continue
        torch.testing.assert_close(got, expected, atol=atol, rtol=atol, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("use_l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("seq_len", [1, 2, 7, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_recurrence(case: str, seq_len: int, use_l2norm: bool) -> None:
    inputs = make_inputs(seq_len=seq_len, **CASES[case])
    if not use_l2norm:
        inputs["q"], inputs["k"] = inputs["q"] * 0.25, inputs["k"] * 0.25
    _assert_matches_recurrence(inputs, use_qk_l2norm_in_kernel=use_l2norm)


@pytest.mark.parametrize("seqlens", list(VARLEN.values()), ids=list(VARLEN))
def test_varlen_matches_recurrence(seqlens: list[int]) -> None:
    inputs = make_inputs(seqlens=seqlens, num_qk_heads=1, num_v_heads=2, with_initial_state=True)
    _assert_matches_recurrence(inputs, use_qk_l2norm_in_kernel=True)


def test_custom_scale_matches_recurrence() -> None:
    _assert_matches_recurrence(make_inputs(seq_len=7, with_initial_state=True), scale=0.3,
                               use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("seq_len", [1, 7])
def test_state_v_first_is_the_transpose(seq_len: int) -> None:
    inputs = make_inputs(seq_len=seq_len, batch_size=2, num_qk_heads=1, num_v_heads=2, head_k_dim=8,
                         head_v_dim=12, with_initial_state=True)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    v_first = dict(inputs, initial_state=inputs["initial_state"].transpose(-1, -2).contiguous())
    o, s = fused_recurrent_gated_delta_rule(**v_first, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            state_v_first=True)
    assert s.shape == (2, 2, 12, 8) and s.is_contiguous()
    torch.testing.assert_close(o, expected_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, expected_s.transpose(-1, -2), atol=1e-10, rtol=1e-10)
    # and its gradients: the v-first call is the key-first call on transposed states
    inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    _, _, grads = _run(fused_recurrent_gated_delta_rule, inputs, use_qk_l2norm_in_kernel=True, state_v_first=True)
    key_first = dict(inputs, initial_state=inputs["initial_state"].transpose(-1, -2))
    leaves = _leaves(key_first)
    o, s = naive_recurrent_gated_delta_rule(**leaves, use_qk_l2norm_in_kernel=True)
    gen = torch.Generator().manual_seed(7)
    do, dht = (torch.randn(shape, generator=gen, dtype=torch.float64).to(o.device)
               for shape in (o.shape, s.transpose(-1, -2).shape))
    loss = (o * do).sum() + (s.transpose(-1, -2) * dht).sum()
    expected = torch.autograd.grad(loss, leaves["initial_state"])[0].transpose(-1, -2)
    torch.testing.assert_close(grads["initial_state"], expected, atol=1e-10, rtol=1e-10)


def test_token_major_equals_batched() -> None:
    inputs = make_inputs(seqlens=[3, 4], with_initial_state=True)
    o, s = fused_recurrent_gated_delta_rule(**inputs, output_final_state=True)
    tnd = {n: (t.squeeze(0) if n in ("q", "k", "v", "g", "beta") else t) for n, t in inputs.items()}
    o_tnd, s_tnd = fused_recurrent_gated_delta_rule(**tnd, output_final_state=True)
    assert o_tnd.shape == o.shape[1:]
    torch.testing.assert_close(o_tnd, o.squeeze(0), atol=0, rtol=0)
    torch.testing.assert_close(s_tnd, s, atol=0, rtol=0)


def test_defaults_of_g_and_beta_are_no_decay_and_ones() -> None:
    inputs = make_inputs(seq_len=3, with_initial_state=True)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(
        **dict(inputs, g=torch.zeros_like(inputs["g"]), beta=torch.ones_like(inputs["beta"])))
    o, s = fused_recurrent_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"],
                                            initial_state=inputs["initial_state"], output_final_state=True)
    torch.testing.assert_close(o, expected_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, expected_s, atol=1e-10, rtol=1e-10)


def test_final_state_only_on_request_and_initial_state_untouched() -> None:
    inputs = make_inputs(seq_len=1, with_initial_state=True, dtype=torch.float32)
    inputs["initial_state"] = inputs["initial_state"].float()
    before = inputs["initial_state"].clone()
    with torch.no_grad():
        o, s = fused_recurrent_gated_delta_rule(**inputs)
        _, s_kept = fused_recurrent_gated_delta_rule(**inputs, output_final_state=True)
    assert s is None and s_kept is not None
    assert torch.equal(inputs["initial_state"], before)
    empty = make_inputs(seqlens=[0], with_initial_state=True)
    _, s_empty = fused_recurrent_gated_delta_rule(**empty, output_final_state=True)
    assert torch.equal(s_empty, empty["initial_state"]) and s_empty is not empty["initial_state"]


SINGLE_TOKEN = {  # the decode step's own path (one token, autograd off)
    "batched_gva": dict(batch_size=3, seq_len=1, num_qk_heads=1, num_v_heads=4, with_initial_state=True),
    "no_state": dict(batch_size=2, seq_len=1),
    "varlen_ones": dict(seqlens=[1, 1, 1], num_qk_heads=2, num_v_heads=4, with_initial_state=True),
    "varlen_some_empty": dict(seqlens=[1, 0, 1], with_initial_state=True),
    "strong_decay": dict(seq_len=1, gate="strong", with_initial_state=True),
}


@pytest.mark.parametrize("state_v_first", [False, True], ids=["key_first", "v_first"])
@pytest.mark.parametrize("use_l2norm", [True, False], ids=["l2norm", "raw"])
@pytest.mark.parametrize("case", list(SINGLE_TOKEN))
def test_single_token_without_autograd_matches_recurrence(case, use_l2norm, state_v_first) -> None:
    inputs = make_inputs(**SINGLE_TOKEN[case])
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=use_l2norm,
                                                              scale=0.7)
    if state_v_first and "initial_state" in inputs:
        inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    before = {n: t.clone() for n, t in inputs.items()}
    with torch.no_grad():
        o, s = fused_recurrent_gated_delta_rule(**inputs, output_final_state=True, scale=0.7,
                                                use_qk_l2norm_in_kernel=use_l2norm, state_v_first=state_v_first)
    if state_v_first:
        s = s.transpose(-1, -2)
    torch.testing.assert_close(o, expected_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(s, expected_s, atol=1e-12, rtol=1e-12)
    assert all(torch.equal(inputs[n], before[n]) for n in inputs), "inputs must not be written"


@pytest.mark.parametrize("state_v_first", [False, True], ids=["key_first", "v_first"])
def test_exported_no_grad_path_and_autograd_path_match_the_recurrence(state_v_first: bool) -> None:
    """The exported function takes two paths: with autograd the differentiable step, without
    it the fused kernel (the C++ step on CPU tensors of float32). Both, on float32 inputs with
    a scale of the caller's, ragged sequences and an initial state, against the float64
    recurrence on the same inputs."""
    import torch_gdr

    inputs = make_inputs(seqlens=[5, 1, 0, 23], num_qk_heads=1, num_v_heads=4, with_initial_state=True,
                         dtype=torch.float32)
    inputs["initial_state"] = inputs["initial_state"].float()
    expected_o, expected_s = naive_recurrent_gated_delta_rule(
        **{n: (t if n == "cu_seqlens" else t.double()) for n, t in inputs.items()}, scale=0.4,
        use_qk_l2norm_in_kernel=True)
    if state_v_first:
        inputs["initial_state"] = inputs["initial_state"].transpose(-1, -2).contiguous()
    options = dict(scale=0.4, output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=state_v_first)
    o, s = torch_gdr.fused_recurrent_gated_delta_rule(**_leaves(inputs), **options)
    with torch.no_grad():
        o_ng, s_ng = torch_gdr.fused_recurrent_gated_delta_rule(**inputs, **options)
    for got_o, got_s in ((o.detach(), s.detach()), (o_ng, s_ng)):
        if state_v_first:
            got_s = got_s.transpose(-1, -2)
        assert rmse_ratio(expected_o, got_o) < 1e-6
        assert rmse_ratio(expected_s, got_s) < 1e-6


# -- mixed input dtypes ------------------------------------------------------------------

MIXED = [
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float64, torch.float32),
]


@pytest.mark.parametrize("qk_dtype,v_dtype", MIXED, ids=[f"{a}-{b}".replace("torch.", "") for a, b in MIXED])
def test_mixed_dtypes_equal_the_call_on_inputs_converted_up_front(qk_dtype, v_dtype) -> None:
    base = make_inputs(seq_len=7, batch_size=2, num_qk_heads=1, num_v_heads=2, with_initial_state=True,
                       dtype=torch.float64)
    mixed = dict(base, q=base["q"].to(qk_dtype), k=base["k"].to(qk_dtype), v=base["v"].to(v_dtype),
                 g=base["g"].float(), beta=base["beta"].to(qk_dtype))
    wide = torch.float64 if torch.float64 in (qk_dtype, v_dtype) else torch.float32
    converted = dict(mixed, q=mixed["q"].to(wide), k=mixed["k"].to(wide), v=mixed["v"].to(wide))
    o, s = fused_recurrent_gated_delta_rule(**mixed, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = fused_recurrent_gated_delta_rule(**converted, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    assert o.dtype == v_dtype and s.dtype == wide
    torch.testing.assert_close(o, o_ref.to(v_dtype), atol=0, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    # gradients come back in each input's own dtype
    leaves = _leaves(mixed)
    o, s = fused_recurrent_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (o.float().sum() + s.float().sum()).backward()
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        assert leaves[name].grad.dtype == leaves[name].dtype and torch.isfinite(leaves[name].grad).all(), name


def test_mixed_dtypes_rule() -> None:
    """v may differ from q and k; q and k may not differ from each other."""
    inputs = make_inputs(seq_len=3, dtype=torch.float32)
    fused_recurrent_gated_delta_rule(**dict(inputs, v=inputs["v"].half()))
    with pytest.raises(TypeError, match="k: expected the dtype of q"):
        fused_recurrent_gated_delta_rule(**dict(inputs, k=inputs["k"].half()))
    with pytest.raises(TypeError, match="v: expected a floating dtype"):
        fused_recurrent_gated_delta_rule(**dict(inputs, v=inputs["v"].int()))
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        fused_recurrent_gated_delta_rule(**dict(inputs, q=[0.0]))


# -- bad input -----------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors() -> None:
    inputs = make_inputs(seq_len=2, num_qk_heads=2, num_v_heads=2)
    with pytest.raises(TypeError, match="k: expected the dtype of q"):
        fused_recurrent_gated_delta_rule(**dict(inputs, k=inputs["k"].float()))
    with pytest.raises(ValueError, match="v: the number of value heads"):
        fused_recurrent_gated_delta_rule(**dict(inputs, v=inputs["v"][:, :, :1].expand(-1, -1, 3, -1).float()))
    with pytest.raises(ValueError, match="initial_state: expected shape"):
        fused_recurrent_gated_delta_rule(**inputs, initial_state=inputs["q"].new_zeros(1, 2, 16, 15))
    with pytest.raises(ValueError, match="cu_seqlens: expected the last offset"):
        fused_recurrent_gated_delta_rule(**inputs, cu_seqlens=torch.tensor([0, 1]))  # on the CPU: allowed
    with pytest.raises(TypeError, match="cu_seqlens: expected dtype int32 or int64"):
        fused_recurrent_gated_delta_rule(**inputs, cu_seqlens=torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match="g: expected shape"):
        fused_recurrent_gated_delta_rule(**dict(inputs, g=inputs["g"][..., :1]))


# -- nn.GatedDeltaNet runs the step for decode and short prompts out of training ------------


@pytest.fixture
def step_calls(monkeypatch) -> list:
    import torch_gdr.functional as functional

    calls = []
    real = functional.fused_recurrent_gated_delta_rule

    def counting(q, *args, **kwargs):
        calls.append(q.shape[1])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(functional, "fused_recurrent_gated_delta_rule", counting)
    return calls


def _layer(**kwargs):
    from torch_gdr.nn import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(32, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, **kwargs)
    with torch.no_grad():
        layer.A_log.uniform_(-3.0, -1.0)  # mild decays: the carried state matters
    return layer


def test_layer_uses_the_step_out_of_training(step_calls, monkeypatch) -> None:
    from torch_gdr.nn import GatedDeltaNetCache

    layer = _layer().eval()
    chunked = _layer(recurrent_max_len=0).eval()
    x = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache, cache_chunked = GatedDeltaNetCache(), GatedDeltaNetCache()
        y = torch.cat([layer(x[:, :30], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(30, 40)], 1)
        y_chunked = torch.cat([chunked(x[:, :30], cache=cache_chunked)]
                              + [chunked(x[:, t:t + 1], cache=cache_chunked) for t in range(30, 40)], 1)
    assert step_calls == [30] + [1] * 10  # the prompt (<= 64 tokens) and every decode step
    torch.testing.assert_close(y, y_chunked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.get(layer.cache_key).recurrent_state,
                               cache_chunked.get(chunked.cache_key).recurrent_state, atol=1e-5, rtol=1e-5)

    step_calls.clear()
    with torch.no_grad():
        layer(torch.randn(1, 65, 32))  # longer than recurrent_max_len: the chunked op
    layer.train()(x[:, :5]).sum().backward()  # training: the chunked op
    assert step_calls == []
    with torch.no_grad():  # a named backend runs its own step
        _layer(backend="torch").eval()(x[:, :5])
    assert step_calls == [5]
