"""Bad input gets a clear error naming the argument, what it got and what was expected."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

import torch_gdr
from tests.helpers import make_inputs


def _call(**changes) -> None:
    inputs = make_inputs(batch_size=2, seq_len=10, num_qk_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6,
                         dtype=torch.float32)
    inputs.update(changes)
    torch_gdr.chunk_gated_delta_rule(**inputs)


def _varlen(**changes) -> None:
    inputs = make_inputs(seqlens=[4, 6], dtype=torch.float32)
    inputs.update(changes)
    torch_gdr.chunk_gated_delta_rule(**inputs)


BAD_INPUTS: dict[str, tuple[Callable[[], None], type, str]] = {
    # name: (call, exception, pattern that must appear in the message)
    "q_rank": (lambda: _call(q=torch.randn(10, 8)), ValueError, r"q: expected shape .*got \[10, 8\]"),
    "k_shape": (lambda: _call(k=torch.randn(2, 10, 2, 7)), ValueError, r"k: expected shape .*\[2, 10, 2, 8\].*got \[2, 10, 2, 7\]"),
    "v_lead": (lambda: _call(v=torch.randn(2, 9, 4, 6)), ValueError, r"v: expected shape .*got \[2, 9, 4, 6\]"),
    "hv_not_multiple": (lambda: _call(v=torch.randn(2, 10, 3, 6), g=torch.randn(2, 10, 3), beta=torch.rand(2, 10, 3)),
                        ValueError, r"HV = 3 .*H = 2"),
    "g_shape": (lambda: _call(g=torch.randn(2, 10, 2)), ValueError, r"g: expected shape \[B, T, HV\] = \[2, 10, 4\], got \[2, 10, 2\]"),
    "beta_shape": (lambda: _call(beta=torch.randn(2, 10, 4, 1)), ValueError, r"beta: expected shape .*got \[2, 10, 4, 1\]"),
    "int_q": (lambda: _call(q=torch.ones(2, 10, 2, 8, dtype=torch.int64)), TypeError, r"q: expected a floating dtype"),
    "mixed_qk": (lambda: _call(k=torch.randn(2, 10, 2, 8, dtype=torch.float64)), TypeError,
                 r"k: expected the dtype of q \(torch.float32\), got torch.float64"),
    "not_tensor": (lambda: _call(beta=[0.5]), TypeError, r"beta: expected a torch.Tensor"),
    "initial_state_shape": (lambda: _call(initial_state=torch.zeros(2, 4, 6, 8)), ValueError,
                            r"initial_state: expected shape \[N, HV, K, V\] = \[2, 4, 8, 6\], got \[2, 4, 6, 8\]"),
    "initial_state_count": (lambda: _varlen(initial_state=torch.zeros(1, 2, 16, 16)), ValueError,
                            r"initial_state: .*\[2, 2, 16, 16\], got \[1, 2, 16, 16\]"),
    "chunk_size": (lambda: _call(chunk_size=48), ValueError, r"chunk_size: expected one of \[16, 32, 64, 128\], got 48"),
    "backend": (lambda: _call(backend="cuda-magic"), ValueError, r"backend: expected one of .*got 'cuda-magic'"),
    "device": (lambda: _call(initial_state=torch.zeros(2, 4, 8, 6, device="meta")), ValueError,
               r"initial_state: expected a tensor on cpu"),
    "cu_batch": (lambda: _call(cu_seqlens=torch.tensor([0, 10])), ValueError, r"cu_seqlens: requires batch size B = 1"),
    "cu_float": (lambda: _varlen(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])), TypeError, r"cu_seqlens: expected dtype int32 or int64"),
    "cu_2d": (lambda: _varlen(cu_seqlens=torch.tensor([[0, 4, 10]])), ValueError, r"cu_seqlens: expected shape \[N \+ 1\]"),
    "cu_start": (lambda: _varlen(cu_seqlens=torch.tensor([1, 4, 10])), ValueError, r"cu_seqlens: expected the first offset to be 0, got 1"),
    "cu_decreasing": (lambda: _varlen(cu_seqlens=torch.tensor([0, 6, 4, 10])), ValueError,
                      r"cu_seqlens: expected non-decreasing offsets, got 6 followed by 4"),
    "cu_short_end": (lambda: _varlen(cu_seqlens=torch.tensor([0, 4, 8])), ValueError,
                     r"cu_seqlens: expected the last offset to equal the number of tokens T = 10, got 8"),
    "cu_past_end": (lambda: _varlen(cu_seqlens=torch.tensor([0, 4, 12])), ValueError, r"T = 10, got 12"),
    "batch_0": (lambda: _call(**_sized(batch_size=0)), ValueError, r"q: expected a batch of at least one sequence"),
    "hv_0": (lambda: _call(v=torch.randn(2, 10, 0, 6), g=torch.randn(2, 10, 0), beta=torch.rand(2, 10, 0)),
             ValueError, r"v: expected at least one value heads HV, got shape \[2, 10, 0, 6\]"),
    "k_0": (lambda: _call(q=torch.randn(2, 10, 2, 0), k=torch.randn(2, 10, 2, 0)), ValueError,
            r"q: expected at least one key dim K"),
    "initial_state_list": (lambda: _call(initial_state=[[0.0]]), TypeError,
                           r"initial_state: expected a torch.Tensor or None, got list"),
    "chunk_size_float": (lambda: _call(chunk_size=64.0), TypeError, r"chunk_size: expected an int.*got float 64.0"),
    "chunk_size_bool": (lambda: _call(chunk_size=True), TypeError, r"chunk_size: expected an int.*got bool"),
    "scale_bool": (lambda: _call(scale=True), TypeError, r"scale: expected a float or None, got bool"),
    "scale_string": (lambda: _call(scale="0.5"), TypeError, r"scale: expected a float or None, got str"),
    "scale_vector": (lambda: _call(scale=torch.ones(2)), TypeError, r"scale: .*shape \[2\]"),
    "scale_with_grad": (lambda: _call(scale=torch.tensor(0.5, requires_grad=True)), TypeError,
                        r"scale: .*requires_grad=True"),
}


def _sized(**sizes) -> dict:
    spec = dict(batch_size=2, seq_len=10, num_qk_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6)
    spec.update(sizes)
    gen = torch.Generator().manual_seed(0)
    b, t, h, hv, k, v = (spec[n] for n in ("batch_size", "seq_len", "num_qk_heads", "num_v_heads", "head_k_dim",
                                           "head_v_dim"))
    return dict(q=torch.randn(b, t, h, k, generator=gen), k=torch.randn(b, t, h, k, generator=gen),
                v=torch.randn(b, t, hv, v, generator=gen), g=-torch.rand(b, t, hv, generator=gen),
                beta=torch.rand(b, t, hv, generator=gen))


@pytest.mark.parametrize("backend", ["torch", "recurrent"])
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_a_clear_error(case: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    call, error, pattern = BAD_INPUTS[case]
    if case != "backend":
        monkeypatch.setenv("TORCH_GDR_BACKEND", backend)
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), torch.tensor(0.5), 0.5], ids=str)
def test_scale_as_numpy_or_0d_tensor_is_the_float(scale) -> None:
    """The function and the op take the same scales: reals and 0-d tensors without grad."""
    inputs = make_inputs(seq_len=10, dtype=torch.float32)
    args = tuple(inputs[n] for n in ("q", "k", "v", "g", "beta"))
    expected, _ = torch_gdr.chunk_gated_delta_rule(*args, scale=0.5)
    for got in (torch_gdr.chunk_gated_delta_rule(*args, scale=scale)[0],
                torch.ops.gdr.chunked_gated_delta_rule(*args, scale=scale)[0]):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_backend_environment_variable_is_stripped_and_lower_cased(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_GDR_BACKEND", "  Recurrent\n")
    from torch_gdr.dispatch import resolve_backend

    assert resolve_backend(None, torch.device("cpu")) == "recurrent"
    monkeypatch.setenv("TORCH_GDR_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"TORCH_GDR_BACKEND: expected one of .*got 'fast'"):
        resolve_backend(None, torch.device("cpu"))


def test_the_op_checks_values_when_called_directly() -> None:
    inputs = make_inputs(seqlens=[4, 6], dtype=torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens: expected the last offset"):
        torch.ops.gdr.chunked_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                               cu_seqlens=torch.tensor([0, 4, 9]))


def test_nan_in_gives_nan_out_without_crashing() -> None:
    inputs = make_inputs(seq_len=20, dtype=torch.float32)
    inputs["v"][0, 3, 0, 0] = float("nan")
    o, _ = torch_gdr.chunk_gated_delta_rule(**inputs)
    assert torch.isnan(o).any() and o.shape == inputs["v"].shape


def _pool_step(**changes) -> None:
    """A decode step over a state pool of 4 rows, two sequences of one token each."""
    inputs = make_inputs(batch_size=2, seq_len=1, num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                         dtype=torch.float32)
    inputs = dict(inputs, initial_state=torch.zeros(4, 2, 8, 8), ssm_state_indices=torch.tensor([[0], [1]]))
    inputs.update(changes)
    torch_gdr.fused_recurrent_gated_delta_rule(**inputs)


@pytest.mark.parametrize("backend", [None, "cpu", "torch"])
@pytest.mark.parametrize("name, value, layout", [("ssm_state_indices", [[0], [1]], r"\[N\] or \[N, S\]"),
                                                 ("ssm_state_indices", (0, 1), r"\[N\] or \[N, S\]"),
                                                 ("num_accepted_tokens", [1, 1], r"\[N\]")])
def test_pool_indices_as_python_sequences_raise_type_error(name: str, value, layout: str, backend) -> None:
    """Index arguments of a pool step given as Python lists or tuples: a ``TypeError`` naming
    the argument from the public function (not an ``AttributeError`` from dispatch)."""
    with pytest.raises(TypeError, match=rf"^{name}: expected an integer torch.Tensor {layout}, got "
                                        rf"{type(value).__name__}$"):
        _pool_step(**{name: value}, backend=backend)


# how the backend written shows it is taken as named: a call it cannot serve, and its error
NAMED_REFUSALS = {"cpu": (dict(dtype=torch.float64), r"float32/float16/bfloat16"),
                  "recurrent": (dict(checkpoint_every=16, chunk_size=16), r"no checkpoints")}


@pytest.mark.parametrize("written, name", [(" CPU ", "cpu"), ("Torch\n", "torch"), ("\tRECURRENT", "recurrent")])
def test_backend_argument_is_stripped_and_lower_cased_as_the_variable_is(written: str, name: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend=" CPU "`` names "cpu" in both public functions, as ``TORCH_GDR_BACKEND`` does:
    the same outputs as the plain name, those of the recurrence, and the named backend's
    error for a call it cannot serve (so the name is taken as named, not dropped)."""
    from torch_gdr.dispatch import BackendError, requested_backend
    from torch_gdr.ref import naive_recurrent_gated_delta_rule

    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    assert requested_backend(written) == name
    x = make_inputs(batch_size=2, seq_len=5, num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8,
                    dtype=torch.float32)
    exact_o, _ = naive_recurrent_gated_delta_rule(**{n: t.double() for n, t in x.items()})
    for function in (torch_gdr.chunk_gated_delta_rule, torch_gdr.fused_recurrent_gated_delta_rule):
        got, _ = function(**x, backend=written)
        want, _ = function(**x, backend=name)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        torch.testing.assert_close(got.double(), exact_o, atol=1e-5, rtol=1e-5)
    if name in NAMED_REFUSALS:
        changes, reason = NAMED_REFUSALS[name]
        refused = {n: t.to(changes["dtype"]) for n, t in x.items()} if "dtype" in changes else dict(x, **changes)
        with pytest.raises(BackendError, match=rf"^backend '{name}' cannot serve .*{reason}"):
            torch_gdr.chunk_gated_delta_rule(**refused, backend=written)
