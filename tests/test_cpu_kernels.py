"""The fused C++/OpenMP CPU kernels (torch_gdr.ops.cpu) against the float64 per-token
recurrence (outputs, states, every gradient by autograd through it) and the pure-torch
chunked path, on the shapes of test_reference.py and test_backward.py; extreme decays,
NaN containment, threads, and the fallback without a compiler.

The kernels compute in float32: errors are rmse ratios ``rms(ref - out) / rms(ref)`` as in
fla's tests (see gdr-spec.md), with the float64 recurrence as ``ref``. The first test to
run builds the extension into the cache directory (minutes on a loaded 2-core machine; the
build is reused by every later process).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

import torch_gdr.ops.cpu.kernels as cpu
from tests.helpers import make_inputs as make_forward_inputs
from tests.test_backward import CASES as BACKWARD_CASES
from tests.test_backward import Case, make_inputs, reference_grads, rmse_ratio
from tests.test_reference import CASES as FORWARD_CASES
from torch_gdr._gating import Gating
from torch_gdr._layout import canonical_call as _canonical_call
from torch_gdr.ops.torch.chunk import chunk_gated_delta_rule_fwd
from torch_gdr.ops.torch.chunk_backward import chunk_gated_delta_rule_bwd
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}")

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def canonical_call(*args):
    """The :class:`GdrCall` of the kernels' positional arguments (q, k, v, g, beta, scale,
    initial_state, use_qk_l2norm, cu_seqlens, chunk_size), key-first states."""
    return _canonical_call(*args, False)


@pytest.fixture(params=[1, 2], ids=["fused", "segmented"])
def stages(request, monkeypatch) -> int:
    """Both ways of running the stages (per unit in one thread; over segments, the
    intra-chunk part parallel over chunks), whatever the thread count would choose."""
    from torch_gdr.ops.cpu import kernels

    monkeypatch.setattr(kernels, "STAGES", request.param)
    return request.param
FP32_BOUND = 2e-6  # rmse ratio of a float32 kernel against the float64 recurrence


def _forward_inputs(case: str, l2norm: bool, dtype=torch.float32) -> dict:
    inputs = make_forward_inputs(dtype=torch.float64, **FORWARD_CASES[case])
    if not l2norm:  # keep the state bounded without the norm, as real models do
        inputs["q"], inputs["k"] = inputs["q"] * 0.25, inputs["k"] * 0.25
    return inputs


def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {n: (t.to(dtype) if n in ("q", "k", "v") else t.float() if n in ("g", "beta", "initial_state") else t)
            for n, t in inputs.items()}


def _force_stages(monkeypatch, stages: int) -> None:
    from torch_gdr.ops.cpu import kernels

    monkeypatch.setattr(kernels, "STAGES", stages)


# (l2norm, stages): each switch both ways, in two runs per case rather than four.
FORWARD_VARIANTS = {"raw,segmented": (False, 2), "l2norm,fused": (True, 1)}


@pytest.mark.parametrize("variant", list(FORWARD_VARIANTS))
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_matches_recurrence_and_torch_path(case: str, variant: str, monkeypatch) -> None:
    l2norm, stages = FORWARD_VARIANTS[variant]
    _force_stages(monkeypatch, stages)
    ref = _forward_inputs(case, l2norm)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**ref, use_qk_l2norm_in_kernel=l2norm)
    x = _cast(ref, torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x.get("initial_state"), l2norm, x.get("cu_seqlens"))
    o, s, states = cpu.chunk_fwd(*args, 32, False)
    assert states is None and o.dtype == torch.float32 and s.dtype == torch.float32
    assert o.shape == x["v"].shape and s.shape == expected_s.shape
    assert rmse_ratio(expected_o, o) < FP32_BOUND and rmse_ratio(expected_s, s) < FP32_BOUND
    torch_o, torch_s, _ = chunk_gated_delta_rule_fwd(canonical_call(*args, 32))
    torch.testing.assert_close(o, torch_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s, torch_s, atol=2e-5, rtol=2e-5)
    o_step, s_step = cpu.recurrent_fwd(*args)
    assert rmse_ratio(expected_o, o_step) < FP32_BOUND and rmse_ratio(expected_s, s_step) < FP32_BOUND


@pytest.mark.parametrize("chunk_size, kernel_chunk", [(16, 16), (32, 32), (64, 32), (128, 32)])
def test_forward_without_states_runs_at_most_chunk_32(chunk_size: int, kernel_chunk: int) -> None:
    """A forward that keeps no chunk states runs at ``min(chunk_size, 32)`` (fewer
    intra-chunk FLOPs); its result is that of the forward at the caller's chunk, which
    keeps them, and of the float64 recurrence."""
    assert cpu.forward_chunk_size(chunk_size, False) == kernel_chunk
    assert cpu.forward_chunk_size(chunk_size, True) == chunk_size
    ref = make_forward_inputs(seqlens=[130, 1, 169], num_qk_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=32,
                              with_initial_state=True)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**ref, use_qk_l2norm_in_kernel=True)
    x = _cast(ref, torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x.get("initial_state"), True, x.get("cu_seqlens"),
            chunk_size)
    o, s, _ = cpu.chunk_fwd(*args, False)
    o_kept, s_kept, states = cpu.chunk_fwd(*args, True)
    assert states.shape[0] == sum(-(-n // chunk_size) for n in (130, 1, 169))
    assert rmse_ratio(expected_o, o) < FP32_BOUND and rmse_ratio(expected_s, s) < FP32_BOUND
    torch.testing.assert_close(o, o_kept, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(s, s_kept, atol=2e-5, rtol=2e-5)


def _kernel_grads(case: Case, data: dict, save_states: bool) -> dict:
    """Gradients of the loss by chunk_fwd + chunk_bwd, in the key-first state layout."""
    t = dict(data["tensors"])
    h0, dht, do = t["initial_state"], data["dht"], data["do"]
    if case.state_v_first:  # the kernels are key-first: transpose around them
        h0 = None if h0 is None else h0.transpose(-1, -2)
        dht = None if dht is None else dht.transpose(-1, -2)
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], case.scale, h0, case.l2norm, cu, case.chunk)
    _, _, states = cpu.chunk_fwd(*args, True)
    grads = cpu.chunk_bwd(do.to(t["v"].dtype), None if dht is None else dht.float(), *args,
                          states if save_states else None)
    out = dict(zip(NAMES, grads))
    if h0 is None:
        out.pop("initial_state")
    elif case.state_v_first:
        out["initial_state"] = out["initial_state"].transpose(-1, -2)
    return out


# (save_states, stages): saved states with fused stages, recomputed ones with segments.
BACKWARD_VARIANTS = {"saved_states,fused": (True, 1), "recomputed,segmented": (False, 2)}


@pytest.mark.parametrize("variant", list(BACKWARD_VARIANTS))
@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_grads_match_recurrence(name: str, variant: str, monkeypatch) -> None:
    save_states, stages = BACKWARD_VARIANTS[variant]
    _force_stages(monkeypatch, stages)
    case = BACKWARD_CASES[name]
    data = make_inputs(case, torch.float32)
    ref = reference_grads(case, data)
    out = _kernel_grads(case, data, save_states)
    assert set(out) == set(ref)
    for n in ref:
        assert out[n].dtype == data["tensors"][n].dtype and out[n].shape == ref[n].shape, n
        assert torch.isfinite(out[n]).all(), n
        assert rmse_ratio(ref[n], out[n]) < 1e-5, f"{n}: rmse ratio {rmse_ratio(ref[n], out[n]):.3g}"


@pytest.mark.parametrize("name", ["T%C!=0", "varlen,gva,l2", "chunk64"])
def test_grads_match_torch_path(name: str) -> None:
    case = BACKWARD_CASES[name]
    data = make_inputs(case, torch.float32)
    t = data["tensors"]
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens)
    h0 = t["initial_state"]
    if case.state_v_first and h0 is not None:
        h0 = h0.transpose(-1, -2)
    dht = data["dht"].float() if data["dht"] is not None else None
    if case.state_v_first and dht is not None:
        dht = dht.transpose(-1, -2)
    args = (t["q"], t["k"], t["v"], t["g"], t["beta"], case.scale, h0, case.l2norm, cu, case.chunk)
    expected = chunk_gated_delta_rule_bwd(canonical_call(*args), data["do"].float(), dht)
    _, _, states = cpu.chunk_fwd(*args, True)
    got = cpu.chunk_bwd(data["do"].float(), dht, *args, states)
    for n, e, g in zip(NAMES, expected, got):
        if e is not None:
            torch.testing.assert_close(g, e, atol=5e-5, rtol=5e-5, msg=n)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_fp32(dtype: torch.dtype) -> None:
    case = Case(seq_len=45, l2norm=True, k_dim=16, v_dim=16)
    data = make_inputs(case, dtype)
    ref = reference_grads(case, data)  # the same rounded inputs, in float64
    out = _kernel_grads(case, data, True)
    bound = {torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    for n in ref:
        assert out[n].dtype == data["tensors"][n].dtype, n
        assert rmse_ratio(ref[n], out[n].float()) < bound, f"{n}: {rmse_ratio(ref[n], out[n].float()):.3g}"
    t = data["tensors"]
    o, s, _ = cpu.chunk_fwd(t["q"], t["k"], t["v"], t["g"], t["beta"], None, t["initial_state"], True, None, 16,
                            False)
    assert o.dtype == dtype and s.dtype == torch.float32


def _spiky_decay_inputs(spike: float, seq_len: int = 150) -> dict:
    """g = -0.01 with every 7th token at ``spike`` """
    x = make_forward_inputs(seq_len=seq_len, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                            with_initial_state=True)
    g = torch.full_like(x["g"], -0.01)
    g[:, 3::7] = spike
    x["g"] = g
    return x


@pytest.mark.parametrize("spike", [-1e3, -1e4, -1e5, -1e6, -math.inf])
def test_extreme_decays_match_the_recurrence(spike: float, stages: int) -> None:
    x = _spiky_decay_inputs(spike)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    f = _cast(x, torch.float32)
    args = (f["q"], f["k"], f["v"], f["g"], f["beta"], None, f["initial_state"], True, None)
    o, s, states = cpu.chunk_fwd(*args, 64, True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert (o.double() - expected_o).abs().max() < 1e-5
    assert (s.double() - expected_s).abs().max() < 1e-5
    # Gradients: finite, and as exact as autograd through the recurrence.
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    ro, rs = naive_recurrent_gated_delta_rule(**leaves, use_qk_l2norm_in_kernel=True)
    do, dht = torch.randn_like(ro), torch.randn_like(rs)
    ref = torch.autograd.grad((ro * do).sum() + (rs * dht).sum(), [leaves[n] for n in NAMES])
    got = cpu.chunk_bwd(do.float(), dht.float(), *args, 64, states)
    for n, r, gr in zip(NAMES, ref, got):
        assert torch.isfinite(gr).all(), n
        finite = torch.isfinite(r)  # d/dg at g = -inf is 0 * inf in autograd's recurrence
        assert rmse_ratio(r[finite], gr[finite]) < 1e-5, n


@pytest.mark.parametrize("where", ["k", "v", "g", "beta", "g_inf"])
def test_nan_does_not_spread_backwards(where: str, stages: int) -> None:
    x = make_forward_inputs(seq_len=200, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=16,
                            with_initial_state=True)
    bad_token = 50
    name = "g" if where == "g_inf" else where
    x[name] = x[name].clone()
    x[name][0, bad_token, 0] = math.inf if where == "g_inf" else math.nan
    expected_o, _ = naive_recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    f = _cast(x, torch.float32)
    args = (f["q"], f["k"], f["v"], f["g"], f["beta"], None, f["initial_state"], True, None)
    for o in (cpu.chunk_fwd(*args, 64, False)[0], cpu.recurrent_fwd(*args)[0]):
        assert torch.isfinite(o[:, :bad_token]).all()
        torch.testing.assert_close(o[:, :bad_token].double(), expected_o[:, :bad_token], atol=1e-5, rtol=1e-5)
        # Where the recurrence is not finite, neither is the kernel.
        assert not torch.isfinite(o[:, bad_token:][~torch.isfinite(expected_o[:, bad_token:])]).any()
        if where != "k":  # value head 1 shares head 0's q and k (GQA), none of its tokens is bad
            torch.testing.assert_close(o[:, :, 1].double(), expected_o[:, :, 1], atol=1e-5, rtol=1e-5)


def test_recurrent_step_in_place_and_out() -> None:
    x = _cast(make_forward_inputs(batch_size=3, seq_len=2, num_qk_heads=2, num_v_heads=4, with_initial_state=True),
              torch.float32)
    expected_o, expected_s = naive_recurrent_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None)
    h0 = x["initial_state"].clone()
    o, s = cpu.recurrent_fwd(*args, h0, True, None)
    assert torch.equal(h0, x["initial_state"])  # out of place: the input state is untouched
    state = x["initial_state"].clone()
    o_in, s_in = cpu.recurrent_fwd(*args, state, True, None, out_state=state)
    assert s_in.data_ptr() == state.data_ptr()
    for out_o, out_s in ((o, s), (o_in, s_in)):
        torch.testing.assert_close(out_o, expected_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_s, expected_s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_two_threads_give_the_same_bits(stages: int, gated: bool) -> None:
    """Two OpenMP threads give the bits of one, forward, backward and the recurrent step, over
    several runs: many work units per thread (sequences x heads, chunks), uneven lengths, so a
    buffer shared between the threads (a data race) shows as changed bits. ``gated``: with
    fla's activations in the kernels, whose ``dA_log``/``ddt_bias`` sum over every chunk."""
    x = _cast(make_forward_inputs(seqlens=[150, 3, 0, 90, 41, 64, 1, 17, 128, 5], num_qk_heads=2, num_v_heads=4,
                                  with_initial_state=True), torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], True, x["cu_seqlens"], 32)
    do = torch.randn_like(x["v"])
    threads = torch.get_num_threads()
    gating = Gating(True, torch.tensor([0.1, -0.4, 1.0, 0.3]), torch.tensor([0.5, 0.0, -1.0, 2.0]), True, True)
    extra = dict(gating=gating) if gated else {}

    def run():
        o, s, states = cpu.chunk_fwd(*args, True, **extra)
        grads = cpu.chunk_bwd(do, s, *args, states, **extra)
        step = cpu.recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.3, x["initial_state"], True,
                                 x["cu_seqlens"], **extra)
        assert len(grads) == (8 if gated else 6)
        return (o, s) + tuple(grads) + tuple(step)

    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        runs = [run() for _ in range(4)]
    finally:
        torch.set_num_threads(threads)
    for two in runs:
        for a, b in zip(one, two):
            assert torch.equal(a, b)


def test_concurrent_python_threads() -> None:
    """The kernels release the GIL; calls from several threads give the serial results."""
    inputs = [_cast(make_forward_inputs(seqlens=[20 + 13 * i, 7], with_initial_state=True, seed=i), torch.float32)
              for i in range(6)]

    def call(x):
        return cpu.chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                             x["cu_seqlens"], 16, False)[0]

    serial = [call(x) for x in inputs]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(5):
                results[i] = call(inputs[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, expected in enumerate(serial):
        assert torch.equal(results[i], expected)


def test_bad_chunk_states_are_refused() -> None:
    x = _cast(make_forward_inputs(seq_len=40, with_initial_state=True), torch.float32)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], False, None, 16)
    _, _, states = cpu.chunk_fwd(*args, True)
    with pytest.raises(ValueError, match="chunk_states"):
        cpu.chunk_bwd(torch.ones_like(x["v"]), None, *args, states[:-1])


def test_build_key_follows_torch_version_and_sources(monkeypatch) -> None:
    from torch_gdr.ops.cpu import _build

    key = _build.build_key()
    assert _build.build_dir().name == key and str(_build.build_dir()).startswith(str(_build.cache_dir()))
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert _build.build_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(_build, "compile_flags", lambda: ["-O2"])
    assert _build.build_key() != key


@pytest.mark.parametrize("threads", [1, 2])
def test_subnormals_survive_outside_the_kernels(threads: int) -> None:
    """The kernels treat subnormals as zero inside their parallel regions only: torch's own
    work, on the calling thread and on the pool's threads, keeps them afterwards."""
    x = make_forward_inputs(seq_len=300, num_qk_heads=1, num_v_heads=2, head_k_dim=32, head_v_dim=32,
                            dtype=torch.float32)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu.chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, True, None, 128, True)
        tiny = torch.full((1 << 16,), 1e-39)  # a float32 subnormal
        assert bool(((tiny * 1.0) == tiny).all()) and bool((tiny + 0.0 > 0).all())
    finally:
        torch.set_num_threads(previous)
