"""fla-core 0.6's arguments of both public functions, on every backend this machine has.

The activations (``use_gate_in_kernel`` with ``A_log``/``dt_bias``, ``use_beta_sigmoid_in_kernel``,
``allow_neg_eigval``) are checked against the float64 per-token recurrence fed with the
activations written out by hand, forward and every gradient (raw gate, ``A_log``,
``dt_bias``, beta logits included), plus a float64 ``gradcheck`` on ``"torch"``; the
metadata arguments (``cu_seqlens_cpu``, ``chunk_indices``), the deprecated
``transpose_state_layout`` and the refused ``gk``/``gv`` by their behaviour and errors.
"""

from __future__ import annotations

import warnings
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr.dispatch import BACKENDS, CallSpec, reason_text
from torch_gdr.ref import naive_recurrent_gated_delta_rule
from torch_gdr.testing import make_inputs, rmse_ratio
from tests.helpers import assert_compiled_matches_eager

#: rmse ratio against the float64 recurrence on the same float32 inputs (far inside fla's
#: own bounds of 0.005 on o and 0.02 on the gate gradients)
FORWARD_BOUND = 2e-5
GRAD_BOUND = 1e-4

#: activation options by case: (use_gate_in_kernel, with dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
ACTIVATIONS: dict[str, tuple[bool, bool, bool, bool]] = {
    "gate": (True, True, False, False),
    "gate_without_dt_bias": (True, False, False, False),
    "beta_sigmoid": (False, False, True, False),
    "beta_sigmoid_neg_eigval": (False, False, True, True),
    "all": (True, True, True, True),
}
#: input layouts by case: make_inputs arguments
LAYOUTS: dict[str, dict] = {
    "batched_gva": dict(batch_size=2, seq_len=37, num_qk_heads=1, num_v_heads=2, with_initial_state=True),
    "varlen": dict(seqlens=[19, 0, 30], num_qk_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12,
                   with_initial_state=True),
}


def _raw_inputs(layout: str, activation: str, seed: int = 3) -> tuple[dict, dict]:
    """(float32 call inputs with raw gate/beta where the case asks, the same values in float64)."""
    use_gate, with_bias, use_sigmoid, neg_eigval = ACTIVATIONS[activation]
    x = make_inputs(**LAYOUTS[layout], seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    options: dict = dict(use_beta_sigmoid_in_kernel=use_sigmoid, allow_neg_eigval=neg_eigval)
    num_v_heads = x["v"].shape[-2]
    if use_gate:
        x["g"] = 2.0 * torch.randn(x["g"].shape, generator=gen, dtype=torch.float64)  # the raw gate a
        x["A_log"] = torch.empty(num_v_heads, dtype=torch.float64).uniform_(1, 16, generator=gen).log()
        if with_bias:
            x["dt_bias"] = torch.randn(num_v_heads, generator=gen, dtype=torch.float64)
        options["use_gate_in_kernel"] = True
    if use_sigmoid:
        x["beta"] = 2.0 * torch.randn(x["beta"].shape, generator=gen, dtype=torch.float64)  # logits
    rounded = {n: (t.float() if t.is_floating_point() else t) for n, t in x.items()}
    exact = {n: (t.float().double() if t.is_floating_point() else t) for n, t in x.items()}
    return {**rounded, **options}, {**exact, **options}


def _by_hand(x: dict) -> dict:
    """The definition's arguments: the activations of fla's documentation written out."""
    g, beta = x["g"], x["beta"]
    if x.get("use_gate_in_kernel"):
        bias = x.get("dt_bias")
        g = -x["A_log"].exp() * F.softplus(g if bias is None else g + bias)
    if x["use_beta_sigmoid_in_kernel"]:
        beta = torch.sigmoid(beta) * (2.0 if x["allow_neg_eigval"] else 1.0)
    return dict(q=x["q"], k=x["k"], v=x["v"], g=g, beta=beta, initial_state=x.get("initial_state"),
                cu_seqlens=x.get("cu_seqlens"))


def _leaves(x: dict) -> dict:
    return {n: (t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for n, t in x.items()}


def _serves(backend: str, entry: str, x: dict, grad: bool) -> Optional[str]:
    reasons = BACKENDS[backend].unsupported_reasons(CallSpec.of(entry, x["q"], x["v"], 16, grad))
    return reason_text(reasons) or None


def _check_against_definition(o, s, leaves, exact_leaves, grads: bool) -> None:
    ro, rs = naive_recurrent_gated_delta_rule(**_by_hand(exact_leaves), use_qk_l2norm_in_kernel=True)
    assert o.shape == ro.shape and s.shape == rs.shape
    assert rmse_ratio(ro, o) < FORWARD_BOUND and rmse_ratio(rs, s) < FORWARD_BOUND
    if not grads:
        return
    gen = torch.Generator().manual_seed(11)
    weights = (torch.randn(ro.shape, generator=gen, dtype=torch.float64),
               torch.randn(rs.shape, generator=gen, dtype=torch.float64))
    ((o.double() * weights[0]).sum() + (s.double() * weights[1]).sum()).backward()
    ((ro * weights[0]).sum() + (rs * weights[1]).sum()).backward()
    names = [n for n, t in leaves.items() if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert {"g", "beta"} <= set(names)
    for name in names:
        got, want = leaves[name].grad, exact_leaves[name].grad
        assert got is not None and got.dtype == leaves[name].dtype and got.shape == leaves[name].shape, name
        assert rmse_ratio(want, got) < GRAD_BOUND, name


@pytest.mark.parametrize("backend", ["torch", "cpu", "recurrent"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_chunked_call_activations_against_the_definition(backend: str, layout: str, activation: str) -> None:
    x, exact = _raw_inputs(layout, activation)
    reason = _serves(backend, "chunk", x, True)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    leaves, exact_leaves = _leaves(x), _leaves(exact)
    o, s = torch_gdr.chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                            chunk_size=16, backend=backend)
    _check_against_definition(o, s, leaves, exact_leaves, grads=True)


@pytest.mark.parametrize("backend", ["torch", "cpu", "recurrent"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("activation", ["gate", "all"])
def test_token_by_token_activations_against_the_definition(backend: str, layout: str, activation: str) -> None:
    x, exact = _raw_inputs(layout, activation)
    grads = _serves(backend, "step", x, True) is None
    if not grads and _serves(backend, "step", x, False) is not None:
        pytest.skip(f"{backend}: {_serves(backend, 'step', x, False)}")
    leaves, exact_leaves = _leaves(x), _leaves(exact)
    with torch.set_grad_enabled(grads):
        o, s = torch_gdr.fused_recurrent_gated_delta_rule(**(leaves if grads else x), output_final_state=True,
                                                          use_qk_l2norm_in_kernel=True, backend=backend)
    _check_against_definition(o, s, leaves, exact_leaves, grads=grads)


def _gradcheck_inputs(seqlens: Optional[list[int]]) -> tuple:
    x = make_inputs(batch_size=1, seq_len=5, seqlens=seqlens, num_qk_heads=1, num_v_heads=2, head_k_dim=3,
                    head_v_dim=2, with_initial_state=True, seed=7)
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(x["g"].shape, generator=gen, dtype=torch.float64)
    beta_logits = torch.randn(x["beta"].shape, generator=gen, dtype=torch.float64)
    A_log = torch.tensor([0.3, -0.5], dtype=torch.float64)
    dt_bias = torch.tensor([0.2, -0.1], dtype=torch.float64)
    tensors = tuple(t.requires_grad_() for t in (x["q"], x["k"], x["v"], a, beta_logits, A_log, dt_bias,
                                                 x["initial_state"]))
    return tensors, x.get("cu_seqlens")


@pytest.mark.parametrize("seqlens", [None, [3, 0, 4]], ids=["batched", "varlen"])
@pytest.mark.parametrize("entry", ["chunk", "step", pytest.param("op", marks=pytest.mark.slow)])
def test_gradcheck_float64_on_torch(entry: str, seqlens: Optional[list[int]]) -> None:
    """fp64 gradcheck of every input through the chunked call, the step and the public op
    (float64 runs ``"torch"``: its ops apply the activations and their chain rule)."""
    tensors, cu_seqlens = _gradcheck_inputs(seqlens)

    def call(q, k, v, a, beta_logits, A_log, dt_bias, h0):
        if entry == "op":
            return torch.ops.gdr.chunked_gated_delta_rule(q, k, v, a, beta_logits, None, h0, True, True, cu_seqlens,
                                                          16, False, True, A_log, dt_bias, True, True)
        options = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                       allow_neg_eigval=True, cu_seqlens=cu_seqlens, backend="torch")
        if entry == "chunk":
            return torch_gdr.chunk_gated_delta_rule(q, k, v, a, beta_logits, chunk_size=16, **options)
        return torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, a, beta_logits, **options)

    assert torch.autograd.gradcheck(call, tensors, eps=1e-6, atol=1e-7)


def test_activations_compute_in_float32_for_half_inputs() -> None:
    """A bfloat16 raw gate and logits give the float32 activations (fla's), not bfloat16 ones."""
    x = make_inputs(seq_len=20, dtype=torch.bfloat16, seed=4)
    gen = torch.Generator().manual_seed(2)
    a = (3.0 * torch.randn(x["g"].shape, generator=gen)).bfloat16()
    logits = (3.0 * torch.randn(x["beta"].shape, generator=gen)).bfloat16()
    A_log, dt_bias = torch.tensor([0.5, 2.0]), torch.tensor([0.25, -1.0])
    fused = torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], a, logits, use_gate_in_kernel=True,
                                             A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                                             output_final_state=True, backend="torch")
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)
    by_hand = torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, logits.float().sigmoid(),
                                               output_final_state=True, backend="torch")
    assert torch.equal(fused[0], by_hand[0]) and torch.equal(fused[1], by_hand[1])


def _varlen_call(**extra):
    x = make_inputs(seqlens=[20, 0, 33], seed=5)
    return torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"],
                                            output_final_state=True, chunk_size=16, backend="torch", **extra)


def test_cu_seqlens_cpu_and_chunk_indices_give_the_same_result() -> None:
    cu = torch.tensor([0, 20, 20, 53])
    # fla's rows [sequence, chunk] at chunk size 16: 20 tokens -> 2 chunks, 0 -> none, 33 -> 3
    indices = torch.tensor([[0, 0], [0, 1], [2, 0], [2, 1], [2, 2]], dtype=torch.int32)
    plain = _varlen_call()
    with_metadata = _varlen_call(cu_seqlens_cpu=cu.clone(), chunk_indices=indices)
    assert torch.equal(plain[0], with_metadata[0]) and torch.equal(plain[1], with_metadata[1])


def test_cu_seqlens_cpu_is_the_copy_the_call_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``cu_seqlens_cpu`` the call reads its values and not those of ``cu_seqlens`` (on an
    accelerator, where the equality check is off by default, that saves the host sync)."""
    import torch_gdr._validate as validate

    monkeypatch.setattr(validate, "_readable", lambda *tensors: False)  # as for device tensors
    x = make_inputs(seqlens=[20, 0, 33], seed=5)
    wrong = torch.tensor([0, 10, 10, 53])
    o, s = torch_gdr.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=wrong,
                                            cu_seqlens_cpu=x["cu_seqlens"], output_final_state=True, chunk_size=16,
                                            backend="torch")
    plain = _varlen_call()
    assert torch.equal(o, plain[0]) and torch.equal(s, plain[1])


def test_transpose_state_layout_is_state_v_first_with_a_warning() -> None:
    x = make_inputs(seq_len=20, with_initial_state=True, seed=6)
    h0_v_first = x["initial_state"].transpose(-1, -2).contiguous()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    want = torch_gdr.chunk_gated_delta_rule(*args, initial_state=h0_v_first, output_final_state=True,
                                            state_v_first=True, backend="torch")
    for function in (torch_gdr.chunk_gated_delta_rule, torch_gdr.fused_recurrent_gated_delta_rule):
        with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
            got = function(*args, initial_state=h0_v_first, output_final_state=True, transpose_state_layout=True,
                           backend="torch")
        assert torch.allclose(got[0], want[0], atol=1e-12) and torch.allclose(got[1], want[1], atol=1e-12)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="^transpose_state_layout: .*only one"):
                function(*args, state_v_first=True, transpose_state_layout=True, backend="torch")


def _bad_call(function: str, **extra):
    x = make_inputs(seqlens=[5, 6], num_qk_heads=1, num_v_heads=2, seed=9)
    call = getattr(torch_gdr, function)
    return call(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=extra.pop("cu_seqlens", x["cu_seqlens"]),
                backend="torch", **extra)


HV = 2
BAD_ARGUMENTS = [
    (dict(use_gate_in_kernel=True), ValueError, "^A_log: required with use_gate_in_kernel"),
    (dict(A_log=torch.zeros(HV)), ValueError, "^A_log: only used with use_gate_in_kernel"),
    (dict(dt_bias=torch.zeros(HV)), ValueError, "^dt_bias: only used with use_gate_in_kernel"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV + 1)), ValueError, r"^A_log: expected shape \[HV\] = \[2\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(1, HV)), ValueError, r"^A_log: expected shape \[HV\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV, dtype=torch.int64)), TypeError, "^A_log: expected a floating"),
    (dict(use_gate_in_kernel=True, A_log=[0.0, 0.0]), TypeError, "^A_log: expected a torch.Tensor"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(3)), ValueError,
     r"^dt_bias: expected shape \[HV\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV, device="meta")), ValueError,
     "^dt_bias: expected a tensor on cpu"),
    (dict(use_gate_in_kernel=1, A_log=torch.zeros(HV)), TypeError, "^use_gate_in_kernel: expected a bool"),
    (dict(use_beta_sigmoid_in_kernel="yes"), TypeError, "^use_beta_sigmoid_in_kernel: expected a bool"),
    (dict(allow_neg_eigval=True), ValueError, "^allow_neg_eigval: requires use_beta_sigmoid_in_kernel"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 5, 10])), ValueError, "^cu_seqlens_cpu: expected the values"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 11])), ValueError, "^cu_seqlens_cpu: expected the shape"),
    (dict(cu_seqlens_cpu=torch.tensor([0.0, 5.0, 11.0])), TypeError, "^cu_seqlens_cpu: expected dtype int32"),
    (dict(cu_seqlens_cpu=torch.tensor([0, 5, 11], device="meta")), ValueError, "^cu_seqlens_cpu: expected a CPU"),
    (dict(cu_seqlens=None, cu_seqlens_cpu=torch.tensor([0, 11])), ValueError, "^cu_seqlens_cpu: .*needs cu_seqlens"),
    (dict(transpose_state_layout=1), TypeError, "^transpose_state_layout: expected a bool"),
]
CHUNK_ONLY = [
    (dict(chunk_indices=torch.tensor([[0, 0], [1, 0], [1, 1]])), ValueError, "^chunk_indices: expected fla's"),
    (dict(chunk_indices=torch.tensor([0, 1])), ValueError, r"^chunk_indices: expected shape \[num_chunks, 2\]"),
    (dict(cu_seqlens=None, chunk_indices=torch.tensor([[0, 0]])), ValueError, "^chunk_indices: .*needs cu_seqlens"),
]
STEP_ONLY = [
    (dict(gk=torch.zeros(1)), ValueError, "^gk: per-channel decays"),
    (dict(gv=torch.zeros(1)), ValueError, "^gv: per-channel decays"),
]


@pytest.mark.parametrize("function", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
@pytest.mark.parametrize("extra, error, match", BAD_ARGUMENTS + CHUNK_ONLY + STEP_ONLY,
                         ids=lambda p: p if isinstance(p, str) else None)
def test_bad_arguments_raise_naming_the_argument(function: str, extra: dict, error: type, match: str) -> None:
    only_chunk, only_step = any(extra is c[0] for c in CHUNK_ONLY), any(extra is c[0] for c in STEP_ONLY)
    if (only_chunk and function != "chunk_gated_delta_rule") or (only_step and function == "chunk_gated_delta_rule"):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            _bad_call(function, **dict(extra))
        return
    with pytest.raises(error, match=match):
        _bad_call(function, **dict(extra))


@pytest.mark.parametrize("missing, flag", [("g", "use_gate_in_kernel"), ("beta", "use_beta_sigmoid_in_kernel")])
def test_step_without_the_tensor_an_activation_needs_raises(missing: str, flag: str) -> None:
    x = make_inputs(seq_len=4, seed=1)
    x[missing] = None
    extra = dict(A_log=torch.zeros(2)) if flag == "use_gate_in_kernel" else {}
    with pytest.raises(ValueError, match=f"^{missing}: .*required with {flag}"):
        torch_gdr.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                   **{flag: True}, **extra)


# --- the activation arguments of the ops themselves -----------------------------------------

def _op_kwargs(leaves: dict) -> dict:
    """The public op's arguments (its schema's names) of a case's inputs."""
    names = ("use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")
    return dict(q=leaves["q"], k=leaves["k"], v=leaves["v"], g=leaves["g"], beta=leaves["beta"],
                initial_state=leaves.get("initial_state"), output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=leaves.get("cu_seqlens"), chunk_size=16,
                **{n: leaves[n] for n in names if n in leaves})


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("activation", ["gate_without_dt_bias", "all"])
def test_public_op_activations_against_the_definition(backend: str, layout: str, activation: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.ops.gdr.chunked_gated_delta_rule`` with the activation arguments: forward and
    every gradient (its backward op, ``A_log`` and ``dt_bias`` included) against the definition."""
    x, exact = _raw_inputs(layout, activation)
    reason = _serves(backend, "chunk", x, True)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    monkeypatch.setenv("TORCH_GDR_BACKEND", backend)
    leaves, exact_leaves = _leaves(x), _leaves(exact)
    o, s = torch.ops.gdr.chunked_gated_delta_rule(**_op_kwargs(leaves))
    _check_against_definition(o, s, leaves, exact_leaves, grads=True)


@pytest.mark.slow
@pytest.mark.parametrize("op", ["public", "cpu"])
def test_opcheck_with_the_activation_arguments(op: str) -> None:
    """torch.library's checks of the forward and backward ops given every activation argument
    (the public op on float32 CPU tensors runs ``"cpu"``)."""
    x, _ = _raw_inputs("varlen", "all")
    reason = _serves("cpu", "chunk", x, True)
    if reason is not None:
        pytest.skip(f"cpu: {reason}")
    leaves = _leaves(x)
    args = tuple(leaves[n] for n in ("q", "k", "v", "g", "beta"))
    options = (True, x["cu_seqlens"], 16, False)
    gating = (True, leaves["A_log"], leaves["dt_bias"], True, True)
    forward, backward = ((torch.ops.gdr.chunked_gated_delta_rule, torch.ops.gdr.chunked_gated_delta_rule_backward)
                         if op == "public" else (torch.ops.gdr._cpu_fwd, torch.ops.gdr._cpu_bwd))
    keep = () if op == "public" else (True, False)  # save_chunk_states, strict
    torch.library.opcheck(forward.default, args + (None, leaves["initial_state"], True) + options + keep + gating)
    with torch.no_grad():
        outputs = forward(*args, None, leaves["initial_state"], True, *options, *keep, *gating)
    states = outputs[2] if op == "cpu" else None
    grad_o, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
    plain = tuple(t.detach() for t in args)
    torch.library.opcheck(backward.default, (grad_o, dht) + plain + (None, x["initial_state"]) + options
                          + (states, False) + tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in gating))


@pytest.mark.slow  # a first compile in the process takes seconds
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_compile_fullgraph_with_the_activation_arguments(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The public op with every activation argument under ``torch.compile(fullgraph=True)``:
    the eager values and gradients (``A_log`` and ``dt_bias`` included)."""
    x, _ = _raw_inputs("varlen", "all")
    reason = _serves(backend, "chunk", x, True)
    if reason is not None:
        pytest.skip(f"{backend}: {reason}")
    monkeypatch.setenv("TORCH_GDR_BACKEND", backend)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

    def loss(q, k, v, g, beta, A_log, dt_bias, initial_state):
        o, s = torch.ops.gdr.chunked_gated_delta_rule(q, k, v, g, beta, None, initial_state, True, True,
                                                      x["cu_seqlens"], 16, False, True, A_log, dt_bias, True, True)
        return (o * o).sum() + s.sum()

    assert_compiled_matches_eager(loss, x, names)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("activation", ["gate", "all"])
def test_pool_step_activations_against_the_definition(backend: str, activation: str) -> None:
    """The decode step over a state pool with a raw gate and beta logits (one token per
    sequence, the first of each non-empty varlen sequence): the outputs and the rows written
    are the definition's from each sequence's row."""
    x, exact = _raw_inputs("varlen", activation)
    if _serves(backend, "pool_step", x, False) is not None:
        pytest.skip(f"{backend}: {_serves(backend, 'pool_step', x, False)}")
    first = torch.tensor([0, 19])  # the varlen layout's sequences of 19 and 30 tokens start there
    h0 = x["initial_state"][[0, 2]]
    rows = torch.tensor([3, 1])
    pool = torch.zeros(5, *h0.shape[1:])
    pool[rows] = h0
    names = ("use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")
    options = {n: x[n] for n in names if n in x}
    token = {n: x[n][0, first][:, None] for n in ("q", "k", "v", "g", "beta")}  # [N = 2, T = 1, ...]
    with torch.no_grad():
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
            token["q"], token["k"], token["v"], token["g"], beta=token["beta"], initial_state=pool,
            ssm_state_indices=rows, use_qk_l2norm_in_kernel=True, backend=backend, **options)
    hand = _by_hand({**{n: exact[n][0, first][:, None] for n in ("q", "k", "v", "g", "beta")},
                     **{n: exact[n] for n in names if n in exact}})
    ro, rs = naive_recurrent_gated_delta_rule(hand["q"], hand["k"], hand["v"], hand["g"], hand["beta"],
                                              initial_state=exact["initial_state"][[0, 2]], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    assert rmse_ratio(ro, o) < FORWARD_BOUND
    assert rmse_ratio(rs, pool[rows]) < FORWARD_BOUND


#: the activation errors the op's schema can carry (it types bools and tensors itself)
OP_BAD_ARGUMENTS = [case for case in BAD_ARGUMENTS
                    if all(isinstance(t, (bool, torch.Tensor)) for t in case[0].values())
                    and not any(n.startswith("cu_seqlens") for n in case[0])]


@pytest.mark.parametrize("extra, error, match", OP_BAD_ARGUMENTS, ids=lambda p: p if isinstance(p, str) else None)
def test_the_public_op_checks_the_activation_arguments(extra: dict, error: type, match: str) -> None:
    x = make_inputs(seqlens=[5, 6], num_qk_heads=1, num_v_heads=2, seed=9)
    with pytest.raises(error, match=match):
        torch.ops.gdr.chunked_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"],
                                               **extra)
