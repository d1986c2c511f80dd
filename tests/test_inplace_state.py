"""``inplace_final_state`` of the per-sequence calls (issue 39): the final state written into
``initial_state`` in place, checked against the float64 recurrence (torch_gdr.ref), on every
backend with a step, eagerly and under ``torch.compile(fullgraph=True)``; the default path
leaving ``initial_state`` untouched; the named errors for states that cannot be written."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

import torch_gdr
from torch_gdr.dispatch.registry import BACKENDS
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule
from tests.helpers import make_inputs

ENTRIES = ("fused_recurrent", "chunk")


def _inputs(seq_len: Optional[int] = 1, seqlens: Optional[list[int]] = None, batch_size: int = 3,
            head_dim: int = 16) -> dict:
    spec = dict(seqlens=seqlens) if seqlens is not None else dict(batch_size=batch_size, seq_len=seq_len)
    return make_inputs(**spec, num_qk_heads=2, num_v_heads=4, head_k_dim=head_dim, head_v_dim=head_dim,
                       dtype=torch.float32, with_initial_state=True, normalize_qk=True)


def _reference(x: dict, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final state)`` of the float64 recurrence from ``state`` (key-first)."""
    return naive_recurrent_gated_delta_rule(*(x[n].double() for n in ("q", "k", "v", "g", "beta")),
                                            initial_state=state.double(), cu_seqlens=x.get("cu_seqlens"))


def _call(entry: str, x: dict, state: Optional[torch.Tensor], backend: Optional[str], **kwargs):
    if entry == "chunk":
        return torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=state,
                                                output_final_state=True, cu_seqlens=x.get("cu_seqlens"),
                                                backend=backend, **kwargs)
    return torch_gdr.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"],
                                                      initial_state=state, output_final_state=True,
                                                      cu_seqlens=x.get("cu_seqlens"), backend=backend, **kwargs)


def _layout(state: torch.Tensor, v_first: bool) -> torch.Tensor:
    """A key-first state as a new tensor in the caller's layout (contiguous)."""
    return (state.transpose(-1, -2) if v_first else state).contiguous()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", ["cpu", "torch", "recurrent"])
@pytest.mark.parametrize("case", ["decode", "three_tokens", "varlen_with_empty", "v_first_bf16"])
def test_inplace_call_writes_the_final_state_into_initial_state(entry: str, backend: str, case: str) -> None:
    if entry == "chunk" and backend == "recurrent":
        backend = "torch"  # the recurrent backend has no chunked forward of its own
    x = _inputs(**{"decode": dict(seq_len=1), "three_tokens": dict(seq_len=3),
                   "varlen_with_empty": dict(seqlens=[2, 0, 3]), "v_first_bf16": dict(seq_len=2)}[case])
    v_first, dtype = case == "v_first_bf16", (torch.bfloat16 if case == "v_first_bf16" else torch.float32)
    start = x["initial_state"].to(dtype)  # key-first, float64 values rounded to the state's dtype
    want_o, want_state = _reference(x, start)
    state = _layout(start, v_first)
    pointer = state.data_ptr()
    with torch.no_grad():
        o, final_state = _call(entry, x, state, backend, state_v_first=v_first, inplace_final_state=True)
    assert final_state is state and state.data_ptr() == pointer and state.dtype == dtype
    got = state.transpose(-1, -2) if v_first else state
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (o.double() - want_o).abs().max().item() < tol * 10
    assert (got.double() - want_state).abs().max().item() < tol * max(1.0, want_state.abs().max().item())


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("flag", [None, False])
def test_default_path_leaves_initial_state_untouched(entry: str, flag: Optional[bool]) -> None:
    x = _inputs(seq_len=2)
    state = x["initial_state"].float()
    before = state.clone()
    o, final_state = _call(entry, x, state, "cpu", inplace_final_state=flag)
    assert torch.equal(state, before)
    assert final_state.data_ptr() != state.data_ptr()
    want_o, want_state = _reference(x, before)
    assert (final_state.double() - want_state).abs().max().item() < 1e-4


def test_cpu_backend_writes_through_its_own_inplace_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``"cpu"`` backend's hook runs (no step and copy), and so does the op it wraps."""
    calls = []
    hook = BACKENDS["cpu"].step_inplace
    monkeypatch.setattr(BACKENDS["cpu"], "step_inplace", lambda call, state: calls.append(1) or hook(call, state))
    monkeypatch.setattr(BACKENDS["cpu"], "step", None)  # the copy path would call it
    x = _inputs(seq_len=1)
    state = x["initial_state"].float()
    with torch.no_grad():
        _call("fused_recurrent", x, state, "cpu", inplace_final_state=True)
    assert calls == [1]
    assert (state.double() - _reference(x, x["initial_state"].float())[1]).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_inplace_call_under_torch_compile_fullgraph(entry: str, backend: str) -> None:
    torch._dynamo.reset()
    x = _inputs(seq_len=1)
    start = x["initial_state"].float()
    want_o, want_state = _reference(x, start)
    state = start.clone()
    pointer = state.data_ptr()

    def step(q, k, v, g, beta, s):
        return _call(entry, dict(q=q, k=k, v=v, g=g, beta=beta), s, backend, inplace_final_state=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        o, final_state = compiled(x["q"], x["k"], x["v"], x["g"], x["beta"], state)
    assert state.data_ptr() == pointer and final_state.data_ptr() == pointer
    assert (o.double() - want_o).abs().max().item() < 1e-4
    assert (state.double() - want_state).abs().max().item() < 1e-5


def test_pypto_inplace_step_through_its_pool_kernel() -> None:
    from torch_gdr.ops.pypto import _env

    if not _env.is_pypto_available():
        pytest.skip("pypto is not installed")
    x = make_inputs(batch_size=2, seq_len=1, num_qk_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64,
                    dtype=torch.float32, with_initial_state=True, normalize_qk=True)
    start = x["initial_state"].float()
    want_o, want_state = _reference(x, start)
    state = start.clone()
    with torch.no_grad():
        o, final_state = _call("fused_recurrent", x, state, "pypto", inplace_final_state=True)
    assert final_state is state
    assert (o.double() - want_o).abs().max().item() < 1e-4
    assert (state.double() - want_state).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("seqlens", [None, [2, 1]])
def test_pypto_inplace_multi_token(seqlens: Optional[list[int]]) -> None:
    from torch_gdr.ops.pypto import _env

    if not _env.is_pypto_available():
        pytest.skip("pypto is not installed")
    spec = dict(seqlens=seqlens) if seqlens else dict(batch_size=2, seq_len=2)
    x = make_inputs(**spec, num_qk_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64, dtype=torch.float32,
                    with_initial_state=True, normalize_qk=True)
    start = x["initial_state"].float()
    want_o, want_state = _reference(x, start)
    state = start.clone()
    with torch.no_grad():
        o, _ = _call("fused_recurrent", x, state, "pypto", inplace_final_state=True)
    assert (o.double() - want_o).abs().max().item() < 1e-4
    assert (state.double() - want_state).abs().max().item() < 1e-4


# ---- errors -------------------------------------------------------------------------------

def _state() -> tuple[dict, torch.Tensor]:
    x = _inputs(seq_len=1)
    return x, x["initial_state"].float().contiguous()


@pytest.mark.parametrize("entry", ENTRIES)
def test_state_that_requires_grad_is_refused(entry: str) -> None:
    x, state = _state()
    state.requires_grad_()
    with pytest.raises(ValueError, match="initial_state: requires grad"):
        _call(entry, x, state, "torch", inplace_final_state=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_inputs_recorded_by_autograd_are_refused(entry: str) -> None:
    x, state = _state()
    x["v"].requires_grad_()
    with pytest.raises(ValueError, match="inplace_final_state: True is for inference"):
        _call(entry, x, state, "torch", inplace_final_state=True)
    with torch.no_grad():  # nothing recorded: allowed
        _call(entry, x, state, "torch", inplace_final_state=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_wrong_dtype_is_refused(entry: str) -> None:
    x, state = _state()
    with pytest.raises(TypeError, match=r"initial_state: .*float32/float16/bfloat16 state, got torch.float64"):
        _call(entry, x, state.double(), "torch", inplace_final_state=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_wrong_layout_is_refused(entry: str) -> None:
    x, state = _state()
    transposed = state.transpose(-1, -2).contiguous().transpose(-1, -2)  # right shape, columns contiguous
    with pytest.raises(ValueError, match=r"initial_state: .*contiguous.*got strides"):
        _call(entry, x, transposed, "torch", inplace_final_state=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_state_that_is_not_writable_is_refused(entry: str) -> None:
    x, state = _state()
    expanded = state[:1].expand_as(state)
    with pytest.raises(ValueError, match="initial_state: not writable in place"):
        _call(entry, x, expanded, "torch", inplace_final_state=True)


@pytest.mark.parametrize("entry", ENTRIES)
def test_missing_state_and_bad_flag_are_refused(entry: str) -> None:
    x, state = _state()
    with pytest.raises(ValueError, match="initial_state: inplace_final_state=True writes"):
        _call(entry, x, None, "torch", inplace_final_state=True)
    with pytest.raises(TypeError, match="inplace_final_state: expected a bool, got int"):
        _call(entry, x, state, "torch", inplace_final_state=1)


def test_pool_prefill_refuses_a_copy_out() -> None:
    x, state = _state()
    pool = torch.zeros(4, *state.shape[1:])
    with pytest.raises(ValueError, match="inplace_final_state: a state pool"):
        torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                         initial_state_indices=torch.tensor([0, 1, 2]), inplace_final_state=False)


def test_cpu_inplace_op_passes_opcheck() -> None:
    """``gdr::_cpu_step_inplace`` declares what it mutates (the state) and its fake matches."""
    x = _inputs(seq_len=2)
    state = x["initial_state"].float().contiguous()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.25, state, True, None, False)
    torch.library.opcheck(torch.ops.gdr._cpu_step_inplace.default, args)
