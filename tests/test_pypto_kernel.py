"""The PyPTO GDR kernel, run through PyPTO's CPU interpreter, against the float64 recurrence.

Tolerance, elementwise on o, the final state and the per-chunk states:
``|kernel - ref| <= 1e-3 |ref| + 1e-4``. The kernel picks its own chunk length
(:func:`kernel_chunk_size`); the caller's ``chunk_size`` only matters to the torch path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr import testing

from torch_gdr.ops.pypto import is_pypto_available

if not is_pypto_available():
    pytest.skip("pypto==0.2.0 is not importable (pip install 'torch_gdr[npu]')", allow_module_level=True)

from torch_gdr.ops.pypto import kernel_cache  # noqa: E402
from torch_gdr.ops.pypto import interpreter  # noqa: E402
from torch_gdr.ops.pypto import kernel as pypto_kernel  # noqa: E402
from torch_gdr.ops.pypto.forward import chunk_offsets, pypto_chunk_gated_delta_rule_fwd  # noqa: E402
from torch_gdr.ops.pypto.kernel import kernel_chunk_size  # noqa: E402
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def make_inputs(
    lens: list[int], *, num_qk_heads: int = 1, num_v_heads: int = 1, head_k_dim: int = 64,
    head_v_dim: int = 64, with_initial_state: bool = False, prenormalised_qk: bool = False, seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    """Packed TND float32 inputs with realistic gates (:func:`torch_gdr.testing.make_inputs`),
    int32 ``cu_seqlens`` as engines pass them."""
    x = testing.make_inputs(seqlens=lens, token_major=True, num_qk_heads=num_qk_heads, num_v_heads=num_v_heads,
                            head_k_dim=head_k_dim, head_v_dim=head_v_dim, with_initial_state=with_initial_state,
                            initial_state_scale=0.5, normalize_qk=prenormalised_qk, seed=seed, dtype=torch.float32)
    initial_state = x["initial_state"].float() if with_initial_state else None
    return dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x["cu_seqlens"].int(),
                initial_state=initial_state)


def reference_tnd(inputs: dict, *, scale: float, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token recurrence in float64 on TND inputs: o ``[T, HV, V]``, state ``[N, HV, K, V]``."""
    q, k, v, g, beta = (inputs[n].double().unsqueeze(0) for n in ("q", "k", "v", "g", "beta"))
    initial_state = inputs["initial_state"]
    o, state = naive_recurrent_gated_delta_rule(
        q, k, v, g, beta, scale=scale,
        initial_state=None if initial_state is None else initial_state.double(),
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=inputs["cu_seqlens"].long(),
    )
    return o[0], state


def with_raw_activations(inputs: dict, seed: int = 0) -> tuple[dict, dict, dict]:
    """fla's activations, all on: ``(inputs with the raw gate and beta logits, the call's
    activation arguments, the inputs the reference reads)``: the reference's g and beta are
    ``-exp(A_log) softplus(a + dt_bias)`` and ``2 sigmoid(b)``, written out in float64; one
    raw gate past float32's exp range (softplus's threshold)."""
    gen = torch.Generator().manual_seed(seed + 7)
    num_v_heads = inputs["v"].shape[-2]
    a = 2.0 * torch.randn(inputs["g"].shape, generator=gen)
    a[0] = 100.0
    b = 2.0 * torch.randn(inputs["beta"].shape, generator=gen)
    A_log = torch.empty(num_v_heads).uniform_(0.05, 2.0, generator=gen).log()
    dt_bias = torch.randn(num_v_heads, generator=gen)
    activated = dict(inputs, g=-A_log.double().exp() * F.softplus(a.double() + dt_bias.double()),
                     beta=2.0 * torch.sigmoid(b.double()))
    gating = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=True)
    return dict(inputs, g=a, beta=b), gating, activated


def assert_within_tolerance(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    bound = 1e-3 * want.abs() + 1e-4
    bad = int((err > bound).sum())
    assert bad == 0, f"{name}: {bad}/{want.numel()} elements out of tolerance, max abs err {err.max():.3g}"


#: fla's bound on the rmse ratio of o and the states for half inputs: the kernel's Gram
#: products (Q K^T, diag(beta) K K^T) round their operands to the input dtype.
HALF_RMSE_RATIO = 0.005


def assert_half_within_tolerance(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    ratio = testing.rmse_ratio(want, got)
    assert ratio < HALF_RMSE_RATIO, f"{name}: rmse ratio {ratio:.3g}, expected below {HALF_RMSE_RATIO}"


def assert_close_to_reference(inputs: dict, *, chunk_size: int, use_qk_l2norm: bool, scale: float | None = None,
                              public_call: bool = True, gating: dict | None = None,
                              reference_inputs: dict | None = None):
    """Kernel vs the float64 recurrence. By default through the public call
    (``torch_gdr.chunk_gated_delta_rule(..., backend="pypto")`` on token-major CPU tensors);
    ``public_call=False`` calls the host forward directly (float32 output whatever the input).
    ``gating``: fla's activation arguments of the call (:func:`with_raw_activations`), with
    ``reference_inputs`` the inputs the reference reads instead of ``inputs``."""
    head_k_dim = inputs["q"].shape[-1]
    scale = head_k_dim ** -0.5 if scale is None else scale
    if public_call:
        o, final_state = torch_gdr.chunk_gated_delta_rule(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta")), scale, inputs["initial_state"], True,
            use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=inputs["cu_seqlens"], chunk_size=chunk_size,
            backend="pypto", **(gating or {}))
    else:
        o, final_state, _ = pypto_chunk_gated_delta_rule_fwd(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")),
            scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm, chunk_size=chunk_size,
        )
    ref_o, ref_state = reference_tnd(reference_inputs or inputs, scale=scale, use_qk_l2norm=use_qk_l2norm)
    assert o.dtype == (inputs["v"].dtype if public_call else torch.float32)  # the public call's o: v's dtype
    assert final_state.dtype == torch.float32
    assert ref_o.dtype == torch.float64 and ref_state.dtype == torch.float64
    half = inputs["q"].dtype in (torch.bfloat16, torch.float16)
    for name, got, want in (("o", o, ref_o), ("final_state", final_state, ref_state)):
        (assert_half_within_tolerance if half else assert_within_tolerance)(name, got, want)


@pytest.mark.parametrize(
    "lens, chunk_size",
    [([128], 64), ([130], 64), ([20], 64)],
    ids=["aligned_T128_kernel_l64", "unaligned_T130_kernel_l64", "T20_kernel_l32"],
)
def test_single_sequence(lens: list[int], chunk_size: int) -> None:
    assert_close_to_reference(make_inputs(lens), chunk_size=chunk_size, use_qk_l2norm=True)


def test_packed_uneven_sequences_gva_initial_state() -> None:
    """Lengths 100, 17 (< l), 0 and 70; H=2, HV=4; nonzero initial state."""
    inputs = make_inputs([100, 17, 0, 70], num_qk_heads=2, num_v_heads=4, with_initial_state=True)
    assert_close_to_reference(inputs, chunk_size=64, use_qk_l2norm=True)


def test_l2norm_off_head_dim_128_chunk_32() -> None:
    inputs = make_inputs([70, 33], head_k_dim=128, head_v_dim=128, with_initial_state=True, prenormalised_qk=True)
    assert_close_to_reference(inputs, chunk_size=32, use_qk_l2norm=False, scale=0.7)


def test_kernel_chunk_128_with_middle_chunks() -> None:
    """Lengths 300 and 150 on four value heads run at kernel chunk 128: the first sequence
    takes all four paths' kinds of chunk (its first, a middle one, a short last one)."""
    assert kernel_chunk_size(64, 64, 300, num_seqs=2, num_v_heads=4) == 128
    inputs = make_inputs([300, 150], num_qk_heads=2, num_v_heads=4, with_initial_state=True)
    assert_close_to_reference(inputs, chunk_size=64, use_qk_l2norm=True)


def test_chunk_128_head_dim_128_gva() -> None:
    inputs = make_inputs([150, 40], num_qk_heads=1, num_v_heads=2, head_k_dim=128, head_v_dim=128)
    assert_close_to_reference(inputs, chunk_size=128, use_qk_l2norm=True)


@pytest.mark.slow
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "activations_in_kernel"])
@pytest.mark.parametrize("body_heads", [4, 2])
def test_several_value_heads_per_loop_body(body_heads: int, gated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop body that runs several value heads side by side (what saturating launches get,
    see :func:`heads_per_body`), forced here on a small launch: GVA with two q/k heads per
    body at 4, uneven sequences with a tail chunk and an initial state; ``gated``: fla's
    activations in the kernel (raw gate, A_log, dt_bias, beta logits, allow_neg_eigval)."""
    monkeypatch.setattr(pypto_kernel, "MIN_MERGED_BODIES", 1)
    monkeypatch.setattr(pypto_kernel, "HEADS_PER_BODY_CHOICES", (body_heads,))
    assert pypto_kernel.heads_per_body(2, 8) == body_heads
    kernel_cache.cache_clear()
    try:
        inputs = make_inputs([150, 40], num_qk_heads=2, num_v_heads=8, with_initial_state=True, seed=3)
        if not gated:
            assert_close_to_reference(inputs, chunk_size=128, use_qk_l2norm=True)
        else:
            raw, gating, activated = with_raw_activations(inputs, seed=3)
            assert_close_to_reference(raw, chunk_size=128, use_qk_l2norm=True, gating=gating,
                                      reference_inputs=activated)
            assert [key.gate_in_kernel for key in kernel_cache.cache_info().keys] == [True]
    finally:
        kernel_cache.cache_clear()


@pytest.mark.slow
def test_head_dims_256_in_bodies_of_several_value_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """K = V = 256 in bodies of four value heads with fla's activations in the kernel: the
    merged vector work in 64-row tiles, the ``[I | 0]`` block written in row slices and the
    products staged in 128-deep L1 tiles (what fits a 910B core at this size); a middle and
    a tail chunk at kernel chunk 128, GVA, an initial state."""
    monkeypatch.setattr(pypto_kernel, "MIN_MERGED_BODIES", 1)
    monkeypatch.setattr(pypto_kernel, "HEADS_PER_BODY_CHOICES", (4,))
    kernel_cache.cache_clear()
    try:
        inputs = make_inputs([150, 40], num_qk_heads=2, num_v_heads=8, head_k_dim=256, head_v_dim=256,
                             with_initial_state=True, seed=4)
        raw, gating, activated = with_raw_activations(inputs, seed=4)
        assert_close_to_reference(raw, chunk_size=128, use_qk_l2norm=True, gating=gating, reference_inputs=activated)
        assert [key.head_k_dim for key in kernel_cache.cache_info().keys] == [256]
    finally:
        kernel_cache.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("dtype, gated", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16_activations_in_kernel"])
def test_half_inputs_in_bodies_of_several_value_heads(dtype: torch.dtype, gated: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Half q, k, v in bodies of four value heads (the saturating launches' path, which reads
    a chunk's q, k and v in one task and rounds the Gram product's operands): a first, a
    middle and a tail chunk (300 tokens at kernel chunk 128), a one-chunk sequence, GVA, an
    initial state. Against the recurrence on the same rounded inputs, through the host
    forward (float32 output); ``gated``: fla's activations in the kernel, through the public
    call (o in bf16)."""
    monkeypatch.setattr(pypto_kernel, "MIN_MERGED_BODIES", 1)
    monkeypatch.setattr(pypto_kernel, "HEADS_PER_BODY_CHOICES", (4,))
    kernel_cache.cache_clear()
    try:
        inputs = make_inputs([300, 40], num_qk_heads=2, num_v_heads=8, with_initial_state=True, seed=5)
        inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
        if not gated:
            assert_close_to_reference(inputs, chunk_size=128, use_qk_l2norm=True, public_call=False)
        else:
            raw, gating, activated = with_raw_activations(inputs, seed=5)
            assert_close_to_reference(raw, chunk_size=128, use_qk_l2norm=True, gating=gating,
                                      reference_inputs=activated)
            assert [(key.gate_in_kernel, key.input_dtype) for key in kernel_cache.cache_info().keys] == [
                (True, "bfloat16")]
    finally:
        kernel_cache.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_inputs_read_by_the_kernel(dtype: torch.dtype) -> None:
    """K=64, V=128; q, k, v in half precision go to the kernel as they are. The reference
    runs the recurrence on the same rounded values (widened exactly to float64)."""
    inputs = make_inputs([90], head_k_dim=64, head_v_dim=128, with_initial_state=True)
    inputs = {n: (t.to(dtype) if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    # The host forward: the public call would round o to the input dtype, beyond this tolerance.
    assert_close_to_reference(inputs, chunk_size=64, use_qk_l2norm=True, public_call=False)


@pytest.mark.slow
@pytest.mark.parametrize("head_k_dim, head_v_dim", [(64, 128), (128, 64), (256, 256), (256, 64), (128, 256)],
                         ids=["K64_V128", "K128_V64", "K256_V256", "K256_V64", "K128_V256"])
def test_unequal_head_dims_float32(head_k_dim: int, head_v_dim: int) -> None:
    """K != V in float32 through the public call: packed uneven sequences (one shorter than a
    chunk), two value heads per key head, an initial state; o and the final state. (The
    backward at both shapes: ``tests/test_pypto_backward.py``.)"""
    inputs = make_inputs([90, 33], num_qk_heads=1, num_v_heads=2, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                         with_initial_state=True)
    assert_close_to_reference(inputs, chunk_size=64, use_qk_l2norm=True)


def reference_chunk_states(inputs: dict, chunk_size: int, *, scale: float, use_qk_l2norm: bool) -> torch.Tensor:
    """The float64 state entering each chunk, ``[C, HV, K, V]``: the recurrence's final state
    over each sequence's prefix that ends at the chunk's first token."""
    cu_seqlens = inputs["cu_seqlens"].long()
    num_v_heads, head_k_dim, head_v_dim = inputs["v"].shape[1], inputs["k"].shape[2], inputs["v"].shape[2]
    states = []
    for n in range(cu_seqlens.numel() - 1):
        start, end = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        initial = inputs["initial_state"]
        initial = (torch.zeros(1, num_v_heads, head_k_dim, head_v_dim) if initial is None else initial[n:n + 1])
        for boundary in range(start, end, chunk_size):
            prefix = {name: inputs[name][start:boundary] for name in ("q", "k", "v", "g", "beta")}
            prefix.update(initial_state=initial, cu_seqlens=torch.tensor([0, boundary - start]))
            states.append(reference_tnd(prefix, scale=scale, use_qk_l2norm=use_qk_l2norm)[1][0])
    return torch.stack(states)


@pytest.mark.parametrize("window_chunks", [None, pytest.param(1, marks=pytest.mark.slow)],
                         ids=["one_launch", "a_launch_per_chunk"])
@pytest.mark.parametrize("with_initial_state", [True, False], ids=["initial_state", "zero_state"])
def test_chunk_states_match_the_recurrence_at_chunk_boundaries(with_initial_state: bool, window_chunks: int | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths 150 (two chunks of 128, one short), 0 (no rows) and 128 (exactly one chunk); GVA;
    bf16 inputs. Row ``chunk_offsets[n] + c`` holds the state entering chunk c of sequence n.
    With ``window_chunks=1`` the call runs as two launches, the host carrying the states."""
    if window_chunks is not None:
        monkeypatch.setattr(pypto_kernel, "WINDOW_CHUNKS", window_chunks)
    inputs = make_inputs([150, 0, 128], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64,
                         with_initial_state=with_initial_state)
    inputs = {n: (t.bfloat16() if n in ("q", "k", "v") else t) for n, t in inputs.items()}
    scale = 0.125
    o, final_state, chunk_states = pypto_chunk_gated_delta_rule_fwd(
        *(inputs[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")),
        scale=scale, use_qk_l2norm_in_kernel=True, chunk_size=64, output_chunk_states=True,
    )
    chunk_size = kernel_chunk_size(64, 64, 150, num_seqs=3, num_v_heads=2)
    assert chunk_size == 128
    assert chunk_offsets(inputs["cu_seqlens"], chunk_size).tolist() == [0, 2, 2, 3]
    assert chunk_states.shape == (3, 2, 64, 64) and chunk_states.dtype == torch.float32
    assert_half_within_tolerance("chunk_states", chunk_states,
                                 reference_chunk_states(inputs, chunk_size, scale=scale, use_qk_l2norm=True))
    ref_o, ref_state = reference_tnd(inputs, scale=scale, use_qk_l2norm=True)
    assert_half_within_tolerance("o", o, ref_o)
    assert_half_within_tolerance("final_state", final_state, ref_state)


@pytest.mark.parametrize(
    ("lens", "chunk_size", "expected"),
    [([], 128, [0]), ([0], 64, [0, 0]), ([1, 128, 129, 0, 256], 128, [0, 1, 2, 4, 4, 6]),
     ([65, 64], 64, [0, 2, 3])],
)
def test_chunk_offsets_count_ceil_len_over_chunk(lens: list[int], chunk_size: int, expected: list[int]) -> None:
    cu_seqlens = torch.tensor([0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()])
    assert chunk_offsets(cu_seqlens, chunk_size).tolist() == expected


@pytest.mark.parametrize(
    ("max_seqlen", "num_seqs", "num_v_heads", "expected"),
    [(0, 1, 4, 32), (17, 2, 4, 32), (32, 1, 4, 32), (33, 16, 4, 64), (64, 16, 32, 64),  # one chunk holds all
     (256, 1, 4, 64), (65, 2, 2, 64),  # small launches (at most 16 bodies of 64): 64
     (256, 16, 4, 128), (257, 1, 4, 128), (5000, 1, 1, 128)],
)
def test_kernel_chunk_size(max_seqlen: int, num_seqs: int, num_v_heads: int, expected: int) -> None:
    for head_k_dim, head_v_dim in ((128, 128), (64, 128)):
        got = kernel_chunk_size(head_k_dim, head_v_dim, max_seqlen, num_seqs=num_seqs, num_v_heads=num_v_heads)
        assert got == expected


@pytest.mark.parametrize(
    "lens, chunk_size, window_chunks, expected",
    [
        ([4096], 128, 16, [[0, 16], [16, 16]]),
        ([300, 0, 100], 64, 2, [[0, 2, 0, 2], [2, 2, 0, 0], [4, 1, 0, 0]]),
        ([0, 0], 64, 16, [[0, 0, 0]]),
        ([64], 64, 16, [[0, 1]]),
    ],
    ids=["two_windows", "varlen_tail_window", "all_empty", "one_chunk"],
)
def test_time_windows(lens: list[int], chunk_size: int, window_chunks: int, expected: list[list[int]]) -> None:
    """Launch j runs chunks [j W, (j + 1) W) of each sequence: ``[c0, count_0, ...]``."""
    cu_seqlens = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    windows = pypto_kernel.time_windows(cu_seqlens, chunk_size, window_chunks)
    assert [w.tolist() for w in windows] == expected
    assert all(w.dtype == torch.int32 for w in windows)


def test_kernel_chunk_size_rejects_unsupported_head_dims() -> None:
    with pytest.raises(ValueError, match="head dims"):
        kernel_chunk_size(96, 128, 100, num_seqs=1, num_v_heads=1)


@pytest.mark.parametrize("gate", [0.0, -30.0], ids=["no_decay", "strong_decay"])
def test_extreme_gates_stay_finite(gate: float) -> None:
    """g = 0 (no decay) must not give NaN; g = -30 underflows exp(gamma) and must stay finite."""
    inputs = make_inputs([70], with_initial_state=True)
    inputs["g"] = torch.full_like(inputs["g"], gate)
    assert_close_to_reference(inputs, chunk_size=32, use_qk_l2norm=True)


def test_all_sequences_empty_returns_initial_state() -> None:
    inputs = make_inputs([0, 0], with_initial_state=True)
    o, final_state, chunk_states = pypto_chunk_gated_delta_rule_fwd(
        *(inputs[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")),
        scale=0.125, use_qk_l2norm_in_kernel=True, chunk_size=64, output_chunk_states=True,
    )
    assert o.shape == (0, 1, 64) and torch.equal(final_state, inputs["initial_state"])
    assert chunk_states.shape == (0, 1, 64, 64)


def test_cu_seqlens_must_end_at_t() -> None:
    inputs = make_inputs([40])
    with pytest.raises(ValueError, match="cu_seqlens"):
        pypto_chunk_gated_delta_rule_fwd(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta")), torch.tensor([0, 30]), None,
            scale=0.125, use_qk_l2norm_in_kernel=True, chunk_size=64,
        )


def test_kernel_built_once_per_key() -> None:
    kernel_cache.cache_clear()
    builds: list[dict] = []

    def counting_builder(**config):
        builds.append(config)
        from torch_gdr.ops.pypto.kernel import build_gdr_kernel

        return build_gdr_kernel(**config)

    def getter(**config):
        return kernel_cache.get_gdr_kernel(builder=counting_builder, **config)

    def run(lens: list[int]) -> None:
        inputs = make_inputs(lens)
        pypto_chunk_gated_delta_rule_fwd(
            *(inputs[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")),
            scale=0.125, use_qk_l2norm_in_kernel=True, chunk_size=32, kernel_getter=getter,
        )

    run([40])
    run([50])  # same key (T is dynamic; both run at kernel chunk 64): reused
    run([20, 20])  # another N (and kernel chunk 32): a new key
    info = kernel_cache.cache_info()
    assert len(builds) == 2 and info.misses == 2 and info.hits == 1
    assert sorted(key.num_seqs for key in info.keys) == [1, 2]
    kernel_cache.cache_clear()
    assert kernel_cache.cache_info() == kernel_cache.CacheInfo(0, 0, ())


@pytest.mark.slow  # 10-13 s: a fresh process's interpreter run; the default suite keeps
# tests/test_env.py::test_pypto_call_honours_the_users_directories_and_litters_nothing
def test_nothing_lands_in_cwd_or_home(tmp_path: Path) -> None:
    """A fresh process with HOME and cwd in empty temp dirs writes only ~/.cache/torch_gdr."""
    interpreter.load_calculator()  # the calculator build is shared, not redone
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    calc = interpreter._calculator_dir()
    seeded = home / ".cache" / "torch_gdr" / "calculator" / calc.name
    seeded.parent.mkdir(parents=True)
    seeded.symlink_to(calc, target_is_directory=True)
    cwd.mkdir()
    script = textwrap.dedent(
        """
        import torch
        from torch_gdr.ops.pypto.forward import pypto_chunk_gated_delta_rule_fwd
        t, d = 40, 64
        q, k, v = torch.randn(t, 1, d), torch.randn(t, 1, d), torch.randn(t, 1, d)
        g, beta = torch.full((t, 1), -0.1), torch.full((t, 1), 0.5)
        o, s, _ = pypto_chunk_gated_delta_rule_fwd(q, k, v, g, beta, torch.tensor([0, t]), None,
            scale=0.125, use_qk_l2norm_in_kernel=True, chunk_size=32)
        assert o.abs().sum() > 0
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_GDR_", "TILE_FWK", "PYPTO_", "ASCEND_"))}
    env.update(HOME=str(home), PYTHONPATH=str(REPO_ROOT))
    subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, check=True, timeout=300)
    assert list(cwd.iterdir()) == []
    assert sorted(p.name for p in home.iterdir()) == [".cache"]
    assert sorted(p.name for p in (home / ".cache").iterdir()) == ["torch_gdr"]
    leftovers = list((home / ".cache" / "torch_gdr" / "tmp").iterdir())
    assert leftovers == [], f"temporary dirs not removed: {leftovers}"


def _bench_script(name: str):
    """``bench/<name>.py`` as a module (bench/ on the path while it loads: one script imports
    another)."""
    import importlib.util

    bench = str(REPO_ROOT / "bench")
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    sys.path.insert(0, bench)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(bench)
    return module


def _cost_model_script():
    return _bench_script("pypto_cost_model")


@pytest.mark.parametrize("batch, tokens, pool_dtype", [(1, 1, "float32"), (3, 4, "bfloat16"), (2, 16, "float16")])
def test_decode_pool_row_bytes_count_one_read_and_s_written_rows(batch: int, tokens: int, pool_dtype: str) -> None:
    """result.json's pool_row_bytes of ``--decode``: the bytes of the rows a step reads (one
    per sequence and value head) and writes (S), counted from the pool rows of the launch."""
    script = _cost_model_script()
    w = script.DecodeWorkload(batch=batch, tokens=tokens, heads=2, v_heads=4, head_k_dim=64, head_v_dim=32,
                              pool_dtype=pool_dtype)
    slots, rows = script._pool_rows(w)
    pool = torch.zeros(slots, w.v_heads, w.head_k_dim, w.head_v_dim, dtype=getattr(torch, pool_dtype))
    read, written = pool[rows[:, 0]], pool[rows.flatten()]
    assert script.pool_row_bytes(w) == (read.numel() + written.numel()) * pool.element_size()


def test_decode_pool_row_bytes_of_the_issue_example() -> None:
    """H16/HV32, K = V = 128, fp32, B = 64, S = 4: the kernels move 671 MB (issue 37), not 1,074."""
    script = _cost_model_script()
    w = script.DecodeWorkload(batch=64, tokens=4)
    assert round(script.pool_row_bytes(w) / 1e6) == 671


def test_cost_model_report_parsing() -> None:
    """The figures bench/pypto_cost_model.py reads from pypto's stat report (its 0.2.0 layout)."""
    report = textwrap.dedent(
        """
        Total Cycles.....................................:    323707
        Total Submit Tasks...............................:       361
        Average Cube Usage...............................:   8424.00    2.60%
        Average Vector Usage.............................:   3430.25    1.06%
        Average MTE_IN Usage.............................: 274064.22   21.43%
        """
    )
    figures = _cost_model_script().parse_report(report)
    assert figures == dict(total_cycles=323707, tasks=361, cube_pipe_pct=2.6, vector_pipe_pct=1.06, mte_in_pct=21.43)


def test_pipe_log_figures_come_from_the_busiest_vector_core() -> None:
    """bench/pypto_pipe_log.py: the AIV core with the most tasks is read (a cube core and a
    vector core with fewer tasks are not), both task spellings of the SIM count, and each pipe's
    busy cycles and opcode counts are divided by tasks x units a task."""
    script = _bench_script("pypto_pipe_log")

    def op(start: int, end: int, text: str) -> dict:
        return {"execStart": start, "execEnd": end, "tileOp": text}

    busy = {"VECTOR_ALU": [op(0, 240, "1 MUL a TASK[0] (a)"), op(240, 400, "2 ROWSUMLINE b TASK[0] (a)"),
                           op(900, 1140, "1 MUL a Task[7]-r")],
            "MTE_IN": [op(0, 1400, "3 COPY_IN c TASK[0] (a)"), op(1400, 2800, "3 COPY_IN c Task[7]-r")]}
    cores = [{"blockIdx": 0, "coreType": "AIC", "pipeLogs": {"CUBE": [op(0, 9, "4 A_MUL_B d TASK[1]"),
                                                                       op(9, 18, "4 A_MUL_B d TASK[2]"),
                                                                       op(18, 27, "4 A_MUL_B d TASK[3]")]}},
             {"blockIdx": 24, "coreType": "AIV", "pipeLogs": {"VECTOR_ALU": [op(0, 5000, "1 MUL a TASK[9]")]}},
             {"blockIdx": 25, "coreType": "AIV", "pipeLogs": busy},
             {"blockIdx": 26, "coreType": "AIV"}]
    core, tasks, logs = script.busiest_vector_core(cores)
    assert (core, tasks) == ("25", 2)
    figures = script.pipe_figures(logs, tasks, units_per_task=4)
    assert figures["VECTOR_ALU"].cycles == 640 and figures["VECTOR_ALU"].per_unit == 80.0
    assert figures["VECTOR_ALU"].ops == {"MUL": (0.25, 240.0), "ROWSUMLINE": (0.125, 160.0)}
    assert figures["MTE_IN"].per_unit == 350.0


def test_pipe_log_is_the_decode_kernels_never_the_copys(tmp_path: Path) -> None:
    """bench/pypto_pipe_log.py finds the decode launch's pipe log under a --out folder, and
    where the SIM wrote none for it (large launches) fails rather than read the copy kernel's."""
    script = _bench_script("pypto_pipe_log")
    sim = "output_1/CostModelSimulationOutput/_simulate.pipe.swim.json"
    copy_log = tmp_path / "copy_task_64" / sim
    copy_log.parent.mkdir(parents=True)
    copy_log.write_text("[]")
    (tmp_path / "decode" / "output_1" / "CostModelSimulationOutput").mkdir(parents=True)
    with pytest.raises(FileNotFoundError):
        script.find_pipe_log(tmp_path)
    (tmp_path / "decode" / sim).write_text("[]")
    assert script.find_pipe_log(tmp_path) == tmp_path / "decode" / sim


def test_cost_model_counts_matmul_macs_from_the_leaf_graphs() -> None:
    """MACs of a leaf function: m k n of each matmul tile op from its L0A, L0B and L0C tiles (the
    0.2.0 dot layout), accumulating ops included, copies not; and the algorithm's count per chunk
    and value head at l = K = V = 128 is the issue's 8.17 x 128^3 (with the l^3 / 6 inverse)."""
    dot = textwrap.dedent(
        """
        digraph {
        label="TENSOR_LOOP_leaf0_1\\nhash:42";
        T1 [label="Tile\\n1 L0A_[0,0][64,128]-1-1 32768B", shape=box];
        T2 [label="Tile\\n2 L0B_[0,0][128,32]-2-2 16384B", shape=box];
        T3 [label="Tile\\n3 L0C_[0,0][64,32]-3-3 8192B", shape=box];
        T4 [label="Tile\\n4 L0A_[0,0][64,16]-4-4 4096B", shape=box];
        T5 [label="Tile\\n5 L0B_[0,0][16,32]-5-5 2048B", shape=box];
        T6 [label="Tile\\n6 DDR_[0,0][64,32]-6-6 8192B", shape=box];
        N1 [label="TileOp\\nopmagic:1\\nopcode:A_MUL_B\\nSeq:1",shape=box];
        N2 [label="TileOp\\nopmagic:2\\nopcode:A_MULACC_B\\nSeq:2",shape=box];
        N3 [label="TileOp\\nopmagic:3\\nopcode:COPY_OUT\\nSeq:3",shape=box];
        T1 -> N1;
        T2 -> N1;
        N1 -> T3;
        T4 -> N2;
        T3 -> N2;
        T5 -> N2;
        N2 -> T3;
        T3 -> N3;
        N3 -> T6;
        }
        """
    )
    script = _cost_model_script()
    assert script.leaf_function_macs(dot) == (42, 64 * 128 * 32 + 64 * 16 * 32)
    assert script.algorithm_macs_per_chunk_head(128, 128, 128) == round((8 + 1 / 6) * 128 ** 3)


def test_cost_model_backward_launch_is_the_backward_kernel() -> None:
    """``--backward`` builds the backward kernel with the forward's kernel chunk size."""
    script = _cost_model_script()
    workload = script.Workload(lens=(40, 9), heads=1, v_heads=2, head_k_dim=64, head_v_dim=64)
    kernel, launches = script.BACKWARD_LAUNCH(workload)
    assert kernel is not None and len(launches) == 1
    args = launches[0]
    assert all(isinstance(a, torch.Tensor) for a in args)
    assert any(a.shape == (3,) for a in args)  # act_seq_len of two sequences


@pytest.mark.slow
@pytest.mark.parametrize("method", ["power", "split64", "vector16", "batched16"])
def test_inverse_methods_timed_in_the_bench_solve_the_same_system(method: str) -> None:
    """bench/pypto_inverse_cost.py compares the cost of ways of forming ``(I + A)^-1 B``; each
    must compute it (a wrong method could look cheap): through the interpreter, against a float64
    triangular solve, on inputs whose solution reaches several units."""
    assert _bench_script("pypto_inverse_cost").check(method, bodies=2) < 1e-4


#: The forward's cycle budgets in pypto's cost model (stock SIM, 910B), b=1, H=2, HV=4,
#: K=V=128, l2norm and initial state on: the forward's acceptance budgets. The model is
#: deterministic; a change that breaks a budget fails here rather than in the next table.
FORWARD_CYCLE_BUDGETS = [((256,), 276_000), ((1024,), 450_000), ((256,) * 16, 1_200_000), ((4096,), 1_500_000)]


@pytest.mark.slow
def test_cost_model_cycles_within_budget_and_flat() -> None:
    """Each budget holds, and T=1024 and T=4096 cost the same per token within 20% (T=16384
    runs the same windows as T=4096). pypto's SIM output goes to a folder removed after."""
    script = _cost_model_script()
    per_token = {}
    for lens, budget in FORWARD_CYCLE_BUDGETS:
        with script.output_root(None) as out:
            result = script.run_cost_model(script.Workload(lens=lens), out)
        assert result["total_cycles"] <= budget, f"{len(lens)} x {lens[0]}: {result['total_cycles']:,} > {budget:,}"
        per_token[lens] = result["cycles_per_token"]
    ratio = per_token[(1024,)] / per_token[(4096,)]
    assert 1 / 1.2 <= ratio <= 1.2, f"cycles per token, T=1024 / T=4096: {ratio:.3f}"


@pytest.mark.slow
@pytest.mark.parametrize("gating", [False, True], ids=["plain", "activations_in_kernel"])
def test_cost_model_runs_half_inputs_in_bodies_of_several_value_heads(gating: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """pypto's cost model simulates the saturating launches' bf16 path (bodies of four value
    heads, forced here on a small launch), with and without fla's activations in the kernel:
    some read orders compile and run in the interpreter but fail in the SIM (FFFFFF)."""
    monkeypatch.setattr(pypto_kernel, "MIN_MERGED_BODIES", 1)
    monkeypatch.setattr(pypto_kernel, "HEADS_PER_BODY_CHOICES", (4,))
    script = _cost_model_script()
    workload = script.Workload(lens=(384, 200), heads=2, v_heads=8, dtype="bfloat16", gating=gating)
    with script.output_root(None) as out:
        result = script.run_cost_model(workload, out)
    assert result["total_cycles"] > 0 and result["tasks_per_chunk_head"] > 0


def test_two_calls_that_differ_only_in_scale_each_match_the_reference() -> None:
    """The forward kernel is cached per configuration, ``scale`` included: the second call,
    of the same shape with another scale, must not run the first call's kernel. The smallest
    call the kernel takes (one sequence, one head, K = V = 64, one chunk of 32); each result
    against the float64 recurrence. (The slow case below also varies the l2norm flag and the
    initial state.)"""
    from torch_gdr.testing import make_inputs as shared_inputs
    from torch_gdr.testing import rmse_ratio

    torch_gdr.dispatch.cache_clear()
    inputs = shared_inputs(seq_len=20, num_qk_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64,
                           dtype=torch.float32, normalize_qk=True)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    try:
        for scale in (None, 0.3):  # None: K ** -0.5 = 0.125
            o, state = torch_gdr.chunk_gated_delta_rule(*args, scale=scale, output_final_state=True, chunk_size=32,
                                                        backend="pypto")
            ref_o, ref_state = naive_recurrent_gated_delta_rule(*(a.double() for a in args), scale=scale,
                                                                output_final_state=True)
            assert rmse_ratio(ref_o, o) < 1e-4, scale
            assert rmse_ratio(ref_state, state) < 1e-4, scale
    finally:
        torch_gdr.dispatch.cache_clear()


def test_two_decode_steps_that_differ_only_in_scale_each_match_the_reference() -> None:
    """The decode kernel's cache key holds ``scale`` too: two steps over a pool (one
    sequence, one token, K = V = 64) with different scales, each against the float64
    recurrence from the pool row it starts from."""
    from torch_gdr.testing import make_inputs as shared_inputs
    from torch_gdr.testing import rmse_ratio

    torch_gdr.dispatch.cache_clear()
    inputs = shared_inputs(seq_len=1, num_qk_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64,
                           dtype=torch.float32, normalize_qk=True, with_initial_state=True)
    start = inputs.pop("initial_state").float()
    try:
        for scale in (None, 0.3):
            pool = torch.cat([torch.zeros_like(start), start])
            with torch.no_grad():
                o, _ = torch_gdr.fused_recurrent_gated_delta_rule(**inputs, scale=scale, initial_state=pool,
                                                                  ssm_state_indices=torch.tensor([1]), backend="pypto")
            ref_o, ref_state = naive_recurrent_gated_delta_rule(**{n: t.double() for n, t in inputs.items()},
                                                                scale=scale, initial_state=start.double())
            assert rmse_ratio(ref_o, o) < 1e-4, scale
            assert rmse_ratio(ref_state, pool[1:]) < 1e-4, scale
    finally:
        torch_gdr.dispatch.cache_clear()


@pytest.mark.slow
def test_calls_that_differ_only_in_scale_l2norm_or_initial_state_each_match_the_reference() -> None:
    """Kernels are cached per configuration: a call that differs from the previous one only in
    ``scale``, ``use_qk_l2norm_in_kernel`` or whether it has an initial state must not run the
    previous call's kernel. Each call of the public op against the float64 recurrence."""
    from torch_gdr.testing import make_inputs as shared_inputs
    from torch_gdr.testing import rmse_ratio

    torch_gdr.dispatch.cache_clear()
    inputs = shared_inputs(seq_len=20, num_qk_heads=1, num_v_heads=1, head_k_dim=64, head_v_dim=64,
                           dtype=torch.float32, token_major=True, normalize_qk=True, with_initial_state=True)
    # q and k of norm 0.7: the in-kernel l2norm changes them, so a kernel that ignores the flag shows
    inputs["q"], inputs["k"] = 0.7 * inputs["q"], 0.7 * inputs["k"]
    initial_state = inputs["initial_state"].float()
    calls = [dict(scale=None, use_qk_l2norm_in_kernel=True, initial_state=None),
             dict(scale=0.3, use_qk_l2norm_in_kernel=True, initial_state=None),
             dict(scale=None, use_qk_l2norm_in_kernel=False, initial_state=None),
             dict(scale=None, use_qk_l2norm_in_kernel=True, initial_state=initial_state)]
    for options in calls:
        args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
        o, state = torch_gdr.chunk_gated_delta_rule(*args, output_final_state=True, chunk_size=32, backend="pypto",
                                                    **options)
        reference = dict(options, initial_state=None if options["initial_state"] is None
                         else options["initial_state"].double())
        ref_o, ref_state = naive_recurrent_gated_delta_rule(*(a.double().unsqueeze(0) for a in args),
                                                            output_final_state=True, **reference)
        assert rmse_ratio(ref_o[0], o) < 1e-4, options
        assert rmse_ratio(ref_state, state) < 1e-4, options
    assert len(torch_gdr.dispatch.cache_info().forward.keys) == len(calls)
    torch_gdr.dispatch.cache_clear()
