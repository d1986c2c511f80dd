"""Half precision on the fused CPU kernels (issue 38), against the float64 recurrence on the
same rounded inputs, through the exported calls:

- the decode step over a bfloat16 / float16 pool reads and writes the pool rows directly
  (converted in registers): every row it writes is the float64 state rounded to the pool's
  dtype (to nearest: at most one unit in the last place off, nearly always exact), the
  state carried in float32 between the tokens of a sequence, ``o`` within fla's bound;
- the chunked forward and backward on bfloat16 / float16 q, k, v within fla's bf16 bounds
  (rmse ratio 0.005 for o and the final state, 0.008 for the gradients of q, k, v and the
  initial state, 0.02 for dg and dbeta).

The head dims pick the kernel's column blocks: V = 48 runs blocks of 32 and 16 columns,
V = 56 one of 32 and one of 24 (on AVX2 a bfloat16 block of a multiple of 16 columns runs
even and odd columns in separate registers, the others one register per 8 columns; both
layouts meet in one head there). On AVX-512 a half pool's blocks are 64 columns wide:
V = 96 runs one of 64 and one of 32 (bfloat16 rows stored two registers at a time), V = 48
one block of three registers.
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
import torch

import torch_gdr
from tests.test_pool import make_pool, reference_tokens
from torch_gdr.ops.cpu import kernels
from torch_gdr.testing import make_inputs, rmse_ratio

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the fused CPU kernels are unavailable")

FIELDS = ("q", "k", "v", "g", "beta")
#: Significand bits after the leading one, by dtype: one unit in the last place of x is
#: 2 ** (exponent(x) - bits).
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}

#: fla's bounds for bf16 (rmse ratio against the float64 recurrence on the same inputs).
O_BOUND, GRAD_BOUND, GATE_GRAD_BOUND = 0.005, 0.008, 0.02


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at the float64 values ``x`` (normal range)."""
    _, exponent = torch.frexp(x.abs().clamp_min(1e-4))  # x = m 2^e, m in [0.5, 1)
    return torch.pow(2.0, (exponent - 1 - MANTISSA_BITS[dtype]).double())


def assert_rounded(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``got`` (stored in ``dtype``) is the float64 ``expected`` rounded to nearest: within one
    unit in the last place everywhere, and exactly the rounded value almost everywhere (the
    float32 arithmetic before the rounding moves a few values across a rounding boundary)."""
    assert got.dtype == dtype, what
    got, rounded = got.double(), expected.to(dtype).double()
    assert ((got - expected).abs() <= ulp(expected, dtype)).all(), f"{what}: more than one ulp off"
    exact = (got == rounded).double().mean().item()
    assert exact >= 0.98, f"{what}: only {exact:.3f} of the elements rounded to nearest"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dv", [48, 56, 96])
@pytest.mark.parametrize("tokens", ["one_token", "several_tokens"])
def test_half_pool_step_stores_the_rounded_state(dtype: torch.dtype, dv: int, tokens: str) -> None:
    """One decode call over a key-first half pool: o, every written row, every other row."""
    heads, v_heads, dk, slots = 1, 2, 16, 40
    if tokens == "one_token":
        lens, width, accepted = [1, 1, 1, 1, 1], None, None
    else:  # 11 tokens: two groups of the kernel's 8, the state carried between them
        lens, width, accepted = [11, 3, 1], 12, [12, 2, 1]
    cols = width or 1
    picked = random.Random(dv).sample(range(slots), len(lens) * cols)
    rows = [picked[n * cols:(n + 1) * cols] for n in range(len(lens))]
    rows[-1][0] = -1  # the last sequence starts from zeros and writes nothing
    x = make_inputs(seqlens=lens, num_qk_heads=heads, num_v_heads=v_heads, head_k_dim=dk, head_v_dim=dv,
                    dtype=dtype, normalize_qk=True, seed=dv)
    cu = x.pop("cu_seqlens")
    pool, _ = make_pool(slots, v_heads, dk, dv, dtype, seed=7)
    before = pool.clone()
    idx = torch.tensor(rows if width else [r[0] for r in rows], dtype=torch.int64)
    acc = None if accepted is None else torch.tensor(accepted)
    with torch.no_grad():
        o, returned = torch_gdr.fused_recurrent_gated_delta_rule(
            *(x[f] for f in FIELDS[:4]), beta=x["beta"], initial_state=pool, ssm_state_indices=idx,
            num_accepted_tokens=acc, cu_seqlens=cu, backend="cpu")
    assert returned is pool and o.dtype == dtype
    o = o.reshape(-1, v_heads, dv)
    bos = cu.tolist()[:-1]
    written: set[int] = set()
    ref_o, got_o = [], []
    for n, length in enumerate(lens):
        start = rows[n][(accepted[n] - 1) if accepted else 0]
        state = torch.zeros(v_heads, dk, dv, dtype=torch.float64) if start < 0 else before[start].double()
        outs, states = reference_tokens(x, list(range(bos[n], bos[n] + length)), state, None, False)
        ref_o += outs
        got_o += [o[t] for t in range(bos[n], bos[n] + length)]
        for j, s in enumerate(states):
            if rows[n][j] >= 0:
                assert_rounded(s, pool[rows[n][j]], dtype, f"sequence {n}, token {j}, row {rows[n][j]}")
                written.add(rows[n][j])
    assert rmse_ratio(torch.stack(ref_o), torch.stack(got_o)) < O_BOUND
    for r in set(range(slots)) - written:
        assert torch.equal(pool[r], before[r]), f"row {r} was not to be written"


def _grads(q, k, v, g, beta, h0, do, dht, backend: Optional[str], chunk: int = 16) -> dict:
    leaves = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    if backend is None:  # the float64 recurrence
        from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule
        o, s = naive_recurrent_gated_delta_rule(*(leaves[n] for n in FIELDS), None, leaves["initial_state"], True)
    else:
        o, s = torch_gdr.chunk_gated_delta_rule(*(leaves[n] for n in FIELDS), None, leaves["initial_state"], True,
                                                chunk_size=chunk, backend=backend)
    ((o.double() * do).sum() + (s.double() * dht).sum()).backward()
    return dict(o=o.detach(), final_state=s.detach(), **{f"d{n}": t.grad for n, t in leaves.items()})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, v_heads", [(2, 2), (1, 2)])
def test_half_chunk_within_fla_bounds(dtype: torch.dtype, heads: int, v_heads: int) -> None:
    """Forward and backward of the chunked kernels on half q, k, v (g, beta, the state in
    float32) against the float64 recurrence on the same rounded values."""
    x = make_inputs(batch_size=2, seq_len=45, num_qk_heads=heads, num_v_heads=v_heads, head_k_dim=16, head_v_dim=24,
                    dtype=torch.float64, normalize_qk=True, with_initial_state=True, seed=3)
    half = {n: x[n].to(dtype) if n in "qkv" else x[n].float() for n in FIELDS}
    h0 = (x["initial_state"] * 0.5).float()
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(h0.shape, generator=gen, dtype=torch.float64)
    got = _grads(*(half[n] for n in FIELDS), h0, do, dht, "cpu")
    ref = _grads(*(half[n].double() for n in FIELDS), h0.double(), do, dht, None)
    assert got["o"].dtype == dtype and got["dq"].dtype == dtype and got["dv"].dtype == dtype
    bounds = dict(o=O_BOUND, final_state=O_BOUND, dq=GRAD_BOUND, dk=GRAD_BOUND, dv=GRAD_BOUND,
                  dinitial_state=GRAD_BOUND, dg=GATE_GRAD_BOUND, dbeta=GATE_GRAD_BOUND)
    for name, bound in bounds.items():
        err = rmse_ratio(ref[name], got[name])
        assert err < bound, f"{name}: rmse ratio {err:.4g} (bound {bound})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_chunk_is_the_fp32_chunk_rounded_once(monkeypatch, dtype: torch.dtype) -> None:
    """The half path converts each chunk's rows exactly and computes as the fp32 path does:
    its o, dq, dk and dv are the fp32 path's on the same values, rounded to nearest once
    (bfloat16 products in float32: HALF_PRODUCTS 1, as every machine without a pair-dot unit)."""
    x = make_inputs(batch_size=1, seq_len=40, num_qk_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=24,
                    dtype=torch.float64, normalize_qk=True, with_initial_state=True, seed=11)
    half = {n: x[n].to(dtype) if n in "qkv" else x[n].float() for n in FIELDS}
    h0 = (x["initial_state"] * 0.5).float()
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    monkeypatch.setattr(kernels, "HALF_PRODUCTS", 1)
    outs = {}
    for name, cast in (("half", lambda t: t), ("fp32", lambda t: t.float())):
        leaves = {n: cast(t).detach().requires_grad_() for n, t in half.items()}
        o, _ = torch_gdr.chunk_gated_delta_rule(*(leaves[n] for n in FIELDS), None, h0, True, chunk_size=16,
                                                backend="cpu")
        o.backward(cast(do))
        outs[name] = dict(o=o.detach(), **{f"d{n}": leaves[n].grad for n in "qkv"})
    for name, got in outs["half"].items():
        assert got.dtype == dtype, name
        assert torch.equal(got, outs["fp32"][name].to(dtype)), f"{name}: not the fp32 result rounded once"


# --- bfloat16 products on a pair-dot unit (VDPBF16PS; csrc/pairdot.h) ---------------------

def _pair_dot_call(x: dict, h0: torch.Tensor, do: torch.Tensor, dht: torch.Tensor, l2norm: bool) -> dict:
    """Forward (states kept for the backward) and backward of the cpu backend, chunk 16."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    leaves["initial_state"] = h0.detach().clone().requires_grad_()
    o, s = torch_gdr.chunk_gated_delta_rule(*(leaves[n] for n in FIELDS), None, leaves["initial_state"], True,
                                            use_qk_l2norm_in_kernel=l2norm, chunk_size=16, backend="cpu")
    ((o.double() * do).sum() + (s.double() * dht).sum()).backward()
    return dict(o=o.detach(), final_state=s.detach(), **{f"d{n}": t.grad for n, t in leaves.items()})


@pytest.mark.parametrize("stages", [1, 2], ids=["fused", "segmented"])
@pytest.mark.parametrize("heads, v_heads, l2norm", [(2, 2, False), (1, 2, True)], ids=["mha", "gqa_l2norm"])
def test_bf16_pair_dot_products_within_fla_bounds(monkeypatch, stages: int, heads: int, v_heads: int,
                                                  l2norm: bool) -> None:
    """The bfloat16 forward whose chunk products take bfloat16 operands with float32
    accumulation (the avx512bf16 variant's path), its pair-dot instruction emulated on AVX2
    with VDPBF16PS's rounding (so that it runs on every x86 machine), against the float64
    recurrence on the same rounded inputs at fla's bounds; the backward runs from the chunk
    states it saved. K = 32, V = 48: column blocks of 32 and 16; T = 45: a padded last chunk."""
    x64 = make_inputs(batch_size=2, seq_len=45, num_qk_heads=heads, num_v_heads=v_heads, head_k_dim=32,
                      head_v_dim=48, dtype=torch.float64, normalize_qk=not l2norm, with_initial_state=True, seed=8)
    x = {n: x64[n].to(torch.bfloat16) if n in "qkv" else x64[n].float() for n in FIELDS}
    h0 = (x64["initial_state"] * 0.5).float()
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(x64["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(h0.shape, generator=gen, dtype=torch.float64)
    lanes = torch.zeros(16, dtype=torch.int32)
    if kernels.pair_dot_lanes(torch.zeros(16), lanes, lanes) is None:
        pytest.skip("the loaded variant has no AVX2 emulation of the pair-dot unit (the base variant): "
                    "its bfloat16 products always take the float32 path")
    monkeypatch.setattr(kernels, "STAGES", stages)
    monkeypatch.setattr(kernels, "HALF_PRODUCTS", 1)
    converted = _pair_dot_call(x, h0, do, dht, l2norm)
    monkeypatch.setattr(kernels, "HALF_PRODUCTS", 2)
    got = _pair_dot_call(x, h0, do, dht, l2norm)
    # the products did take rounded operands: not the float32 path's result
    assert not torch.equal(got["o"], converted["o"]) and not torch.equal(got["final_state"], converted["final_state"])
    if kernels.half_unit():  # a machine with the unit: its results are the emulation's, bit for bit
        monkeypatch.setattr(kernels, "HALF_PRODUCTS", 0)
        hardware = _pair_dot_call(x, h0, do, dht, l2norm)
        for name in ("o", "final_state", "dq", "dk", "dv"):
            assert torch.equal(hardware[name], got[name]), f"{name}: the unit and its emulation differ"
    ref_in = {n: x[n].double() for n in FIELDS}
    if l2norm:
        ref_in["q"], ref_in["k"] = (torch.nn.functional.normalize(ref_in[n], dim=-1) for n in "qk")
    ref = _grads(*(ref_in[n] for n in FIELDS), h0.double(), do, dht, None)
    bounds = dict(o=O_BOUND, final_state=O_BOUND, dv=GRAD_BOUND, dinitial_state=GRAD_BOUND, dg=GATE_GRAD_BOUND,
                  dbeta=GATE_GRAD_BOUND)
    if not l2norm:  # the reference's q and k gradients are those of the normalised inputs
        bounds.update(dq=GRAD_BOUND, dk=GRAD_BOUND)
    for name, bound in bounds.items():
        err = rmse_ratio(ref[name], got[name])
        assert err < bound, f"{name}: rmse ratio {err:.4g} (bound {bound})"


def _words(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """int32 words of two bfloat16 tensors, ``lo`` in the low half."""
    bits = [t.view(torch.int16).to(torch.int32) & 0xFFFF for t in (lo, hi)]
    return bits[0] | (bits[1] << 16)


def _sdm_pair_dot(acc: torch.Tensor, a: tuple, b: tuple, order: str = "hi_first") -> torch.Tensor:
    """VDPBF16PS as Intel's SDM states it, per lane: ``acc += a.hi * b.hi`` then ``acc += a.lo
    * b.lo``, each step one float32 FMA rounded to nearest even (here: a float64 sum, exact for
    the operands' exponent range, rounded to float32), denormal results flushed to zero.
    ``order``: ``"lo_first"`` or ``"one_rounding"`` (both products, one rounding), models the
    test tells apart from it."""
    acc = acc.double()
    p_lo, p_hi = (x.double() * y.double() for x, y in zip(a, b))  # exact: 8 x 8 significand bits
    flush = lambda x: torch.where(x.abs() < 2.0 ** -126, torch.zeros_like(x), x)  # noqa: E731
    if order == "one_rounding":
        return flush((acc + p_hi + p_lo).float())
    first, second = (p_hi, p_lo) if order == "hi_first" else (p_lo, p_hi)
    return flush((flush((acc + first).float()).double() + second).float())


def test_pair_dot_emulation_rounds_as_the_instruction() -> None:
    """The AVX2 emulation of VDPBF16PS the pair-dot tests run gives, bit for bit, the SDM's
    result: the odd (high) pair's product added and rounded first, then the even one's; on a
    machine with the unit, so does the unit (the emulation's claim checked on hardware)."""
    gen = torch.Generator().manual_seed(0)
    n = 4096
    scale = lambda: torch.pow(2.0, torch.randint(-6, 7, (n,), generator=gen).float())  # noqa: E731
    halves = [(torch.randn(n, generator=gen) * scale()).to(torch.bfloat16) for _ in range(4)]
    a, b = (halves[0], halves[1]), (halves[2], halves[3])
    acc = torch.randn(n, generator=gen) * scale()
    want = _sdm_pair_dot(acc, a, b)
    for other in ("lo_first", "one_rounding"):  # the data tell the orders of rounding apart
        assert not torch.equal(want, _sdm_pair_dot(acc, a, b, other)), other
    words_a, words_b = _words(*a), _words(*b)
    emulated = kernels.pair_dot_lanes(acc, words_a, words_b)
    if emulated is None:
        pytest.skip("this build has no AVX2 emulation of the pair-dot unit")
    assert torch.equal(emulated, want), f"{(emulated != want).sum().item()} of {n} lanes differ from the SDM's"
    if kernels.half_unit():
        assert torch.equal(kernels.pair_dot_lanes(acc, words_a, words_b, hardware=True), want)


def test_bf16_pair_dot_forward_varlen_gated_and_a_nan(monkeypatch) -> None:
    """The pair path's own chunk loading (csrc/forward.cpp: load_pairs) against the float32
    path's on the same bfloat16 inputs (inference: chunks of 32), packed sequences of uneven
    lengths: with fla's gate and beta activations in the kernel (the exported call), and
    with a NaN in one token's key (the kernel entry itself: a call whose outputs are not
    finite runs again on sanitised inputs), the same outputs not finite, the finite ones
    within fla's bound of each other."""
    lens = [37, 80, 19]
    x = make_inputs(seqlens=lens, num_qk_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32,
                    dtype=torch.float32, seed=4)
    cu = x.pop("cu_seqlens")
    gen = torch.Generator().manual_seed(9)
    q, k, v = (x[n].to(torch.bfloat16) for n in "qkv")
    raw_gate, beta_logits = torch.randn(x["g"].shape, generator=gen), torch.randn(x["beta"].shape, generator=gen)
    a_log, dt_bias = torch.rand(4, generator=gen).log(), torch.randn(4, generator=gen)
    bad_k = k.clone()
    bad_k[0, 50, 1, 3] = float("nan")  # sequence 1, its token 13, query/key head 1 (value heads 2, 3)
    outs = {}
    for mode in (1, 2):
        monkeypatch.setattr(kernels, "HALF_PRODUCTS", mode)
        with torch.no_grad():
            gated = torch_gdr.chunk_gated_delta_rule(
                q, k, v, raw_gate, beta_logits, None, None, True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                backend="cpu")
            nan = kernels.chunk_fwd(q, bad_k, v, x["g"], x["beta"], None, None, True, cu, 32, False)[:2]
        outs[mode] = (*gated, *nan)
    assert outs[2][0].dtype == torch.bfloat16
    o_nan = outs[1][2]
    assert torch.isnan(o_nan[0, 50:117, 2:]).all() and torch.isfinite(o_nan[0, :50]).all()  # the case it says
    for what, want, got in zip(("o", "final state", "o (NaN key)", "final state (NaN key)"), outs[1], outs[2]):
        assert torch.equal(torch.isfinite(want), torch.isfinite(got)), f"{what}: not finite elsewhere"
        finite = torch.isfinite(want)
        err = rmse_ratio(want[finite].double(), got[finite].double())
        assert err < O_BOUND, f"{what}: rmse ratio {err:.4g} against the float32 path"
