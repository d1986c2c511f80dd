"""The hand-written chunked backward against autograd through the per-token recurrence.

Loss: ``(o * do).sum() + (final_state * dht).sum()`` with random ``do``, ``dht``. The
reference always runs in float64 through the recurrence; fp64 calls must match it to 1e-8
(max abs), fp32 calls to an rmse ratio ``rmse(ref - out) / rms(ref)`` below 1e-4, fp16 and
bf16 calls (float32 accumulation) to the anchors' tolerances.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

import torch_gdr
from tests.helpers import TEST_DEVICE, canonical
from torch_gdr.testing import make_inputs as _make_inputs
from torch_gdr.testing import rmse_ratio as _rmse_ratio
from torch_gdr.ops.torch.chunk_backward import chunk_gated_delta_rule_bwd
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@dataclass(frozen=True)
class Case:
    batch: int = 1
    seq_len: int = 40
    heads: int = 2
    v_heads: int = 2
    k_dim: int = 8
    v_dim: int = 8
    chunk: int = 16
    initial_state: bool = True
    l2norm: bool = False
    scale: Optional[float] = None
    state_v_first: bool = False
    cu_seqlens: Optional[tuple[int, ...]] = None
    gate: str = "logsigmoid"  # "logsigmoid" | "strong" (g ~ -30) | "zero"
    final_grad: bool = True

    @property
    def num_seqs(self) -> int:
        return self.batch if self.cu_seqlens is None else len(self.cu_seqlens) - 1


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0) -> dict:
    """The tensors of ``case`` (q, k, v in ``dtype``; g, beta and the initial state in float32
    unless float64), and random gradients ``do`` and ``dht`` for the usual loss."""
    seqlens = None if case.cu_seqlens is None else [b - a for a, b in zip(case.cu_seqlens[:-1], case.cu_seqlens[1:])]
    t = _make_inputs(batch_size=case.batch, seq_len=case.seq_len, seqlens=seqlens, num_qk_heads=case.heads,
                     num_v_heads=case.v_heads,
                     head_k_dim=case.k_dim, head_v_dim=case.v_dim, gate=case.gate, seed=seed,
                     normalize_qk=not case.l2norm,  # the kernel-side norm is off: normalised keys, as models do
                     with_initial_state=case.initial_state, device=TEST_DEVICE)
    low = torch.float64 if dtype == torch.float64 else torch.float32
    tensors = dict(q=t["q"].to(dtype), k=t["k"].to(dtype), v=t["v"].to(dtype), g=t["g"].to(low),
                   beta=t["beta"].to(low), initial_state=None)
    state = (case.num_seqs, case.v_heads) + ((case.v_dim, case.k_dim) if case.state_v_first
                                             else (case.k_dim, case.v_dim))
    if case.initial_state:
        h0 = t["initial_state"]
        tensors["initial_state"] = (h0.transpose(-1, -2) if case.state_v_first else h0).contiguous().to(low)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(t["v"].shape, generator=gen, dtype=torch.float64).to(TEST_DEVICE)
    dht = torch.randn(state, generator=gen, dtype=torch.float64).to(TEST_DEVICE) if case.final_grad else None
    return dict(tensors=tensors, do=do, dht=dht)


def _loss_grads(fn, case: Case, tensors: dict, do: torch.Tensor, dht: Optional[torch.Tensor]) -> dict:
    leaves = {n: x.detach().clone().requires_grad_() for n, x in tensors.items() if x is not None}
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens)
    o, final = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], case.scale,
                  leaves.get("initial_state"), dht is not None, cu, case)
    loss = (o.double() * do).sum()
    if dht is not None:
        loss = loss + (final.double() * dht).sum()
    loss.backward()
    return {n: x.grad for n, x in leaves.items()}


def _public(backend: str):
    def call(q, k, v, g, beta, scale, h0, output_final_state, cu, case):
        return torch_gdr.chunk_gated_delta_rule(
            q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=cu, chunk_size=case.chunk,
            state_v_first=case.state_v_first, backend=backend)
    return call


def _op(q, k, v, g, beta, scale, h0, output_final_state, cu, case):
    """The op itself: its registered autograd saves only the inputs, so its backward
    recomputes the chunk states (the public call keeps them instead)."""
    return torch.ops.gdr.chunked_gated_delta_rule(q, k, v, g, beta, scale, h0, output_final_state, case.l2norm,
                                                  cu, case.chunk, case.state_v_first)


def _naive(q, k, v, g, beta, scale, h0, output_final_state, cu, case):
    """Autograd through the per-token recurrence, called directly: the independent reference."""
    token_major = q.dim() == 3
    if token_major:
        q, k, v, g, beta = (x.unsqueeze(0) for x in (q, k, v, g, beta))
    if h0 is not None and case.state_v_first:
        h0 = h0.transpose(-1, -2)
    o, final = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, True, case.l2norm, cu)
    if case.state_v_first:
        final = final.transpose(-1, -2)
    return (o.squeeze(0) if token_major else o), final


def reference_grads(case: Case, data: dict) -> dict:
    tensors = {n: (x.double() if x is not None else None) for n, x in data["tensors"].items()}
    return _loss_grads(_naive, case, tensors, data["do"], data["dht"])


def rmse_ratio(ref: torch.Tensor, out: torch.Tensor) -> float:
    """The rmse ratio with the rms floored at 1e-6: with O(1) inputs a gradient of rms below
    1e-6 is zero up to rounding (e.g. dg under g = -30, ~1e-14), and a relative error of it
    would only measure noise."""
    return _rmse_ratio(ref, out, floor=1e-6)


CASES = {
    "T<C": Case(seq_len=11),
    "T=C": Case(seq_len=16),
    "T%C!=0": Case(seq_len=45),
    "T=1": Case(seq_len=1),
    "B>1": Case(batch=3, seq_len=21),
    "gva2": Case(heads=2, v_heads=4),
    "gva4,K!=V": Case(heads=1, v_heads=4, k_dim=8, v_dim=12),
    "no_h0": Case(initial_state=False),
    "no_final_grad": Case(final_grad=False),
    "l2norm": Case(l2norm=True),
    "scale": Case(scale=0.37),
    "state_v_first,K!=V": Case(state_v_first=True, k_dim=12, v_dim=8),
    "varlen": Case(seq_len=46, cu_seqlens=(0, 0, 1, 17, 17, 46)),
    "varlen,gva,l2": Case(seq_len=33, heads=1, v_heads=2, l2norm=True, cu_seqlens=(0, 1, 33, 33)),
    "strong_decay": Case(gate="strong"),
    "g=0": Case(gate="zero"),
    "chunk64": Case(seq_len=70, chunk=64, k_dim=16, v_dim=16),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("path", ["public", "op"], ids=["saved_states", "op_recomputes"])
def test_grads_match_recurrence(name: str, dtype: torch.dtype, path: str) -> None:
    case = CASES[name]
    data = make_inputs(case, dtype)
    ref = reference_grads(case, data)
    call = _public("torch") if path == "public" else _op
    out = _loss_grads(call, case, data["tensors"], data["do"], data["dht"])
    assert set(out) == set(ref)
    for n in ref:
        assert out[n].dtype == data["tensors"][n].dtype and out[n].shape == ref[n].shape, n
        assert torch.isfinite(out[n]).all(), n
        if dtype == torch.float64:
            err = (out[n] - ref[n]).abs().max().item()
            assert err < 1e-8, f"{n}: max abs {err:.3g}"
        else:
            assert rmse_ratio(ref[n], out[n]) < 1e-4, f"{n}: rmse ratio {rmse_ratio(ref[n], out[n]):.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_fp32(dtype: torch.dtype) -> None:
    case = Case(seq_len=45, l2norm=True, k_dim=16, v_dim=16)
    data = make_inputs(case, dtype)
    # The reference sees the same (rounded) inputs in float64.
    ref = reference_grads(case, data)
    out = _loss_grads(_public("torch"), case, data["tensors"], data["do"], data["dht"])
    bound = {torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    for n in ref:
        assert out[n].dtype == data["tensors"][n].dtype, n
        assert rmse_ratio(ref[n], out[n].float()) < bound, f"{n}: {rmse_ratio(ref[n], out[n].float()):.3g}"


def test_token_major_layout() -> None:
    case = Case(seq_len=30, cu_seqlens=(0, 12, 30), state_v_first=True)
    data = make_inputs(case, torch.float64)
    ref = reference_grads(case, data)
    tensors = {n: (x.squeeze(0) if n != "initial_state" else x) for n, x in data["tensors"].items()}
    out = _loss_grads(_public("torch"), case, tensors, data["do"].squeeze(0), data["dht"])
    for n in ref:
        assert (out[n] - ref[n].reshape(out[n].shape)).abs().max().item() < 1e-8, n


def test_backward_function_directly() -> None:
    """The reference-level pair: the hand-written backward of chunk_gated_delta_rule_fwd."""
    case = Case(seq_len=37, heads=1, v_heads=2, l2norm=True)
    data = make_inputs(case, torch.float64)
    t = data["tensors"]
    ref = reference_grads(case, data)
    call = canonical(t, use_qk_l2norm_in_kernel=True, chunk_size=case.chunk)
    grads = chunk_gated_delta_rule_bwd(call, data["do"], data["dht"])
    for n, d in zip(NAMES, grads):
        assert (d - ref[n]).abs().max().item() < 1e-8, n


@pytest.mark.parametrize("case", [Case(seq_len=9, k_dim=4, v_dim=3, chunk=16),
                                  Case(seq_len=7, heads=1, v_heads=2, k_dim=4, v_dim=4, l2norm=True,
                                       cu_seqlens=(0, 0, 3, 7), state_v_first=True)], ids=["plain", "varlen"])
def test_gradcheck_fp64(case: Case) -> None:
    data = make_inputs(case, torch.float64, seed=1)
    t = data["tensors"]
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens)

    def fn(q, k, v, g, beta, h0):
        o, final = torch_gdr.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=case.l2norm,
            cu_seqlens=cu, chunk_size=case.chunk, state_v_first=case.state_v_first, backend="torch")
        return o, final

    inputs = tuple(t[n].detach().clone().requires_grad_() for n in NAMES)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("case", [Case(seq_len=20), Case(seq_len=19, heads=1, v_heads=2, l2norm=True,
                                                         cu_seqlens=(0, 0, 5, 19), state_v_first=True)],
                         ids=["plain", "varlen"])
@pytest.mark.parametrize("output_final_state", [True, False])
def test_opcheck(case: Case, output_final_state: bool) -> None:
    """The public op and its backward op."""
    data = make_inputs(case, torch.float32)
    t = data["tensors"]
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)
    args = tuple(t[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta"))
    h0 = t["initial_state"].detach().clone().requires_grad_()
    torch.library.opcheck(torch.ops.gdr.chunked_gated_delta_rule.default,
                          args + (case.scale, h0, output_final_state, case.l2norm, cu, case.chunk,
                                  case.state_v_first))
    grad_o = torch.randn_like(t["v"])
    dht = torch.randn_like(t["initial_state"])
    torch.library.opcheck(torch.ops.gdr.chunked_gated_delta_rule_backward.default,
                          (grad_o, dht) + tuple(a.detach() for a in args)
                          + (case.scale, h0.detach(), case.l2norm, cu, case.chunk, case.state_v_first))


BACKEND_OPS = {  # backend: (forward op, backward op, forward keeps chunk states)
    "torch": ("_torch_fwd", "chunked_gated_delta_rule_backward", True),
    "recurrent": ("_recurrent_fwd", "_recurrent_bwd", False),
}


@pytest.mark.parametrize("backend", list(BACKEND_OPS))
@pytest.mark.parametrize("case", [Case(seq_len=20, heads=1, v_heads=2),
                                  Case(seq_len=19, l2norm=True, cu_seqlens=(0, 0, 5, 19), state_v_first=True)],
                         ids=["plain", "varlen"])
def test_opcheck_backend_ops(case: Case, backend: str) -> None:
    """Every backend's forward op (keeping its chunk states, with a data-dependent size under
    varlen) and its backward op given those states."""
    forward_name, backward_name, keeps = BACKEND_OPS[backend]
    data = make_inputs(case, torch.float32)
    t = data["tensors"]
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)
    args = tuple(t[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta"))
    h0 = t["initial_state"].detach().clone().requires_grad_()
    options = (case.l2norm, cu, case.chunk, case.state_v_first)
    forward = getattr(torch.ops.gdr, forward_name).default
    torch.library.opcheck(forward, args + (case.scale, h0, True) + options + (True,))
    with torch.no_grad():
        _, _, states = forward(*args, case.scale, h0, True, *options, True)
    assert (states.numel() > 0) == keeps
    grad_o, dht = torch.randn_like(t["v"]), torch.randn_like(t["initial_state"])
    torch.library.opcheck(getattr(torch.ops.gdr, backward_name).default,
                          (grad_o, dht) + tuple(a.detach() for a in args) + (case.scale, h0.detach()) + options
                          + (states,))


def test_chunk_states_of_another_shape_are_refused() -> None:
    case = Case(seq_len=40, cu_seqlens=(0, 7, 40), heads=1, v_heads=2)
    t = make_inputs(case, torch.float64)["tensors"]
    cu = torch.tensor(case.cu_seqlens)
    tensors = tuple(t[n] for n in ("q", "k", "v", "g", "beta"))
    _, _, states = torch.ops.gdr._torch_fwd(*tensors, None, None, False, False, cu, case.chunk, False, True)
    for bad in (states[:-1], states[..., :-1]):
        with pytest.raises(ValueError, match=r"chunk_states: expected shape .* got "
                                             + re.escape(str(list(bad.shape)))):
            torch.ops.gdr._torch_bwd(torch.ones_like(t["v"]), None, *tensors, None, None, False, cu, case.chunk,
                                     False, bad)


def test_zero_length_everywhere() -> None:
    """All sequences empty: no tokens, the initial state passes through, its gradient is dht."""
    case = Case(seq_len=0, cu_seqlens=(0, 0, 0))
    data = make_inputs(case, torch.float64)
    out = _loss_grads(_public("torch"), case, data["tensors"], data["do"], data["dht"])
    assert torch.equal(out["initial_state"], data["dht"])
    assert out["q"].shape == (1, 0, 2, 8)


def test_final_state_fed_back_equals_one_call_grads() -> None:
    """Split a sequence in two calls, chaining the state: same gradients as one call."""
    case = Case(seq_len=40)
    data = make_inputs(case, torch.float64)
    t = data["tensors"]
    one = _loss_grads(_public("torch"), case, t, data["do"], data["dht"])
    leaves = {n: x.detach().clone().requires_grad_() for n, x in t.items()}
    kw = dict(output_final_state=True, chunk_size=case.chunk, backend="torch")
    cut = 23
    parts = [tuple(leaves[n][:, s] for n in ("q", "k", "v", "g", "beta")) for s in (slice(0, cut), slice(cut, None))]
    o1, s1 = torch_gdr.chunk_gated_delta_rule(*parts[0], initial_state=leaves["initial_state"], **kw)
    o2, s2 = torch_gdr.chunk_gated_delta_rule(*parts[1], initial_state=s1, **kw)
    loss = (torch.cat([o1, o2], 1) * data["do"]).sum() + (s2 * data["dht"]).sum()
    loss.backward()
    for n in one:
        assert (leaves[n].grad - one[n]).abs().max().item() < 1e-10, n


@pytest.mark.parametrize("path", ["public", "op"], ids=["saved_states", "op_recomputes"])
@pytest.mark.parametrize("segment_matrices", [1, 3, 1000])
def test_segment_sizes_agree(monkeypatch, segment_matrices: int, path: str) -> None:
    """The call is processed in segments of chunks (split into groups of sequences where one
    chunk of all of them is too many matrices: sizes 1 and 3 here); any segment size gives
    the same gradients."""
    import torch_gdr.ops.torch.chunk_layout as chunk_layout

    monkeypatch.setattr(chunk_layout, "SEGMENT_MATRICES", segment_matrices)
    case = Case(seq_len=75, cu_seqlens=(0, 10, 10, 75), heads=1, v_heads=2)
    data = make_inputs(case, torch.float64)
    ref = reference_grads(case, data)
    out = _loss_grads(_public("torch") if path == "public" else _op, case, data["tensors"], data["do"], data["dht"])
    for n in ref:
        assert (out[n] - ref[n]).abs().max().item() < 1e-8, n


def test_eager_training_keeps_the_chunk_states(recompute_passes: list) -> None:
    """The public call under autograd saves the chunk states: its backward runs no
    recompute pass (load_segment with states_only), while the op's backward does."""
    case = Case(seq_len=40, cu_seqlens=(0, 7, 40), heads=1, v_heads=2)
    data = make_inputs(case, torch.float64)
    for call, recomputes in ((_public("torch"), False), (_op, True)):
        recompute_passes.clear()
        _loss_grads(call, case, data["tensors"], data["do"], data["dht"])
        assert recompute_passes and any(recompute_passes) == recomputes


def test_backward_makes_no_gradient_for_the_kept_states() -> None:
    """The kept chunk states are an output of the training op; autograd must not hand its
    backward a zero "gradient" of their size (as large as the states themselves: 16 MiB at
    T 4096, H 4, K = V = 128, a quarter of the peak memory of a training step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    case = Case(seq_len=40, heads=1, v_heads=2, k_dim=8, v_dim=12)  # 3 chunks of 16
    states_shape = (case.batch * 3 * case.v_heads, case.k_dim, case.v_dim)

    class RecordShapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.shapes.append((str(func), tuple(t.shape)))
            return out

    data = make_inputs(case, torch.float64)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in data["tensors"].items() if x is not None}
    o, final = _public("torch")(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], None,
                                leaves["initial_state"], True, None, case)
    loss = (o * data["do"]).sum() + final.sum()
    with RecordShapes() as mode:
        loss.backward()
    assert mode.shapes, "the mode saw no op of the backward"
    made = [name for name, shape in mode.shapes if shape == states_shape]
    assert not made, f"the backward made states-sized tensors: {made}"


@pytest.mark.parametrize("case", [Case(seq_len=40, heads=1, v_heads=2, l2norm=True, cu_seqlens=(0, 1, 7, 7, 40)),
                                  Case(batch=2, seq_len=21, state_v_first=True, k_dim=12, v_dim=8,
                                       final_grad=False)],
                         ids=["varlen,gva,l2", "batched,v_first,no_final_state"])
def test_compiled_training_keeps_the_chunk_states(recompute_passes: list, case: Case) -> None:
    """Under torch.compile the public call keeps the chunk states too (the varlen states'
    number is a data-dependent size in the graph): no recompute pass, the same gradients."""
    data = make_inputs(case, torch.float64)
    ref = reference_grads(case, data)
    torch._dynamo.reset()
    compiled = torch.compile(_public("torch"), fullgraph=True, backend="aot_eager")
    recompute_passes.clear()
    out = _loss_grads(compiled, case, data["tensors"], data["do"], data["dht"])
    assert recompute_passes and not any(recompute_passes)
    for n in ref:
        err = (out[n] - ref[n]).abs().max().item()
        assert err < 1e-8, f"{n}: max abs {err:.3g}"


def test_final_state_may_be_updated_in_place_before_backward() -> None:
    """The final state handed out is not a view of the states kept for the backward."""
    case = Case(seq_len=40)
    data = make_inputs(case, torch.float64)
    expected = _loss_grads(_public("torch"), case, data["tensors"], data["do"], None)
    leaves = {n: x.detach().clone().requires_grad_() for n, x in data["tensors"].items() if x is not None}
    o, final = torch_gdr.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                                leaves["beta"], initial_state=leaves["initial_state"],
                                                output_final_state=True, chunk_size=case.chunk)
    with torch.no_grad():
        final.mul_(2)  # e.g. a cache updated in place
    (o * data["do"]).sum().backward()
    for n, x in leaves.items():
        torch.testing.assert_close(x.grad, expected[n], atol=1e-10, rtol=1e-10)
