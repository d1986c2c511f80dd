"""The PyPTO decode-step kernel over a state pool, through the public call
(``torch_gdr.fused_recurrent_gated_delta_rule(..., ssm_state_indices=..., backend="pypto")``
on CPU tensors, run by PyPTO's interpreter), against the float64 recurrence run on each
request alone.

Tolerance: float32 elementwise ``|got - ref| <= 1e-3 |ref| + 1e-4`` on outputs and written
rows; bfloat16/float16 (inputs or pool) fla's rmse ratio 0.005. Every byte of the pool
outside the written rows is unchanged. The interpreter is slow: default cases are tiny
(K = V = 64, at most three sequences), larger ones are slow-marked.
"""

from __future__ import annotations

import contextlib
import os
import random
from typing import Iterator, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_gdr
from torch_gdr.ops.pypto import is_pypto_available
from torch_gdr.testing import make_inputs, rmse_ratio

if not is_pypto_available():
    pytest.skip("pypto==0.2.0 is not importable (pip install 'torch_gdr[npu]')", allow_module_level=True)

from tests.test_pool import FIELDS, make_pool, reference_tokens  # noqa: E402
from torch_gdr.ops.pypto import kernel_cache  # noqa: E402


def _key_first(x: torch.Tensor, v_first: bool) -> torch.Tensor:
    return x.transpose(-1, -2) if v_first else x


def assert_within_tolerance(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    bad = int((err > 1e-3 * want.abs() + 1e-4).sum())
    assert bad == 0, f"{name}: {bad}/{want.numel()} elements out of tolerance, max abs err {err.max():.3g}"


class _HostReadGuard(TorchDispatchMode):
    """While armed, a host read of tensor values (``.item()``, ``bool()``/``int()`` of a
    tensor, ``.tolist()``, ``.cpu()``, ``.numpy()``), a tensor built from host data
    (``torch.tensor(list)``) or an op whose output shape depends on values (``unique``,
    ``nonzero``, indexing by a boolean mask: on a device, a sync) raises ``AssertionError``."""

    FORBIDDEN = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default,
                 torch.ops.aten.is_nonzero.default, torch.ops.aten._unique2.default,
                 torch.ops.aten.unique_dim.default, torch.ops.aten.unique_consecutive.default,
                 torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default)

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.armed:
            masked = func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1])
            if func in self.FORBIDDEN or masked:
                raise AssertionError(f"the pypto pool step read the host: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads_in_the_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Arm :class:`_HostReadGuard` over the host side of the pypto pool step (the op's body,
    :func:`torch_gdr.ops.pypto.decode.pool_step_eager`), except the argument checks (which
    read CPU tensors, as the pool rules say) and the interpreter's launch (on the device
    that is the kernel)."""
    from torch_gdr.ops.pypto import decode

    guard = _HostReadGuard()

    def switched(fn, on: bool):
        """``fn`` with the guard armed (entered here, inside the op's body: a mode around the
        call would see the op, not what its body runs) or disarmed while it runs."""
        def call(*args, **kwargs):
            with guard if on else contextlib.nullcontext():
                before, guard.armed = guard.armed, on
                try:
                    return fn(*args, **kwargs)
                finally:
                    guard.armed = before
        return call

    def refuse(name):
        real = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if guard.armed:
                raise AssertionError(f"the pypto pool step read the host: Tensor.{name}")
            return real(self, *args, **kwargs)
        return method

    monkeypatch.setattr(decode, "pool_step_eager", switched(decode.pool_step_eager, True))
    monkeypatch.setattr(decode._pool, "check_pool_args", switched(decode._pool.check_pool_args, False))
    monkeypatch.setattr(decode.interpreter, "launch", switched(decode.interpreter.launch, False))
    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    yield


def raw_gating(x: dict, num_v_heads: int, *, gate: bool, dt_bias: bool, beta_sigmoid: bool, neg_eigval: bool,
               seed: int) -> tuple[dict, dict, dict]:
    """fla's raw gate and beta logits for the inputs ``x``: ``(inputs with raw g and beta,
    the call's activation arguments, float64 inputs with the activations applied by hand)``.
    Every fourth raw gate is 24 (above softplus's threshold 20) and every fourth another 100
    (where exp overflows in float32)."""
    gen = torch.Generator().manual_seed(seed + 7)
    raw, kwargs, ref = dict(x), {}, dict(x)
    if gate:
        a = torch.randn(x["g"].shape, generator=gen) * 3.0
        a.view(-1)[0::4] = 24.0
        a.view(-1)[1::4] = 100.0
        a_log = (torch.rand(num_v_heads, generator=gen) * 0.02 + 0.005).log()
        bias = torch.rand(num_v_heads, generator=gen) * 2.0 - 1.0 if dt_bias else None
        arg = a.double() + (0.0 if bias is None else bias.double())
        softplus = torch.where(arg > 20.0, arg, torch.log1p(torch.exp(arg)))
        raw["g"], ref["g"] = a.to(x["g"].dtype), -a_log.double().exp() * softplus
        kwargs.update(use_gate_in_kernel=True, A_log=a_log, dt_bias=bias)
    if beta_sigmoid:
        logits = torch.randn(x["beta"].shape, generator=gen) * 2.0
        raw["beta"] = logits.to(x["beta"].dtype)
        ref["beta"] = (2.0 if neg_eigval else 1.0) / (1.0 + torch.exp(-logits.double()))
        kwargs.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval)
    return raw, kwargs, ref


def run_case(lens: list[int], width: Optional[int], accepted: Optional[list[int]], *, heads=(1, 2), dk: int = 64,
             dv: int = 64, rows: Optional[list[list[int]]] = None, dtype=torch.float32, pool_dtype=torch.float32,
             v_first: bool = False, pad: int = 0, l2norm: bool = True, scale: Optional[float] = None,
             nan_rows: tuple[int, ...] = (), slots: int = 12, seed: int = 0, gating: Optional[dict] = None,
             validate: bool = True, guard: Optional[pytest.MonkeyPatch] = None, compiled: bool = False) -> None:
    """One decode call on ``"pypto"`` against each request alone (see the module docstring).
    ``nan_rows``: pool rows filled with NaN that no sequence reads (-1 must not read them).
    ``gating``: keyword arguments of :func:`raw_gating` (raw g and beta, activated in the
    kernel; the reference applies the activations by hand). ``guard``: run the step under
    :func:`no_host_reads_in_the_step` (with this monkeypatch). ``compiled``: the call under
    ``torch.compile(fullgraph=True)``, which must trace it into one graph holding the op."""
    h, hv = heads
    cols = width or 1
    if rows is None:
        picks = random.Random(seed).sample([r for r in range(slots) if r not in nan_rows], len(lens) * cols)
        rows = [picks[n * cols:(n + 1) * cols] for n in range(len(lens))]
    x = make_inputs(seqlens=lens, num_qk_heads=h, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, dtype=dtype,
                    seed=seed)
    cu = x.pop("cu_seqlens")
    x_ref, gating_kwargs = x, {}
    if gating is not None:
        x, gating_kwargs, x_ref = raw_gating(x, hv, seed=seed, **gating)
    bos = cu.tolist()[:-1]
    pool, buffer = make_pool(slots, hv, dk, dv, pool_dtype, v_first, pad, seed=seed + 1)
    for r in nan_rows:
        pool[r] = float("nan")
    before = buffer.clone()
    before_pool = before[:, :pool[0].numel()].view(pool.shape)
    idx = torch.tensor(rows if width else [r[0] for r in rows], dtype=torch.int32)
    acc = None if accepted is None else torch.tensor(accepted, dtype=torch.int64)
    def step(q, k, v, g, beta, pool, idx, acc, cu):
        return torch_gdr.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta=beta, scale=scale, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm, state_v_first=v_first, backend="pypto", validate=validate,
            **gating_kwargs)

    counter = None
    if compiled:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        step = torch.compile(step, fullgraph=True, backend=counter)
    with torch.no_grad(), (no_host_reads_in_the_step(guard) if guard is not None else contextlib.nullcontext()):
        o, returned = step(*(x[f] for f in FIELDS), pool, idx, acc, cu)
    if counter is not None:
        assert counter.frame_count == 1
        assert any(node.target is torch.ops.gdr._pypto_pool_step.default
                   for graph in counter.graphs for node in graph.graph.nodes)
    assert returned is pool
    assert o.shape == x["v"].shape and o.dtype == dtype
    o = o.reshape(-1, hv, dv)

    written: dict[int, torch.Tensor] = {}
    ref_o, out_o = [], []
    for n, length in enumerate(lens):
        start = rows[n][(accepted[n] - 1) if accepted else 0]
        state = (torch.zeros(hv, dk, dv, dtype=torch.float64) if start < 0
                 else _key_first(before_pool[start], v_first).double())
        outs, states = reference_tokens(x_ref, list(range(bos[n], bos[n] + length)), state, scale, l2norm)
        ref_o += outs
        out_o += [o[t] for t in range(bos[n], bos[n] + length)]
        for j, s in enumerate(states):
            if rows[n][j] >= 0:
                written[rows[n][j]] = s.to(pool_dtype).double()
    ref, out = torch.stack(ref_o), torch.stack(out_o)
    low_precision = dtype != torch.float32 or pool_dtype != torch.float32
    if low_precision:
        assert rmse_ratio(ref, out) < 0.005, "o"
    else:
        assert_within_tolerance("o", out, ref)
    for row, state in written.items():
        got = _key_first(pool[row], v_first).double()
        if low_precision:
            assert rmse_ratio(state, got) < 0.005, f"row {row}"
        else:
            assert_within_tolerance(f"row {row}", got, state)
    untouched = torch.ones(buffer.shape, dtype=torch.bool)
    for row in written:
        untouched[row, :pool[0].numel()] = False
    # bit for bit (NaN rows included)
    assert torch.equal(buffer[untouched].view(torch.uint8), before[untouched].view(torch.uint8)), \
        "pool bytes outside the written rows changed"


def test_one_token_per_sequence_minus1_rows_gva_l2norm_scale() -> None:
    """1-D indices, a -1 row (zeros in, nothing written; a NaN row elsewhere must not leak
    in its place), two value heads per key head, the in-kernel l2norm and a scale."""
    run_case([1, 1, 1], None, None, rows=[[2], [-1], [5]], nan_rows=(0,), scale=0.3)


def test_speculative_step_with_acceptance_and_minus1_slots() -> None:
    """[N, S] indices: sequences of different lengths (cu_seqlens), each starting from the
    row after its last accepted token, -1 slots never written."""
    run_case([3, 2], 3, [2, 3], rows=[[4, 6, -1], [1, -1, 9]])


def test_sixteen_tokens_per_sequence_on_device_acceptance_no_host_reads_compiled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """S = 16 (vllm-ascend's widest verification) in the kernel: two sequences of 16 and 13
    tokens (cu_seqlens), each starting from the row of its last accepted token
    (num_accepted_tokens a tensor, as on the device, validate=False), -1 slots never
    written; the step reads nothing on the host and traces under
    torch.compile(fullgraph=True) into one graph around the op."""
    rows = [[r if r % 5 else -1 for r in range(1, 17)], [17 + r if r % 4 else -1 for r in range(16)]]
    run_case([16, 13], 16, [16, 3], rows=rows, slots=34, validate=False, guard=monkeypatch, compiled=True, seed=21)


@pytest.mark.parametrize("pool_dtype, heads, gating", [(torch.bfloat16, (2, 16), False),
                                                      pytest.param(torch.bfloat16, (2, 16), True, marks=pytest.mark.slow),
                                                      (torch.float32, (2, 8), False)])
def test_one_token_bodies_of_eight_and_sixteen_heads(pool_dtype: torch.dtype, heads: tuple[int, int], gating: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One-token bodies of many value heads (forced at a tiny size): 16 heads over a bf16
    pool, the kernel that reads the output from the state before the update (``(d S)^T q
    + (q . k) u``), with and without fla's activations; 8 heads over an fp32 pool, the
    kernel with the decay's scheduling nudge. A row read and written, a -1 row, against
    the float64 recurrence (half rows rounded at the store), other rows bit for bit."""
    from torch_gdr.ops.pypto import kernel_decode

    monkeypatch.setattr(kernel_decode, "VECTOR_CORES", 0)
    kernel_cache.decode_cache_clear()
    try:
        run_case([1, 1], None, None, heads=heads, rows=[[3], [-1]], pool_dtype=pool_dtype, nan_rows=(0,), seed=29,
                 gating=dict(gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=True) if gating else None)
        assert [key.heads_per_body for key in torch_gdr.ops.pypto.cache_info().decode.keys] == [heads[1]]
    finally:
        kernel_cache.decode_cache_clear()


@pytest.mark.parametrize("heads, width, lens, accepted, rows, gating", [
    ((2, 2), 8, [8, 6], [8, 1], [[1, 2, -1, 4, 5, 6, 7, 8], [9, -1, 11, 12, 13, 14, 15, 16]], False),
    ((1, 2), 8, [8], [5], [[1, 2, -1, 4, 5, 6, 7, 8]], True),
    pytest.param((1, 2), 4, [4, 3], [2, 4], [[3, -1, 5, 6], [-1, 8, 9, 10]], False, marks=pytest.mark.slow)])  # 6 s
def test_several_token_bodies_of_two_value_heads(heads: tuple[int, int], width: int, lens: list[int],
                                                 accepted: list[int], rows: list[list[int]], gating: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A several-token step whose loop bodies run two value heads (forced at a tiny size):
    each head's state carried from token to token beside the other's, one branch per
    token's write row for both heads (S = 4), or every token stored (S = 8); the two heads
    of one key head, or of two (H = HV); fla's activations in the kernel (each head its
    own A_log, dt_bias); acceptance counts and -1 slots, against the float64 recurrence,
    rows outside the written ones bit for bit."""
    from torch_gdr.ops.pypto import kernel_decode

    monkeypatch.setattr(kernel_decode, "VECTOR_CORES", 0)
    kernel_cache.decode_cache_clear()
    try:
        run_case(lens, width, accepted, heads=heads, rows=rows, slots=18, nan_rows=(0,), seed=23,
                 gating=dict(gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=False) if gating else None)
        assert [key.heads_per_body for key in torch_gdr.ops.pypto.cache_info().decode.keys] == [2]
    finally:
        kernel_cache.decode_cache_clear()


def test_a_width_between_buckets_is_padded_to_its_bucket() -> None:
    """S = 5 runs on the S = 6 kernel (its sixth token padded: nothing written, no output),
    B sequences of S tokens each ([N, S] indices, no cu_seqlens), acceptance counts."""
    from torch_gdr.ops.pypto.decode import token_bucket

    assert token_bucket(5) == 6
    kernel_cache.decode_cache_clear()
    try:
        run_case([5, 5], 5, [4, 1], rows=[[1, 2, -1, 4, 5], [6, -1, 8, 9, 10]], seed=22)
        assert torch_gdr.ops.pypto.cache_info().decode.token_buckets == (6,)
    finally:
        kernel_cache.decode_cache_clear()


@pytest.mark.parametrize("h, hv, batches", [(1, 2, (1, 3, 24, 25, 100, 256)),
                                             pytest.param(16, 32, (1, 2, 3, 4, 6, 8, 17, 64), marks=pytest.mark.slow)])
def test_at_most_16_decode_kernels_for_batches_to_256_and_widths_to_16(h: int, hv: int, batches: tuple[int, ...],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving loop over every S in 1..16 and batches from 1 to 256 (a spread of sizes:
    at H16/HV32 every task shape of the one-token kernel, 1 to 16 value heads a body)
    builds at most 16 decode kernels for one configuration, each for an S at least the
    step's: the keys of cache_info() counted (over this fp32 pool the one-token bodies
    stop at 8 heads: 16-head fp32 bodies spill). The kernels are stubs (nothing is built or
    run: the cache's builder and the launch replaced) so the loop takes seconds."""
    from torch_gdr.ops.pypto import decode

    built: list[dict] = []
    served: list[int] = []  # the S of the kernel each call got

    def stub_builder(**config):
        built.append(config)
        return object()

    def recording_getter(**config):
        served.append(config["tokens_per_seq"])
        return kernel_cache.get_decode_kernel(**config)

    monkeypatch.setattr(kernel_cache, "_default_decode_builder", stub_builder)
    monkeypatch.setattr(decode, "get_decode_kernel", recording_getter)
    monkeypatch.setattr(decode.interpreter, "launch", lambda kernel, args, outputs: None)
    kernel_cache.decode_cache_clear()
    try:
        d = 64
        pool = torch.zeros(2, hv, d, d)
        for batch in batches:  # every task shape (B * HV <= 48 and above)
            for width in range(1, 17):
                q = torch.zeros(batch, width, h, d)
                k, v = torch.zeros(batch, width, h, d), torch.zeros(batch, width, hv, d)
                g, beta = -torch.rand(batch, width, hv), torch.rand(batch, width, hv)
                idx = torch.full((batch, width), -1, dtype=torch.int32)  # rows play no part in the key
                with torch.no_grad():
                    torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool,
                                                               ssm_state_indices=idx, backend="pypto")
                assert width <= served[-1] <= width + width // 3
        info = torch_gdr.ops.pypto.cache_info().decode
        assert len(info.keys) == info.misses == len(built) <= 16
        if hv == 32:  # the one-token kernel's fp32 task shapes all met
            assert sorted({c["heads_per_body"] for c in built if c["tokens_per_seq"] == 1}) == [1, 2, 4, 8]
            # several tokens: one or two heads a body at S = 4, 8, 12, 16; one at 2, 3, 6
            assert {c["heads_per_body"] for c in built if c["tokens_per_seq"] in (4, 8, 12, 16)} == {1, 2}
            assert {c["heads_per_body"] for c in built if c["tokens_per_seq"] in (2, 3, 6)} == {1}
    finally:
        kernel_cache.decode_cache_clear()


def test_gate_and_beta_sigmoid_in_kernel() -> None:
    """fla's activations inside the kernel: the raw gate with A_log and dt_bias (raw gates
    above softplus's threshold and past float32's exp range), beta logits with
    allow_neg_eigval (beta in [0, 2]); a -1 row."""
    run_case([1, 1], None, None, rows=[[3], [-1]],
             gating=dict(gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gate_without_dt_bias", "beta_sigmoid_only", "speculative_both_no_neg_eigval",
                                  "grouped_heads_gate"])
def test_in_kernel_gating_cases(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "gate_without_dt_bias":
        run_case([1, 1, 1], None, None, gating=dict(gate=True, dt_bias=False, beta_sigmoid=False, neg_eigval=False))
    elif case == "beta_sigmoid_only":
        run_case([1, 1], None, None, gating=dict(gate=False, dt_bias=False, beta_sigmoid=True, neg_eigval=False))
    elif case == "speculative_both_no_neg_eigval":
        run_case([3, 2], 3, [2, 3], rows=[[4, 6, -1], [1, -1, 9]],
                 gating=dict(gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=False))
    elif case == "grouped_heads_gate":
        from torch_gdr.ops.pypto import kernel_decode

        monkeypatch.setattr(kernel_decode, "VECTOR_CORES", 0)
        kernel_cache.decode_cache_clear()
        try:
            run_case([2, 1], 2, [1, 2], heads=(2, 4), seed=3,
                     gating=dict(gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=True))
        finally:
            kernel_cache.decode_cache_clear()


@pytest.mark.slow
def test_step_without_pool_still_gets_the_activations() -> None:
    """The pypto step without a pool (one launch of the chunked kernel) with fla's
    activation arguments: the raw gate and beta logits reach the chunked kernel, which
    applies the activations itself."""
    x = make_inputs(seqlens=[2], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64, dtype=torch.float32,
                    seed=4)
    cu = x.pop("cu_seqlens")
    raw, kwargs, x_ref = raw_gating(x, 2, gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=True, seed=4)
    state = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(5)) * 0.1
    with torch.no_grad():
        o, final = torch_gdr.fused_recurrent_gated_delta_rule(
            *(raw[f] for f in FIELDS[:4]), beta=raw["beta"], initial_state=state, output_final_state=True,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend="pypto", **kwargs)
    outs, states = reference_tokens(x_ref, [0, 1], state[0].double(), None, True)
    assert_within_tolerance("o", o.reshape(-1, 2, 64).double(), torch.stack(outs))
    assert_within_tolerance("final state", final[0].double(), states[-1])


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_half_pool_minus1_row_reads_zeros_not_row_0(pool_dtype: torch.dtype) -> None:
    """A bfloat16/float16 pool (its rows read in one 2-byte copy, then cast): a -1 start row
    reads zeros, not row 0 (read in its place and masked), here NaN, which must not leak."""
    run_case([1, 1], None, None, heads=(1, 1), pool_dtype=pool_dtype, rows=[[3], [-1]], nan_rows=(0,))


@pytest.mark.slow
def test_bf16_inputs_and_bf16_pool() -> None:
    run_case([1, 1], None, None, dtype=torch.bfloat16, pool_dtype=torch.bfloat16)


def test_bucketed_cache_reuses_one_kernel_for_two_batch_sizes() -> None:
    """Batch sizes 5 and 6 share one kernel (the kernel's batch is dynamic): one kernel is
    built and then reused; the cache reports its token bucket. (On a cleared decode cache.)"""
    kernel_cache.decode_cache_clear()
    try:
        run_case([1] * 5, None, None, heads=(1, 1), slots=12, seed=1)
        run_case([1] * 6, None, None, heads=(1, 1), slots=12, seed=2)
        info = torch_gdr.ops.pypto.cache_info().decode
        assert (info.misses, info.hits, info.token_buckets) == (1, 1, (1,))
    finally:
        kernel_cache.decode_cache_clear()


@pytest.mark.parametrize("cores, heads_per_body", [(0, 4), (8, 2)])
def test_one_token_bodies_of_several_value_heads_on_every_row_path(cores: int, heads_per_body: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-token step whose loop bodies run several value heads, one after another (all
    four of two key heads, or a key head's two: forced at a tiny size), on the four paths
    of the kernel's branches: a row read and one written, a zero start (-1) written, a row
    read and nothing written (-1), neither. Row 0 holds NaN (-1 must not read it); against
    the float64 recurrence; rows outside the written ones bit for bit."""
    from torch_gdr.ops.pypto import kernel_decode

    monkeypatch.setattr(kernel_decode, "VECTOR_CORES", cores)
    assert kernel_decode.value_heads_per_body(4, 2, 4) == heads_per_body
    h, hv, dk, dv, slots = 2, 4, 64, 64, 12
    x = make_inputs(seqlens=[1] * 4, num_qk_heads=h, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                    dtype=torch.float32, seed=11)
    x.pop("cu_seqlens")
    x = {f: x[f].reshape(4, 1, *x[f].shape[2:]) for f in FIELDS}
    pool, _ = make_pool(slots, hv, dk, dv, seed=12)
    pool[0] = float("nan")
    before = pool.clone()
    writes, starts = [3, 6, -1, -1], [5, -1, 7, -1]
    kernel_cache.decode_cache_clear()
    try:
        with torch.no_grad():
            o, _ = torch_gdr.fused_recurrent_gated_delta_rule(
                *(x[f] for f in FIELDS[:4]), beta=x["beta"], initial_state=pool,
                ssm_state_indices=torch.tensor(writes), initial_state_indices=torch.tensor(starts),
                use_qk_l2norm_in_kernel=True, backend="pypto")
        assert [key.heads_per_body for key in torch_gdr.ops.pypto.cache_info().decode.keys] == [heads_per_body]
    finally:
        kernel_cache.decode_cache_clear()
    for n in range(4):
        state = torch.zeros(hv, dk, dv, dtype=torch.float64) if starts[n] < 0 else before[starts[n]].double()
        outs, states = reference_tokens(x, [n], state, None, True)
        assert_within_tolerance(f"o[{n}]", o[n, 0].double(), outs[0])
        if writes[n] >= 0:
            assert_within_tolerance(f"row {writes[n]}", pool[writes[n]].double(), states[0])
    untouched = [r for r in range(slots) if r not in (3, 6)]
    assert torch.equal(pool[untouched].view(torch.int32), before[untouched].view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["k128_v64_fp16_pool", "v_first_padded", "width8_k128", "fp16_inputs",
                                  "bf16_pool_k128_speculative", "bf16_pool_k128_grouped_heads", "k256_v256_speculative",
                                  "bf16_pool_k256_v64_gated", "v_first_k128_v256"])
def test_more_configurations(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Configurations the default cases leave out. The bf16 pools at K = 128: the row read
    in one copy and cast block by block (two 64-row blocks), stored rounded after every
    token while the sequence carries fp32 between its tokens (the reference rounds at the
    same stores); one value head per body, and a key head's two value heads per body."""
    if case == "k128_v64_fp16_pool":
        run_case([1, 1, 1], None, None, heads=(2, 4), dk=128, dv=64, pool_dtype=torch.float16)
    elif case == "v_first_padded":
        run_case([2, 1, 2], 2, [1, 2, 2], v_first=True, pad=5)
    elif case == "width8_k128":
        run_case([8, 5], 8, [8, 3], dk=128, dv=128, l2norm=False, slots=20)
    elif case == "fp16_inputs":
        run_case([2, 2], 2, [1, 2], dtype=torch.float16)
    elif case == "bf16_pool_k128_speculative":
        run_case([2, 1], 2, [2, 1], dk=128, dv=128, pool_dtype=torch.bfloat16, rows=[[4, 6], [5, -1]],
                 nan_rows=(0,), seed=5)
    elif case == "k256_v256_speculative":
        run_case([3, 2], 3, [2, 3], dk=256, dv=256, rows=[[4, 6, -1], [1, -1, 9]], nan_rows=(0,))
    elif case == "bf16_pool_k256_v64_gated":
        run_case([2, 1], 2, [2, 1], dk=256, dv=64, pool_dtype=torch.bfloat16, rows=[[4, 6], [5, -1]], seed=7,
                 gating=dict(gate=True, dt_bias=True, beta_sigmoid=True, neg_eigval=True))
    elif case == "v_first_k128_v256":
        run_case([1, 2], 2, [1, 2], dk=128, dv=256, v_first=True, pad=3)
    elif case == "bf16_pool_k128_grouped_heads":
        from torch_gdr.ops.pypto import kernel_decode

        monkeypatch.setattr(kernel_decode, "VECTOR_CORES", 0)
        kernel_cache.decode_cache_clear()
        try:
            run_case([1, 1], None, None, heads=(1, 2), dk=128, dv=128, pool_dtype=torch.bfloat16, rows=[[3], [-1]],
                     nan_rows=(0,), seed=6)
        finally:
            kernel_cache.decode_cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("lens, width, accepted, rows, layout", [
    ([2, 0, 1, 0], 2, None, [[4, 6], [7, 8], [5, -1], [9, 10]], {}),  # empty sequences, one of them last
    ([1, 3, 2], 3, [1, 3, 2], [[2, -1, -1], [4, 6, 9], [-1, 5, 7]], {}),  # acceptance, -1 slots and start rows
    # the copy path of a value-first, padded pool: a row read and rewritten, a fork, -1 slots
    ([2, 0, 1], 2, [2, 1, 1], [[4, 6], [7, 8], [-1, 5]], dict(v_first=True, pad=3)),
    ([1, 1], None, None, [[-1], [-1]], dict(pad=2, nan_rows=(0,))),  # nothing written back
])
def test_varlen_step_reads_nothing_on_the_host(lens: list[int], width: Optional[int], accepted: Optional[list[int]],
                                               rows: list[list[int]], layout: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed sequences (cu_seqlens) of uneven length, ``validate=False``: the host side of
    the step builds its token slots, the copy of a value-first or padded pool and its write
    back, and scatters the outputs with device ops (no ``.item()``, ``.tolist()``,
    ``.cpu()``, no tensor from host data; the argument checks, which read CPU tensors,
    aside), and matches the float64 recurrence, other pool bytes unchanged."""
    run_case(lens, width, accepted, rows=rows, validate=False, guard=monkeypatch, seed=9, **layout)


@pytest.mark.slow
def test_varlen_step_traces_under_torch_compile_fullgraph() -> None:
    """The varlen step (cu_seqlens with an empty sequence, acceptance, -1 slots) compiles
    with ``fullgraph=True`` into one graph around ``gdr::_pypto_pool_step`` and gives the
    float64 recurrence's outputs and rows, other pool bytes unchanged."""
    run_case([2, 0, 1], 2, [2, 1, 1], rows=[[4, 6], [7, 8], [-1, 5]], validate=False, compiled=True, seed=10)


@pytest.mark.parametrize("width, bucket", [(1, 1), (2, 2), (3, 3), (4, 4), (5, 6), (6, 6), (7, 8), (8, 8),
                                           (9, 12), (12, 12), (13, 16), (16, 16)])
def test_token_buckets_pad_at_most_a_third(width: int, bucket: int) -> None:
    from torch_gdr.ops.pypto.decode import token_bucket

    assert token_bucket(width) == bucket
    assert bucket - width <= bucket // 3


@pytest.mark.parametrize("width", [0, -3, 17])
def test_token_bucket_rejects_widths_outside_1_to_16(width: int) -> None:
    from torch_gdr.ops.pypto.decode import token_bucket

    with pytest.raises(ValueError, match=rf"width: expected tokens per sequence in 1..16, got {width}"):
        token_bucket(width)


@pytest.mark.slow
def test_step_traces_under_torch_compile_fullgraph() -> None:
    """The proxy for capturing the step in a device graph: the public decode call with
    ``backend="pypto"`` compiles with ``fullgraph=True`` (no graph break: the launch is the
    op ``gdr::_pypto_pool_step``) into one graph, and the compiled step gives the float64
    recurrence's outputs and rows, other pool bytes unchanged."""
    from torch._dynamo.testing import CompileCounterWithBackend

    h, hv, dk, dv, slots = 1, 2, 64, 64, 6
    x = make_inputs(seqlens=[1, 1], num_qk_heads=h, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, dtype=torch.float32,
                    seed=5)
    x.pop("cu_seqlens")
    q, k, v, g, beta = (x[f].reshape(2, 1, *x[f].shape[2:]) for f in ("q", "k", "v", "g", "beta"))
    pool, _ = make_pool(slots, hv, dk, dv, torch.float32, False, 0, seed=6)
    before = pool.clone()
    rows = [3, -1]
    idx = torch.tensor(rows, dtype=torch.int32)

    def step(q, k, v, g, beta, pool, idx):
        o, _ = torch_gdr.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=pool,
                                                          ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                                                          backend="pypto")
        return o

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        o = torch.compile(step, fullgraph=True, backend=counter)(q, k, v, g, beta, pool, idx)
    assert counter.frame_count == 1
    assert any(node.target is torch.ops.gdr._pypto_pool_step.default
               for graph in counter.graphs for node in graph.graph.nodes)
    for n, row in enumerate(rows):
        state = torch.zeros(hv, dk, dv, dtype=torch.float64) if row < 0 else before[row].double()
        outs, states = reference_tokens(x, [n], state, None, True)
        assert_within_tolerance(f"o[{n}]", o[n, 0].double(), outs[0])
        if row >= 0:
            assert_within_tolerance(f"row {row}", pool[row].double(), states[0])
    untouched = [r for r in range(slots) if r != 3]
    assert torch.equal(pool[untouched].view(torch.uint8), before[untouched].view(torch.uint8))


@pytest.mark.slow
def test_pool_step_op_passes_opcheck() -> None:
    """``gdr::_pypto_pool_step`` declares its mutation of the pool, and its fake agrees
    with the real op (torch.library.opcheck: schema, fake tensor, autograd registration,
    dynamo's AOT dispatch)."""
    x = make_inputs(seqlens=[1, 1], num_qk_heads=1, num_v_heads=2, head_k_dim=64, head_v_dim=64, dtype=torch.float32,
                    seed=7)
    q, k, v, g, beta = (x[f].reshape(2, 1, *x[f].shape[2:]) for f in ("q", "k", "v", "g", "beta"))
    pool, _ = make_pool(4, 2, 64, 64, torch.float32, False, 0, seed=8)
    idx = torch.tensor([2, -1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.gdr._pypto_pool_step.default,
                          (q, k, v, g, beta, pool, idx, None, None, None, True, False, True))


def _matrix_case(dim: int, batch: int, width: int, pool_dtype: torch.dtype) -> None:
    """One cell of the interpreter matrix: H2/HV4, K = V = ``dim``, ``batch`` sequences of
    ``width`` tokens (acceptance counts running over 1..S, the last sequence shorter), -1
    slots (never written), a -1 start row, a NaN row nobody reads."""
    gen = random.Random(dim * 1000 + batch * 100 + width)
    slots = batch * width + 3
    picks = gen.sample(range(1, slots), batch * width)  # row 0 holds NaN
    rows = [picks[n * width:(n + 1) * width] for n in range(batch)]
    accepted = [1 + (n * 5 + 2) % width for n in range(batch)] if width > 1 else None
    lens = [width] * batch
    if width > 1:
        lens[-1] = max(1, width - 2)
        for n in range(batch):  # a -1 slot, not the one the sequence starts from
            if (accepted[n] + n) % width != accepted[n] - 1:
                rows[n][(accepted[n] + n) % width] = -1
    start = accepted[-1] - 1 if accepted else 0
    rows[-1][start] = -1  # the last sequence starts from zeros
    run_case(lens, width if width > 1 else None, accepted, heads=(2, 4), dk=dim, dv=dim, rows=rows,
             pool_dtype=pool_dtype, nan_rows=(0,), slots=slots, seed=dim + batch + width)


_MATRIX = [(dim, batch, width, dtype) for dim in (64, 128, 256) for batch in (1, 3, 8) for width in (1, 4, 16)
           for dtype in (torch.float32, torch.bfloat16, torch.float16)]
#: The matrix cells run by default (one per pool dtype, each S, the three head dims, batches 1 and 3).
_MATRIX_DEFAULT = {(64, 3, 1, torch.float32), (64, 1, 4, torch.bfloat16), (64, 3, 16, torch.float16),
                   (128, 1, 1, torch.float16), (256, 1, 1, torch.bfloat16)}


#: The cells that take minutes each in the interpreter on a 2-core machine (K = 256 with 16
#: tokens): run only with TORCH_GDR_FULL_MATRIX=1, so that the slow suite fits CI's time.
_MATRIX_LONG = {cell for cell in _MATRIX if cell[0] == 256 and cell[2] == 16}
_FULL_MATRIX = os.environ.get("TORCH_GDR_FULL_MATRIX") == "1"


def _matrix_marks(cell: tuple) -> tuple:
    if cell in _MATRIX_DEFAULT:
        return ()
    if cell in _MATRIX_LONG:
        return (pytest.mark.slow, pytest.mark.skipif(not _FULL_MATRIX, reason="K = 256, S = 16: minutes per cell "
                                                     "in the interpreter; set TORCH_GDR_FULL_MATRIX=1"))
    return (pytest.mark.slow,)


@pytest.mark.parametrize("dim, batch, width, pool_dtype", [
    pytest.param(*cell, marks=_matrix_marks(cell)) for cell in _MATRIX],
    ids=lambda x: str(x).replace("torch.", ""))
def test_interpreter_matrix(dim: int, batch: int, width: int, pool_dtype: torch.dtype) -> None:
    """Issue 37's interpreter matrix through the public call: H2/HV4, K = V in {64, 128,
    256}, B in {1, 3, 8}, S in {1, 4, 16}, fp32, bf16 and fp16 pools, acceptance counts,
    -1 slots and start rows, against the float64 recurrence (fp32 within 1e-3 |ref| + 1e-4,
    half pools within fla's rmse ratio 0.005 against a reference rounded at the same
    stores); rows other than the written ones bit for bit."""
    _matrix_case(dim, batch, width, pool_dtype)
