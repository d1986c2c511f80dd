"""Context parallelism: ranks that each hold a slice of a packed batch reproduce the single call.

The distributed tests start one gloo world of 2 and one of 4 CPU ranks (processes forked from
a fork server that imported torch once; loopback only, one torch thread each, a timeout so a
hang fails), run every case inside it, and save each rank's
outputs and gradients; the test process assembles them and compares them with the
single-process call (itself checked against the per-token recurrence by the op's tests):
outputs, final states and the gradients of q, k, v, g, beta, the initial states and the
layer's parameters, within 1e-10 in float64 and an rmse ratio of 1e-5 in float32.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_gdr
from torch_gdr.distributed import plan_context
from torch_gdr.distributed.launch import run_local
from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule

TIMEOUT_S = 240.0
# Imported once by a fork server that forks the ranks: a rank then starts in well under a
# second instead of importing torch (and the dynamo machinery of its first custom-op call).
PRELOAD = ("torch", "torch._dynamo", "torch_gdr", "torch_gdr.distributed", __name__)
FIELDS = ("q", "k", "v", "g", "beta")


def cp_call():
    """The public call, which takes ``cp_context=``."""
    return torch_gdr.chunk_gated_delta_rule


@dataclass(frozen=True)
class Case:
    """A packed batch split over ranks: global ``seqlens`` and ``slice_bounds`` (None: equal)."""

    name: str
    seqlens: tuple[int, ...]
    slice_bounds: Optional[tuple[int, ...]] = None
    heads: int = 2
    v_heads: int = 2
    key_dim: int = 8
    value_dim: int = 8
    dtype: torch.dtype = torch.float64
    l2norm: bool = False
    initial_state: bool = False
    state_v_first: bool = False
    chunk_size: int = 16
    token_major: bool = False


CASES = {
    2: [
        Case("one_sequence", (96,)),
        Case("varlen_gva_l2norm_h0", (5, 50, 0, 30, 11), (0, 40, 96), heads=1, v_heads=2, l2norm=True,
             initial_state=True),
        Case("empty_at_boundary", (40, 0, 0, 24), (0, 40, 64), initial_state=True, state_v_first=True),
        Case("float32", (20, 57, 19), dtype=torch.float32, initial_state=True, l2norm=True, key_dim=16,
             value_dim=16),
        Case("bfloat16", (20, 57, 19), dtype=torch.bfloat16, initial_state=True, l2norm=True, key_dim=16,
             value_dim=16),
    ],
    4: [
        Case("one_sequence_h0", (128,), initial_state=True),
        # spans 1, 2 and 3 ranks; rank 2 lies inside the third sequence; an empty one at a boundary
        Case("varlen_spans_1_2_3", (5, 25, 0, 64, 6), (0, 20, 45, 70, 100), heads=2, v_heads=4, l2norm=True,
             initial_state=True),
        Case("short_slices_empty_at_boundary", (3, 0, 2, 60), (0, 3, 5, 7, 65), initial_state=True,
             token_major=True),
        Case("float32", (50, 83, 27), dtype=torch.float32, v_heads=4, initial_state=True, key_dim=16, value_dim=16),
    ],
}
LAYER = dict(hidden_size=16, num_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel_size=4, chunk_size=16)
LAYER_SEQLENS = {2: ((30, 2, 0, 48), (0, 31, 80)), 4: ((2, 40, 1, 37), (0, 21, 31, 32, 80))}


def cu_seqlens_of(seqlens: tuple[int, ...]) -> torch.Tensor:
    return F.pad(torch.tensor(seqlens, dtype=torch.int64).cumsum(0), (1, 0))


def global_inputs(case: Case, seed: int = 0) -> dict:
    """The packed batch of a case (the same on every process): inputs, initial states and the
    random cotangents of the loss."""
    gen = torch.Generator().manual_seed(seed)
    total, num_seqs = sum(case.seqlens), len(case.seqlens)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = dict(q=randn(1, total, case.heads, case.key_dim), k=randn(1, total, case.heads, case.key_dim),
               v=randn(1, total, case.v_heads, case.value_dim), g=F.logsigmoid(randn(1, total, case.v_heads)),
               beta=torch.sigmoid(randn(1, total, case.v_heads)))
    out = {name: x.to(case.dtype) for name, x in out.items()}
    state_shape = (num_seqs, case.v_heads, case.key_dim, case.value_dim)
    out["h0"] = randn(*state_shape).to(case.dtype) if case.initial_state else None
    out["do"] = randn(1, total, case.v_heads, case.value_dim).to(case.dtype)
    out["dht"] = randn(*state_shape)
    return out


def _transpose_state(x: Optional[torch.Tensor], case: Case) -> Optional[torch.Tensor]:
    return x.transpose(-1, -2) if x is not None and case.state_v_first else x


def single_process(case: Case, upcast: bool = False) -> dict:
    """The reference: the public call on the whole batch, its outputs and gradients (``upcast``:
    on the same inputs in float64, the truth a low-precision case is measured against)."""
    data = global_inputs(case)
    if upcast:
        data = {name: None if x is None else x.double() for name, x in data.items()}
    leaves = {name: data[name].clone().requires_grad_() for name in FIELDS}
    h0 = None if data["h0"] is None else data["h0"].clone().requires_grad_()
    o, final = torch_gdr.chunk_gated_delta_rule(
        *(leaves[name] for name in FIELDS), initial_state=_transpose_state(h0, case), output_final_state=True,
        use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=cu_seqlens_of(case.seqlens), chunk_size=case.chunk_size,
        state_v_first=case.state_v_first)
    final = _transpose_state(final, case)
    ((o * data["do"]).sum() + (final * data["dht"].to(final.dtype)).sum()).backward()
    out = {"o": o.detach(), "final": final.detach(), **{f"d{name}": leaves[name].grad for name in FIELDS}}
    out["dh0"] = None if h0 is None else h0.grad
    return out


def _rank_case(rank: int, world_size: int, case: Case) -> dict:
    """This rank's share of a case: its outputs, the final states of the sequences ending on it,
    the gradients of its tokens and of the initial states of the sequences starting on it."""
    data = global_inputs(case)
    ctx = torch_gdr.distributed.build_cp_context(cu_seqlens_of(case.seqlens), slice_bounds=case.slice_bounds)
    lo, hi = ctx.slice_bounds[rank], ctx.slice_bounds[rank + 1]
    leaves = {name: data[name][:, lo:hi].clone().requires_grad_() for name in FIELDS}
    h0 = None if data["h0"] is None else data["h0"][ctx.sequence_ids].clone().requires_grad_()
    inputs = [leaves[name][0] if case.token_major else leaves[name] for name in FIELDS]  # [T, ...] or [1, T, ...]
    o, final = cp_call()(
        *inputs, initial_state=_transpose_state(h0, case), output_final_state=True,
        use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=ctx.cu_seqlens, chunk_size=case.chunk_size,
        state_v_first=case.state_v_first, cp_context=ctx)
    final = _transpose_state(final, case)
    o = o.unsqueeze(0) if case.token_major else o
    ends = ctx.ends_here
    dht = data["dht"][ctx.sequence_ids] * ends[:, None, None, None]
    ((o * data["do"][:, lo:hi]).sum() + (final * dht.to(final.dtype)).sum()).backward()
    starts = ctx.starts_here
    return {"o": o.detach(), "final": final.detach()[ends], "final_ids": ctx.sequence_ids[ends],
            **{f"d{name}": leaves[name].grad for name in FIELDS},
            "dh0": None if h0 is None else h0.grad[starts], "dh0_ids": ctx.sequence_ids[starts],
            "dh0_elsewhere": None if h0 is None else h0.grad[~starts], "bytes_sent": ctx.stats.bytes_sent,
            "backward_bytes_sent": ctx.stats.backward_bytes_sent}


def _layer(world_size: int, rank: int) -> dict:
    """The Gated DeltaNet layer on this rank's slice (rank < 0: the single process)."""
    seqlens, bounds = LAYER_SEQLENS[world_size]
    torch.manual_seed(0)
    layer = torch_gdr.nn.GatedDeltaNet(**LAYER, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    total = sum(seqlens)
    x = torch.randn(1, total, LAYER["hidden_size"], generator=gen, dtype=torch.float64)
    dy = torch.randn(1, total, LAYER["hidden_size"], generator=gen, dtype=torch.float64)
    cu_seqlens = cu_seqlens_of(seqlens)
    if rank < 0:
        x.requires_grad_()
        y = layer(x, cu_seqlens=cu_seqlens)
        lo, hi = 0, total
    else:
        ctx = torch_gdr.distributed.build_cp_context(cu_seqlens, slice_bounds=bounds)
        lo, hi = bounds[rank], bounds[rank + 1]
        x = x[:, lo:hi].clone().requires_grad_()
        y = layer(x, cp_context=ctx)
    (y * dy[:, lo:hi]).sum().backward()
    return {"y": y.detach(), "dx": x.grad, **{f"d{name}": p.grad for name, p in layer.named_parameters()}}


def _errors(world_size: int, rank: int) -> dict:
    """The messages of bad calls: a context for another group size, a wrong slice length, an
    initial state for the wrong number of sequences."""
    case = CASES[world_size][0]
    data = global_inputs(case)
    cu_seqlens = cu_seqlens_of(case.seqlens)
    ctx = torch_gdr.distributed.build_cp_context(cu_seqlens)
    lo, hi = ctx.slice_bounds[rank], ctx.slice_bounds[rank + 1]
    local = [data[name][:, lo:hi] for name in FIELDS]
    call = functools.partial(torch_gdr.distributed.context_parallel_chunk_gated_delta_rule, chunk_size=16)
    wrong_states = torch.zeros(ctx.num_sequences + 1, case.v_heads, case.key_dim, case.value_dim)
    attempts = {
        "other_group_size": lambda: call(*local, cp_context=plan_context(cu_seqlens, 2 * world_size, rank)),
        "slice_length": lambda: call(*(x[:, 1:] for x in local), cp_context=ctx),
        "initial_state": lambda: call(*local, initial_state=wrong_states, cp_context=ctx),
        "layer_cache": lambda: torch_gdr.nn.GatedDeltaNet(**LAYER)(
            torch.zeros(1, ctx.num_tokens, LAYER["hidden_size"]), cache=torch_gdr.nn.GatedDeltaNetCache(),
            cp_context=ctx),
        # Every rank must build its context from the same arguments: each rank is told, not
        # only the odd one out, and none waits forever for a rank that already raised.
        "ranks_disagree_on_cu_seqlens": lambda: torch_gdr.distributed.build_cp_context(
            torch.tensor([0, 100 + 50 * rank, 256])),
        "ranks_disagree_on_slice_bounds": lambda: torch_gdr.distributed.build_cp_context(
            torch.tensor([0, 256]), slice_bounds=[0, *(64 * r + (8 if rank == 0 else 0) for r in range(1, world_size)), 256]),
        "one_rank_has_bad_cu_seqlens": lambda: torch_gdr.distributed.build_cp_context(
            torch.tensor([0, 300, 256]) if rank == world_size - 1 else torch.tensor([0, 100, 256])),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the test checks the type
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def _world_main(rank: int, world_size: int, out_dir: str) -> None:
    results = {"cases": {case.name: _rank_case(rank, world_size, case) for case in CASES[world_size]},
               "layer": _layer(world_size, rank), "errors": _errors(world_size, rank)}
    torch.save(results, pathlib.Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``worlds(R)``: every rank's results of the R-rank world, spawned once per module."""

    @functools.lru_cache(maxsize=None)
    def results(world_size: int) -> list:
        out_dir = tmp_path_factory.mktemp(f"cp{world_size}")
        run_local(_world_main, world_size, str(out_dir), timeout=TIMEOUT_S, preload=PRELOAD)
        return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]

    return results


def _rmse(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str,
                 truth: Optional[torch.Tensor] = None) -> None:
    """float64: within 1e-10; float32: rmse ratio 1e-5; lower precisions: as close to the float64
    ``truth`` as the single process is (within 20%), since both round differently."""
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    actual, expected = actual.double(), expected.double()
    if dtype not in (torch.float32, torch.float64):
        assert truth is not None
        ours, single = _rmse(actual - truth), _rmse(expected - truth)
        assert ours <= 1.2 * single + 1e-6 * _rmse(truth), f"{what}: error {ours:.3g}, single process {single:.3g}"
        return
    if dtype == torch.float64:
        err = (actual - expected).abs().max().item()
        assert err <= 1e-10, f"{what}: max |diff| {err:.3g} > 1e-10"
    else:
        ratio = ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()
        assert ratio <= 1e-5, f"{what}: rmse ratio {ratio:.3g} > 1e-5"


@pytest.mark.parametrize("world_size, case", [(w, case) for w, cases in CASES.items() for case in cases],
                         ids=lambda x: x.name if isinstance(x, Case) else f"{x}ranks")
def test_ranks_match_single_process(worlds, world_size: int, case: Case) -> None:
    ranks = worlds(world_size)
    name = case.name
    expected = single_process(case)
    truth = single_process(case, upcast=True) if case.dtype not in (torch.float32, torch.float64) else {}
    close = functools.partial(assert_close, dtype=case.dtype)
    shares = [r["cases"][name] for r in ranks]
    close(torch.cat([s["o"] for s in shares], dim=1), expected["o"], what="o", truth=truth.get("o"))
    for field_name in FIELDS:
        key = f"d{field_name}"
        close(torch.cat([s[key] for s in shares], dim=1), expected[key], what=key, truth=truth.get(key))
    final_ids = torch.cat([s["final_ids"] for s in shares])
    assert sorted(final_ids.tolist()) == list(range(len(case.seqlens))), "each final state on exactly one rank"
    final = torch.cat([s["final"] for s in shares])[final_ids.argsort()]
    close(final, expected["final"], what="final state", truth=truth.get("final"))
    if case.initial_state:
        ids = torch.cat([s["dh0_ids"] for s in shares])
        assert sorted(ids.tolist()) == list(range(len(case.seqlens))), "each initial state read on one rank"
        dh0 = torch.cat([s["dh0"] for s in shares])[ids.argsort()]
        close(dh0, expected["dh0"], what="dh0", truth=truth.get("dh0"))
        for share in shares:
            assert not share["dh0_elsewhere"].any(), "rows not read have zero gradient"


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_communication_is_one_state_piece_per_rank(worlds, world_size: int) -> None:
    """Bytes per rank and call: (R - 1) * HV * K * (K + V) * 8 (float64) each way, whatever T."""
    ranks = worlds(world_size)
    case = CASES[world_size][0]
    piece = case.v_heads * case.key_dim * (case.key_dim + case.value_dim) * 8
    for r in ranks:
        assert r["cases"][case.name]["bytes_sent"] == (world_size - 1) * piece
        assert r["cases"][case.name]["backward_bytes_sent"] == (world_size - 1) * piece


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_layer_matches_single_process(worlds, world_size: int) -> None:
    ranks = worlds(world_size)
    expected = _layer(world_size, -1)
    assert_close(torch.cat([r["layer"]["y"] for r in ranks], dim=1), expected["y"], torch.float64, "y")
    assert_close(torch.cat([r["layer"]["dx"] for r in ranks], dim=1), expected["dx"], torch.float64, "dx")
    params = [key for key in expected if key not in ("y", "dx")]
    assert len(params) >= 7
    for key in params:  # each rank holds its share of a parameter's gradient: they sum to the whole
        assert_close(sum(r["layer"][key] for r in ranks), expected[key], torch.float64, key)


@pytest.mark.parametrize("attempt, argument", [("other_group_size", "cp_context"), ("slice_length", "q"),
                                               ("initial_state", "initial_state"), ("layer_cache", "cache"),
                                               ("ranks_disagree_on_cu_seqlens", "cu_seqlens"),
                                               ("ranks_disagree_on_slice_bounds", "slice_bounds"),
                                               ("one_rank_has_bad_cu_seqlens", "cu_seqlens")])
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_bad_use_is_a_clear_error(worlds, world_size: int, attempt: str, argument: str) -> None:
    for r in worlds(world_size):
        message = r["errors"][attempt]
        assert message.startswith(f"ValueError: {argument}:"), message


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()  # rank 1 never joins it
    else:
        time.sleep(600)


def test_a_hang_fails_within_the_timeout() -> None:
    with pytest.raises(TimeoutError):
        run_local(_hang, 2, timeout=3.0, preload=PRELOAD)


# ---------------------------------------------------------------- single process, no group


def test_transition_trick_gives_the_product_of_token_transitions() -> None:
    """v = 0 (V := K) and initial state I: the final state is M = A_T ... A_1, with
    A_t = exp(g_t) (I - beta_t k_t k_t^T), and the span maps S to M S + E."""
    case = Case("transition", (37,), heads=1, v_heads=2, key_dim=6, value_dim=5)
    data = global_inputs(case, seed=3)
    k, g, beta = data["k"][0], data["g"][0], data["beta"][0]
    eye = torch.eye(case.key_dim, dtype=torch.float64)
    product = eye.expand(case.v_heads, -1, -1).clone()
    for t in range(k.shape[0]):
        kt = k[t, 0]
        for h in range(case.v_heads):
            product[h] = g[t, h].exp() * (eye - beta[t, h] * torch.outer(kt, kt)) @ product[h]
    _, transition = torch_gdr.chunk_gated_delta_rule(
        data["q"], data["k"], torch.zeros(1, k.shape[0], case.v_heads, case.key_dim, dtype=torch.float64),
        data["g"], data["beta"], initial_state=eye.expand(1, case.v_heads, -1, -1).contiguous(),
        output_final_state=True, chunk_size=16)
    assert (transition[0] - product).abs().max() < 1e-12
    state = torch.randn(1, case.v_heads, case.key_dim, case.value_dim, dtype=torch.float64)
    args = (data["q"], data["k"], data["v"], data["g"], data["beta"])
    _, from_state = naive_recurrent_gated_delta_rule(*args, initial_state=state, output_final_state=True)
    _, from_zero = naive_recurrent_gated_delta_rule(*args, output_final_state=True)
    assert (from_state - (product @ state[0] + from_zero)).abs().max() < 1e-12


@pytest.mark.parametrize("bounds, message", [
    ((0, 10, 9, 20), "slice_bounds"), ((0, 10, 21), "slice_bounds"), ((0, 10), "slice_bounds"),
    ((1, 10, 20), "slice_bounds"), (None, "cu_seqlens")])
def test_slices_that_do_not_tile_are_rejected(bounds, message) -> None:
    cu_seqlens = torch.tensor([0, 7, 20]) if bounds is not None else torch.tensor([0, 7, 19])
    with pytest.raises(ValueError, match=f"^{message}:"):
        plan_context(cu_seqlens, 2, 0, bounds) if bounds is None or len(bounds) != 4 else plan_context(
            cu_seqlens, 3, 0, bounds)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8), st.integers(1, 5), st.data())
def test_plans_tile_every_sequence(seqlens, world_size, data) -> None:
    """Over the ranks, the local pieces of each sequence add up to it, in order; each sequence
    starts on one rank and ends on one rank; the head's chain is the ranks it came through."""
    total = sum(seqlens)
    if total < world_size:
        seqlens = seqlens + [world_size - total]
        total = world_size
    cuts = sorted(data.draw(st.lists(st.integers(1, total - 1), min_size=world_size - 1, max_size=world_size - 1,
                                     unique=True))) if world_size > 1 else []
    bounds = (0, *cuts, total)
    cu_seqlens = cu_seqlens_of(tuple(seqlens))
    pieces: dict[int, list] = {n: [] for n in range(len(seqlens))}
    starts, ends, crossing = [], [], set()
    for rank in range(world_size):
        ctx = plan_context(cu_seqlens, world_size, rank, bounds)
        crossing.add(ctx.any_crossing)
        lengths = (ctx.cu_seqlens[1:] - ctx.cu_seqlens[:-1]).tolist()
        assert ctx.cu_seqlens[-1] == bounds[rank + 1] - bounds[rank]
        for seq, length in zip(ctx.sequence_ids.tolist(), lengths):
            pieces[seq].append((rank, length))
        starts += ctx.sequence_ids[ctx.starts_here].tolist()
        ends += ctx.sequence_ids[ctx.ends_here].tolist()
        if ctx.head_continues:
            head = int(ctx.sequence_ids[0])
            assert [r for r, _ in pieces[head][:-1]] == list(ctx.head_ranks)
            assert ctx.head_tokens_before == sum(length for _, length in pieces[head][:-1])
    for seq, length in enumerate(seqlens):
        ranks = [r for r, _ in pieces[seq]]
        assert sum(n for _, n in pieces[seq]) == length and ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    assert sorted(starts) == sorted(ends) == list(range(len(seqlens)))
    assert crossing == {any(len(p) > 1 for p in pieces.values())}, "every rank knows whether any sequence crosses"


@pytest.mark.slow
def test_example_matches_one_process() -> None:
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in sys.path if p]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "examples/context_parallel.py", "--tokens", "4096", "--ranks", "2"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "OK: worst rmse ratio" in done.stdout, done.stdout
