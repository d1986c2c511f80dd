"""Packed QKV (issue 36 item 6): q, k, v as strided views of one ``mixed_qkv`` tensor, as
vLLM's packed decode and FlashInfer's packed-QKV tests pass them.

Values: the views give the float64 recurrence's outputs and states (decode over a pool,
prefill over a pool, plain prefill). Copies: the torch profiler lists every copy op
(``aten::clone``, ``copy_``, ``_to_copy``, ``contiguous``) a call runs; with the views the list
must be the one the same call runs with contiguous copies of q, k, v (no copy is added for the
strides), on both backends: the ``"cpu"`` backend's forward kernels read q, k, v through their
token and head strides.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import torch_gdr
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

T, H, HV, K, V = 4, 2, 4, 16, 8
COPY_OPS = ("aten::clone", "aten::copy_", "aten::_to_copy", "aten::contiguous")


def _packed(seed: int, heads: int = H):
    """q, k, v as column slices of one ``[T, 2 * H * K + HV * V]`` tensor, viewed ``[1, T, ...]``."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(T, 2 * heads * K + HV * V, generator=gen)
    q = mixed[:, :heads * K].view(1, T, heads, K)
    k = mixed[:, heads * K:2 * heads * K].view(1, T, heads, K)
    v = mixed[:, 2 * heads * K:].view(1, T, HV, V)
    g = -torch.rand(1, T, HV, generator=gen)
    beta = torch.rand(1, T, HV, generator=gen)
    return mixed, q, k, v, g, beta


def _calls(backend: str):
    """name -> f(q, k, v, g, beta) -> (o, the pool or states it wrote), fresh pool per call."""
    def decode(q, k, v, g, beta):
        pool = torch.zeros(8, HV, K, V) + 0.1
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=pool,
                                                          ssm_state_indices=torch.tensor([5, 1, 6, 3]),
                                                          cu_seqlens=torch.arange(T + 1), backend=backend,
                                                          use_qk_l2norm_in_kernel=True)
        return o, pool

    def decode_states(q, k, v, g, beta):
        initial = torch.zeros(T, HV, K, V) + 0.1
        return torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial,
                                                          output_final_state=True, cu_seqlens=torch.arange(T + 1),
                                                          backend=backend, use_qk_l2norm_in_kernel=True)

    def prefill_pool(q, k, v, g, beta):
        pool = torch.zeros(8, HV, K, V) + 0.1
        o, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool,
                                                initial_state_indices=torch.tensor([2, 7]),
                                                cu_seqlens=torch.tensor([0, 3, 4]), backend=backend,
                                                use_qk_l2norm_in_kernel=True)
        return o, pool

    def prefill(q, k, v, g, beta):
        return torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 4]),
                                                backend=backend, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

    return {"decode": decode, "decode_states": decode_states, "prefill_pool": prefill_pool, "prefill": prefill}


def _reference(name: str, q, k, v, g, beta):
    """The float64 recurrence of the same call: (o, the pool or the final states)."""
    x = [t.double() for t in (q, k, v, g, beta)]
    if name == "decode":
        pool = torch.zeros(8, HV, K, V, dtype=torch.float64) + 0.1
        rows = [5, 1, 6, 3]
        os = []
        for n, row in enumerate(rows):
            o, s = naive_recurrent_gated_delta_rule(*(t[:, n:n + 1] for t in x), None, pool[row:row + 1], True, True)
            os.append(o)
            pool[row] = s[0]
        return torch.cat(os, 1), pool
    if name == "decode_states":
        initial = torch.zeros(T, HV, K, V, dtype=torch.float64) + 0.1
        return naive_recurrent_gated_delta_rule(*x, None, initial, True, True, torch.arange(T + 1))
    cu = torch.tensor([0, 3, 4])
    if name == "prefill_pool":
        pool = torch.zeros(8, HV, K, V, dtype=torch.float64) + 0.1
        o, s = naive_recurrent_gated_delta_rule(*x, None, pool[[2, 7]], True, True, cu)
        pool[[2, 7]] = s
        return o, pool
    return naive_recurrent_gated_delta_rule(*x, None, None, True, True, cu)


def _params():
    return [pytest.param(backend, name, id=f"{backend}-{name}") for backend in ("cpu", "torch")
            for name in ("decode", "decode_states", "prefill_pool", "prefill")]


@pytest.mark.parametrize("backend, name", _params())
def test_packed_views_give_the_reference(backend: str, name: str) -> None:
    mixed, q, k, v, g, beta = _packed(seed=1)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    with torch.no_grad():
        o, state = _calls(backend)[name](q, k, v, g, beta)
    ref_o, ref_state = _reference(name, q, k, v, g, beta)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(state.double(), ref_state, rtol=1e-5, atol=2e-6)


def _copies(fn) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return collections.Counter((e.name, str(e.input_shapes)) for e in prof.events() if e.name in COPY_OPS)


@pytest.mark.parametrize("heads", [H, HV], ids=["gqa", "mha"])
@pytest.mark.parametrize("backend, name", _params())
def test_packed_views_are_not_copied(backend: str, name: str, heads: int) -> None:
    _, q, k, v, g, beta = _packed(seed=2, heads=heads)
    dense = [t.contiguous() for t in (q, k, v)]
    call = _calls(backend)[name]
    with torch.no_grad():
        call(q, k, v, g, beta), call(*dense, g, beta)  # warm: first calls build cached tensors
        extra = _copies(lambda: call(q, k, v, g, beta)) - _copies(lambda: call(*dense, g, beta))
    assert not extra, f"copies the strided views add: {dict(extra)}"


@pytest.mark.parametrize("half_products", [1, 2], ids=["float32-tiles", "pair-dot-emulated"])
def test_bf16_prefill_reads_packed_views_as_their_copies(half_products: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bfloat16 chunked forward on the ``cpu`` backend, on both of its tile paths (the
    pair-dot path emulated where the machine has no unit), gives the same bits for q, k, v
    viewed out of one packed tensor as for contiguous copies of them (shapes where the pair
    path runs: K, V multiples of 16)."""
    from torch_gdr.ops.cpu import kernels

    monkeypatch.setattr(kernels, "HALF_PRODUCTS", half_products)
    gen = torch.Generator().manual_seed(3)
    tokens, heads, v_heads, dim = 40, 2, 4, 16
    mixed = torch.randn(tokens, 2 * heads * dim + v_heads * dim, generator=gen).bfloat16()
    q = mixed[:, :heads * dim].view(1, tokens, heads, dim)
    k = mixed[:, heads * dim:2 * heads * dim].view(1, tokens, heads, dim)
    v = mixed[:, 2 * heads * dim:].view(1, tokens, v_heads, dim)
    g = -torch.rand(1, tokens, v_heads, generator=gen)
    beta = torch.rand(1, tokens, v_heads, generator=gen)
    cu = torch.tensor([0, 17, 40])
    with torch.no_grad():
        o_view, s_view = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, backend="cpu",
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_copy, s_copy = torch_gdr.chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g, beta,
                                                          cu_seqlens=cu, backend="cpu", output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True)
    assert torch.equal(o_view, o_copy) and torch.equal(s_view, s_copy)
