"""The PyPTO backward kernel, run through PyPTO's CPU interpreter by the public call
(``backend="pypto"``, autograd), against autograd through the float64 recurrence.

Loss ``sum(o * grad_o) + sum(final_state * grad_final_state)``; tolerance, elementwise on
every gradient for fp32 inputs: ``|kernel - ref| <= 1e-3 |ref| + 1e-4``.

Cases with fla's activations (``Case.activations``) pass the raw gate, beta logits,
``A_log`` and ``dt_bias``; the reference applies the activations written out here in
float64, and the forward's o and final state are checked too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr import testing

from torch_gdr.ops.pypto import is_pypto_available

if not is_pypto_available():
    pytest.skip("pypto==0.2.0 is not importable (pip install 'torch_gdr[npu]')", allow_module_level=True)

from torch_gdr.ops.pypto import backward as pypto_backward  # noqa: E402
from torch_gdr.ops.pypto import kernel_chunk_size  # noqa: E402
from torch_gdr.ops.pypto.kernel import chunk_offsets  # noqa: E402
from torch_gdr.ops.pypto.backward import (  # noqa: E402
    chunk_states_torch,
    pypto_chunk_gated_delta_rule_bwd,
)
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from torch_gdr.ops.torch.utils import l2norm  # noqa: E402

GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state", "dA_log", "ddt_bias")


@dataclass
class Case:
    lens: list[int]
    chunk_size: int
    num_qk_heads: int = 1
    num_v_heads: int = 1
    head_k_dim: int = 64
    head_v_dim: int = 64
    with_initial_state: bool = False
    use_qk_l2norm: bool = True
    scale: Optional[float] = None
    gate: Optional[float] = None  # a constant g instead of logsigmoid(randn)
    seed: int = 0
    #: fla's activations: (use_gate_in_kernel, with dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    activations: tuple[bool, bool, bool, bool] = (False, False, False, False)


#: Raw gates this large pass softplus's threshold (softplus(x) = x, slope 1 above 20) and float32's
#: exp range (exp(100) = inf: log1p(exp(x)) there would be a reset, not the decay -exp(A_log) x).
ABOVE_THRESHOLD = 100.0


def _raw_activation_inputs(x: dict, case: Case) -> dict:
    """``x`` with the raw gate and beta logits where ``case.activations`` asks, ``A_log``,
    ``dt_bias`` and the call's activation flags (``x["gating"]``); a raw gate of every
    sequence's first token above softplus's threshold."""
    use_gate, with_bias, use_sigmoid, neg_eigval = case.activations
    gen = torch.Generator().manual_seed(case.seed + 2)
    num_v_heads = x["v"].shape[-2]
    x.update(A_log=None, dt_bias=None, gating=dict(use_beta_sigmoid_in_kernel=use_sigmoid,
                                                   allow_neg_eigval=neg_eigval))
    if use_gate:
        x["g"] = 2.0 * torch.randn(x["g"].shape, generator=gen)
        x["g"][x["cu_seqlens"][:-1].long().clamp(max=max(x["g"].shape[0] - 1, 0))] = ABOVE_THRESHOLD
        x["A_log"] = torch.empty(num_v_heads).uniform_(0.05, 2.0, generator=gen).log()
        if with_bias:
            x["dt_bias"] = torch.randn(num_v_heads, generator=gen)
        x["gating"]["use_gate_in_kernel"] = True
    if use_sigmoid:
        x["beta"] = 2.0 * torch.randn(x["beta"].shape, generator=gen)
    return x


def _activated_by_hand(g: torch.Tensor, beta: torch.Tensor, A_log: Optional[torch.Tensor],
                       dt_bias: Optional[torch.Tensor], gating: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's documented activations, written out (float64 in, float64 out)."""
    if gating.get("use_gate_in_kernel"):
        g = -A_log.exp() * F.softplus(g if dt_bias is None else g + dt_bias)
    if gating["use_beta_sigmoid_in_kernel"]:
        beta = torch.sigmoid(beta) * (2.0 if gating["allow_neg_eigval"] else 1.0)
    return g, beta


def make_inputs(case: Case, dtype: torch.dtype = torch.float32) -> dict:
    """Packed TND inputs, realistic gates, a random grad_o, and a random final-state gradient
    whenever there is an initial state (a training step that carries a state)."""
    x = testing.make_inputs(seqlens=case.lens, token_major=True, num_qk_heads=case.num_qk_heads,
                            num_v_heads=case.num_v_heads, head_k_dim=case.head_k_dim, head_v_dim=case.head_v_dim,
                            with_initial_state=case.with_initial_state, initial_state_scale=0.5,
                            # without the in-kernel norm, unnormalised keys make the state blow up
                            normalize_qk=not case.use_qk_l2norm, seed=case.seed)
    if case.gate is not None:
        x["g"] = torch.full_like(x["g"], case.gate)
    gen = torch.Generator().manual_seed(case.seed + 1)
    grad_o = torch.randn(x["v"].shape, generator=gen)
    initial_state = x["initial_state"].float() if case.with_initial_state else None
    grad_final_state = torch.randn(initial_state.shape, generator=gen) if case.with_initial_state else None
    x = _raw_activation_inputs(x, case)
    inputs = {name: x[name].to(dtype) for name in ("q", "k", "v", "g", "beta")}
    return dict(inputs, grad_o=grad_o.to(dtype), cu_seqlens=x["cu_seqlens"].int(), initial_state=initial_state,
                grad_final_state=grad_final_state, A_log=x["A_log"], dt_bias=x["dt_bias"], gating=x["gating"])


def _head_params(x: dict) -> list[torch.Tensor]:
    """The call's A_log and dt_bias, those it has."""
    return [t for t in (x["A_log"], x["dt_bias"]) if t is not None]


def reference_grads(x: dict, *, scale: float, use_qk_l2norm: bool,
                    outputs: Optional[dict] = None) -> list[Optional[torch.Tensor]]:
    """Autograd through the float64 per-token recurrence (on the inputs as given, so bf16
    inputs are compared on their rounded values), fla's activations applied by hand first
    where the call asks (then the gradients of A_log and dt_bias follow, None where
    absent). ``outputs``, if given, receives the reference o and final state."""
    leaves = [x[n].double().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    params = [t.double().requires_grad_() for t in _head_params(x)]
    A_log, dt_bias = (params + [None, None])[:2] if x["A_log"] is not None else (None, None)
    g, beta = _activated_by_hand(leaves[3], leaves[4], A_log, dt_bias, x["gating"])
    initial = x["initial_state"]
    initial = None if initial is None else initial.double().requires_grad_()
    o, final_state = naive_recurrent_gated_delta_rule(
        *(t.unsqueeze(0) for t in leaves[:3] + [g, beta]), scale=scale, initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=x["cu_seqlens"].long())
    if outputs is not None:
        outputs.update(o=o[0].detach(), final_state=final_state.detach())
    loss = (o[0] * x["grad_o"].double()).sum()
    if x["grad_final_state"] is not None:
        loss = loss + (final_state * x["grad_final_state"].double()).sum()
    wrt = leaves + ([initial] if initial is not None else []) + params
    grads = list(torch.autograd.grad(loss, wrt))
    grads = grads[:5] + ([grads[5]] if initial is not None else [None]) + grads[len(wrt) - len(params):]
    if x["gating"].get("use_gate_in_kernel"):
        grads += [None] * (8 - len(grads))  # no dt_bias
    return grads


def kernel_grads(x: dict, case: Case, *, scale: float, chunk_states: Optional[torch.Tensor] = None,
                 outputs: Optional[dict] = None) -> tuple:
    """The kernel's gradients: through the public call (``backend="pypto"``, autograd) or,
    given ``chunk_states``, through the host function that takes them. With fla's
    activations, those of A_log and dt_bias (None where absent) follow; ``outputs``, if
    given, receives the public call's o and final state."""
    if chunk_states is not None:
        return pypto_chunk_gated_delta_rule_bwd(
            x["grad_o"], x["grad_final_state"], *(x[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")),
            x["initial_state"], chunk_states, scale=scale, use_qk_l2norm_in_kernel=case.use_qk_l2norm,
            chunk_size=case.chunk_size)
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    initial = x["initial_state"]
    initial = None if initial is None else initial.detach().clone().requires_grad_()
    params = {n: (None if x[n] is None else x[n].detach().clone().requires_grad_()) for n in ("A_log", "dt_bias")}
    launches = pypto_backward.launch_count()
    o, final_state = torch_gdr.chunk_gated_delta_rule(
        *leaves, scale=scale, initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=case.use_qk_l2norm, cu_seqlens=x["cu_seqlens"], chunk_size=case.chunk_size,
        backend="pypto", **params, **x["gating"])
    if outputs is not None:
        outputs.update(o=o.detach(), final_state=final_state.detach())
    loss = (o * x["grad_o"]).sum()
    if x["grad_final_state"] is not None:
        loss = loss + (final_state * x["grad_final_state"]).sum()
    wrt = leaves + ([initial] if initial is not None else []) + [t for t in params.values() if t is not None]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to the pure-torch backward
        grads = list(torch.autograd.grad(loss, wrt))
    assert pypto_backward.launch_count() == launches + (1 if sum(case.lens) else 0), "the kernel did not run"
    grads = grads[:5] + ([grads[5]] if initial is not None else [None]) + grads[len(leaves) + (initial is not None):]
    if params["A_log"] is not None and params["dt_bias"] is None:
        grads.append(None)
    return tuple(grads)


def assert_grads_close(got: tuple, want: list, *, rtol: float = 1e-3, atol: float = 1e-4) -> None:
    for name, a, b in zip(GRAD_NAMES, got, want):
        if b is None:
            assert a is None, f"{name}: expected None (no initial state), got a tensor"
            continue
        assert a.shape == b.shape, f"{name}: shape {list(a.shape)}, expected {list(b.shape)}"
        err = (a.double() - b).abs()
        bad = int((err > rtol * b.abs() + atol).sum())
        assert bad == 0, f"{name}: {bad}/{b.numel()} elements out of tolerance, max abs err {err.max():.3g}"


CASES = {
    "aligned_T128_l64": Case([128], 64),
    "unaligned_T130_l64": Case([130], 64),
    "varlen_100_17_0_70_gva_2to4_initial_state": Case(
        [100, 17, 0, 70], 64, num_qk_heads=2, num_v_heads=4, with_initial_state=True),
    "l2norm_off_K128_V128_l32": Case(
        [70, 33], 32, head_k_dim=128, head_v_dim=128, with_initial_state=True, use_qk_l2norm=False, scale=0.7),
    "K64_V128": Case([90], 64, head_k_dim=64, head_v_dim=128, with_initial_state=True),
    "no_decay_g0": Case([70], 32, with_initial_state=True, gate=0.0),
    "strong_decay_g-30": Case([70], 32, with_initial_state=True, gate=-30.0),
}


#: Cases of the table that run with the slow ones (CI runs both), to keep the default suite
#: within its time: the longest two, whose features (varlen with an empty sequence and GVA,
#: K != V) the slow gated cases and
#: test_training_hands_the_forward_kernels_chunk_states_to_the_backward also reach, and the
#: three whose features (no l2norm, constant decays) the default runs reach elsewhere
#: (test_numerics's extreme decays, the forward's l2norm-off case), and the aligned length,
#: whose full chunks the unaligned case runs too (before its tail).
SLOW_TABLE_CASES = ("varlen_100_17_0_70_gva_2to4_initial_state", "K64_V128", "l2norm_off_K128_V128_l32",
                    "no_decay_g0", "strong_decay_g-30", "aligned_T128_l64")


@pytest.mark.parametrize("case", [pytest.param(c, id=n, marks=[pytest.mark.slow] if n in SLOW_TABLE_CASES else [])
                                  for n, c in CASES.items()])
def test_gradients_match_autograd_through_the_recurrence(case: Case) -> None:
    x = make_inputs(case)
    scale = case.head_k_dim ** -0.5 if case.scale is None else case.scale
    got = kernel_grads(x, case, scale=scale)
    for grad, name in zip(got[:5], ("q", "k", "v", "g", "beta")):
        assert grad.dtype == torch.float32 and grad.shape == x[name].shape
    assert_grads_close(got, reference_grads(x, scale=scale, use_qk_l2norm=case.use_qk_l2norm))


SLOW_CASES = {
    "l128_K128_V128_gva_1to2_long": Case([300, 130], 128, num_qk_heads=1, num_v_heads=2, head_k_dim=128,
                                         head_v_dim=128, with_initial_state=True),
    "l64_K128_V64_gva_1to2": Case([90, 40], 64, num_qk_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=64,
                                  with_initial_state=True),
    "l64_K256_V256_gva_1to2": Case([70, 33], 64, num_qk_heads=1, num_v_heads=2, head_k_dim=256, head_v_dim=256,
                                   with_initial_state=True),
    "l128_K256_V128": Case([200], 128, head_k_dim=256, head_v_dim=128, with_initial_state=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES.values()), ids=list(SLOW_CASES))
def test_larger_cases_match_autograd_through_the_recurrence(case: Case) -> None:
    x = make_inputs(case)
    scale = case.head_k_dim ** -0.5
    assert_grads_close(kernel_grads(x, case, scale=scale), reference_grads(x, scale=scale, use_qk_l2norm=True))


#: fla's activations in the kernels (Case.activations: gate, dt_bias, beta sigmoid, neg eigval)
ACTIVATION_CASES = {
    "all_varlen_70_0_33_gva_1to2_initial_state": Case(
        [70, 0, 33], 64, num_qk_heads=1, num_v_heads=2, with_initial_state=True,
        activations=(True, True, True, True)),
    "gate_without_dt_bias_T128": Case([128], 64, activations=(True, False, False, False)),
    "beta_sigmoid_T100_gva_2to4_initial_state": Case(
        [100], 64, num_qk_heads=2, num_v_heads=4, with_initial_state=True, activations=(False, False, True, False)),
    "all_K64_V256_varlen_40_25": Case([40, 25], 64, head_k_dim=64, head_v_dim=256, with_initial_state=True,
                                      activations=(True, True, True, True)),
    # 8 (sequence, value head) pairs: the heads' cube work merged (kernel_bwd.MIN_MERGED_PAIRS) at K = V = 256
    "all_K256_V256_varlen_70_33_gva_2to4": Case([70, 33], 64, num_qk_heads=2, num_v_heads=4, head_k_dim=256,
                                                head_v_dim=256, with_initial_state=True,
                                                activations=(True, True, True, True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ACTIVATION_CASES.values()), ids=list(ACTIVATION_CASES))
def test_activations_in_the_kernels_match_the_definition(case: Case) -> None:
    """The raw gate, beta logits, A_log and dt_bias through the public call: the forward and
    backward kernels apply the activations (their cache keys say so, and the op layer does
    not: the kernels read the raw values), o, the final state and every gradient against
    the recurrence on activations computed by hand in float64."""
    from torch_gdr import dispatch

    dispatch.cache_clear()
    x = make_inputs(case)
    scale = case.head_k_dim ** -0.5
    got_outputs, want_outputs = {}, {}
    got = kernel_grads(x, case, scale=scale, outputs=got_outputs)
    want = reference_grads(x, scale=scale, use_qk_l2norm=True, outputs=want_outputs)
    for name in ("o", "final_state"):
        err = (got_outputs[name].double() - want_outputs[name]).abs()
        assert bool((err <= 1e-3 * want_outputs[name].abs() + 1e-4).all()), f"{name}: max abs err {err.max():.3g}"
    use_gate, _, use_sigmoid, neg_eigval = case.activations
    assert len(got) == len(want) == (8 if use_gate else 6)  # dA_log, ddt_bias (None without) with the gate
    assert_grads_close(got, want)
    info = dispatch.cache_info()
    for key in info.forward.keys + info.backward.keys:
        assert (key.gate_in_kernel, key.beta_sigmoid_in_kernel, key.allow_neg_eigval) == (
            use_gate, use_sigmoid, neg_eigval), key
    dispatch.cache_clear()


def test_bf16_inputs_give_bf16_gradients_close_to_the_recurrence() -> None:
    """bf16 inputs are computed in fp32; the gradients come back in bf16 (rounded: 2^-8)."""
    case = Case([70], 64, with_initial_state=True)
    x = make_inputs(case, dtype=torch.bfloat16)
    got = kernel_grads(x, case, scale=0.125)
    assert [t.dtype for t in got] == [torch.bfloat16] * 5 + [torch.float32]
    assert_grads_close(got, reference_grads(x, scale=0.125, use_qk_l2norm=True), rtol=1e-2, atol=1e-3)


def test_given_chunk_states_are_read_not_recomputed(monkeypatch) -> None:
    """With chunk_states passed in, the host computes none, and the kernel uses the ones given."""
    case = Case([40, 20], 32, with_initial_state=True)
    x = make_inputs(case)
    k_norm = l2norm(x["k"])
    states = chunk_states_torch(k_norm, x["v"], x["g"], x["beta"], x["cu_seqlens"], x["initial_state"], 32)

    def refuse(*args, **kwargs):
        raise AssertionError("chunk states were recomputed although given")

    monkeypatch.setattr(pypto_backward, "chunk_states_torch", refuse)
    assert_grads_close(kernel_grads(x, case, scale=0.125, chunk_states=states),
                       reference_grads(x, scale=0.125, use_qk_l2norm=True))


def test_the_kernel_ran_cache_entry_and_launch_count() -> None:
    """The backward kernel is cached under its own key (kind "bwd"), reused, and counted; the
    dispatch cache lists the forward and backward kernels apart."""
    from torch_gdr import dispatch

    dispatch.cache_clear()
    pypto_backward.bwd_cache_clear()
    case = Case([40], 32, with_initial_state=True)
    x = make_inputs(case)
    kernel_grads(x, case, scale=0.125)
    x2 = make_inputs(Case([50], 32, seed=1, with_initial_state=True))
    kernel_grads(x2, case, scale=0.125)  # same configuration (T is dynamic; same kernel chunk): a cache hit
    info = pypto_backward.bwd_cache_info()
    assert info.misses == 1 and info.hits == 1 and info.launches == 2
    (key,) = info.keys
    assert key.kind == "bwd" and key.num_seqs == 1
    assert key.chunk_size == kernel_chunk_size(64, 64, 50, num_seqs=1, num_v_heads=1)  # the forward's
    assert pypto_backward.launch_count() == 2
    listed = dispatch.cache_info()
    assert (listed.forward.misses, len(listed.forward.keys)) == (1, 1)
    assert (listed.backward.misses, len(listed.backward.keys), listed.backward.launches) == (1, 1, 2)
    assert all(key.kind == "bwd" for key in listed.backward.keys)
    dispatch.cache_clear()
    assert dispatch.cache_info().forward.keys == () and dispatch.cache_info().backward.keys == ()
    assert pypto_backward.bwd_cache_info() == pypto_backward.BwdCacheInfo(0, 0, (), 0)


@pytest.mark.parametrize("activations", [pytest.param((False, False, False, False), marks=pytest.mark.slow),
                                         (True, True, True, True)], ids=["plain", "activations_in_kernel"])
def test_heads_merged_into_shared_cube_tasks_keep_every_gradient(activations: tuple,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch with enough (sequence, value head) pairs runs its heads' identical cube work
    in shared tasks (``kernel_bwd.default_pass_options``), forced here on a small launch:
    every gradient still matches the recurrence, the gated kernel's included."""
    from torch_gdr.ops.pypto import kernel_bwd

    chosen = []

    def recorded(num_seqs: int, num_v_heads: int) -> dict:
        options = default_pass_options(num_seqs, num_v_heads)
        chosen.append(options)
        return options

    default_pass_options = kernel_bwd.default_pass_options
    monkeypatch.setattr(kernel_bwd, "MIN_MERGED_PAIRS", 1)
    monkeypatch.setattr(kernel_bwd, "default_pass_options", recorded)
    pypto_backward.bwd_cache_clear()
    try:
        case = Case([40, 20], 32, num_qk_heads=1, num_v_heads=2, with_initial_state=True, activations=activations)
        x = make_inputs(case)
        assert_grads_close(kernel_grads(x, case, scale=0.125), reference_grads(x, scale=0.125, use_qk_l2norm=True))
        assert chosen == [{"cube_nbuffer_setting": {-1: kernel_bwd.MERGED_CUBE_SUBGRAPHS}}]
    finally:
        pypto_backward.bwd_cache_clear()


def test_all_sequences_empty_pass_the_final_state_gradient_through() -> None:
    x = make_inputs(Case([0, 0], 64, with_initial_state=True))
    launches = pypto_backward.launch_count()
    got = kernel_grads(x, Case([0, 0], 64), scale=0.125)
    assert all(t.numel() == 0 for t in got[:5])
    assert torch.equal(got[5], x["grad_final_state"])
    assert pypto_backward.launch_count() == launches


@pytest.mark.parametrize(
    ("lens", "chunk_size"), [([100, 17, 0, 70], 64), ([65], 32), ([0], 32), ([33, 0, 0, 129], 128)])
def test_chunk_states_are_the_recurrence_states_at_chunk_boundaries(lens: list[int], chunk_size: int) -> None:
    """Row chunk_offsets[n] + c holds the state after the first c * l tokens of sequence n."""
    case = Case(lens, chunk_size, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8,
                with_initial_state=True)
    x = make_inputs(case)
    states = chunk_states_torch(l2norm(x["k"]), x["v"], x["g"], x["beta"], x["cu_seqlens"], x["initial_state"],
                                chunk_size)
    offsets = chunk_offsets(x["cu_seqlens"], chunk_size).tolist()
    bounds = x["cu_seqlens"].tolist()
    assert states.shape == (offsets[-1], 2, 16, 8) and states.dtype == torch.float32
    for n, length in enumerate(lens):
        assert offsets[n + 1] - offsets[n] == -(-length // chunk_size)
        for c in range(offsets[n + 1] - offsets[n]):
            span = slice(bounds[n], bounds[n] + c * chunk_size)
            _, want = naive_recurrent_gated_delta_rule(
                *(x[name][span].double().unsqueeze(0) for name in ("q", "k", "v", "g", "beta")),
                initial_state=x["initial_state"][n:n + 1].double(), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(states[offsets[n] + c].double(), want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("arg", "shape", "match"),
    [("grad_o", (10, 1, 32), "grad_o"), ("grad_final_state", (1, 1, 64, 64), "grad_final_state"),
     ("chunk_states", (2, 1, 64, 64), "chunk_states")])
def test_bad_shapes_raise_naming_the_argument(arg: str, shape: tuple, match: str) -> None:
    case = Case([40, 10], 32, with_initial_state=True)
    x = make_inputs(case)
    chunk_states = None
    if arg == "chunk_states":
        chunk_states = torch.zeros(shape)  # 40 and 10 tokens in chunks of 32: 3 chunks, not 2
    else:
        x[arg] = torch.zeros(shape)
    with pytest.raises(ValueError, match=match):  # the host function's own checks
        pypto_chunk_gated_delta_rule_bwd(
            x["grad_o"], x["grad_final_state"], *(x[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")),
            x["initial_state"], chunk_states, scale=0.125, use_qk_l2norm_in_kernel=True, chunk_size=32)


def test_training_hands_the_forward_kernels_chunk_states_to_the_backward(monkeypatch) -> None:
    """Through the public call the backward reads the states the forward kernel wrote: the
    host never computes them (no pure-torch pass)."""
    def fail(*args, **kwargs):
        raise AssertionError("the backward recomputed the chunk states")

    monkeypatch.setattr(pypto_backward, "chunk_states_torch", fail)
    case = Case([40, 0, 17], 32, num_qk_heads=1, num_v_heads=2, with_initial_state=True)  # varlen, GVA
    x = make_inputs(case)
    scale = case.head_k_dim ** -0.5
    assert_grads_close(kernel_grads(x, case, scale=scale), reference_grads(x, scale=scale, use_qk_l2norm=True))


@pytest.mark.parametrize("named", [True, False], ids=["named", "default"])
def test_a_failing_backward_kernel_follows_the_fallback_policy(monkeypatch, named: bool) -> None:
    """A named backend's backward raises; the default backend's warns once and returns the
    pure-torch backward's gradients."""
    from torch_gdr import _fallback
    from torch_gdr.dispatch import registry
    from torch_gdr.ops.pypto import op as pypto_op

    def broken(*args, **kwargs):
        raise RuntimeError("simulated backward build failure")

    monkeypatch.setattr(pypto_op, "launch_backward", broken)
    monkeypatch.delenv("TORCH_GDR_BACKEND", raising=False)
    monkeypatch.delenv("TORCH_GDR_STRICT", raising=False)
    monkeypatch.setattr(_fallback, "_warned", set())
    if not named:
        monkeypatch.setitem(registry.DEVICE_ORDERS, ("chunk", "cpu"), ("pypto", "torch"))
    case = Case([40], 32, with_initial_state=True)
    x = make_inputs(case)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    o, _ = torch_gdr.chunk_gated_delta_rule(*leaves, cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True,
                                            backend="pypto" if named else None)
    if named:
        with pytest.raises(_fallback.PyptoBackendError, match="simulated backward build failure"):
            o.sum().backward()
        return
    with pytest.warns(_fallback.PyptoFallbackWarning, match="simulated backward build failure"):
        o.sum().backward()
    reference = [t.detach().clone().requires_grad_() for t in leaves]
    o_ref, _ = torch_gdr.chunk_gated_delta_rule(*reference, cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True,
                                                backend="torch")
    o_ref.sum().backward()
    for got, want in zip(leaves, reference):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)
