"""Yardsticks of the PyPTO decode kernel's form in pypto 0.2.0's cost model (issue 37).

Two kernels, timed beside the copy kernels that move the decode step's pool bytes
(:mod:`torch_gdr.ops.pypto.kernel_pool_copy`, the floor ``bench/pypto_cost_model.py
--decode`` measures the decode kernel against), on the same workload
(:class:`DecodeWorkload` of ``bench/pypto_cost_model.py``):

``compute_only``
    :func:`torch_gdr.ops.pypto.kernel_decode.build_decode_kernel` with
    ``_state_on_chip_for_bench=True``: the decode kernel's tasks (the host's value heads
    per body, the same tiles, the same small-input copies of q, k, v, g, beta, the same
    seven vector passes over the state per (token, value head)) with the state made on
    chip instead of read from the pool, and never stored; only o is written. The cycles
    of the present form without pool traffic.
``cube_read``
    No vector work: each task reads (sequence, value head) state rows ``[K, V]`` from the
    pool into the cube and multiplies the rows of q and k by them with ``pypto.matmul``,
    writing the ``[2, V]`` products ``S^T q``, ``S^T k`` (:func:`build_cube_read_kernel`;
    shapes in :data:`CUBE_SHAPES`). The cycles of the two matvecs on the cube, the state
    only read.

Example (writes ``DIR/result.json``; every figure is the SIM's, deterministic)::

    python bench/pypto_decode_caps.py --batch 64 --tokens 1 --out DIR
    python bench/pypto_decode_caps.py --batch 64 --kernels cube_read --cube-shape stacked --out DIR
"""

# No `from __future__ import annotations` in the kernel builder's scope: pypto reads the jit
# signature's annotations as objects.

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this script belongs to

from pypto_cost_model import (CYCLES_PER_US, DecodeWorkload, _pool_rows, copy_launch, decode_launch,  # noqa: E402
                              output_root, simulate_launches)

from torch_gdr.ops.pypto._env import import_pypto  # noqa: E402

#: The yardstick kernels, in the order they run.
KERNELS: tuple[str, ...] = ("compute_only", "cube_read")
#: How :func:`build_cube_read_kernel` lays out its matmuls:
#: ``two``: per value head, ``[1, K] x [K, V]`` for q and for k (two matmuls, one row read);
#: ``stacked``: per value head, one ``[2, K] x [K, V]`` on q and k stacked by the host
#: (``qk [B * H * 2, K]``, rows ``2 i``, ``2 i + 1`` of key head i).
CUBE_SHAPES: tuple[str, ...] = ("two", "stacked")
#: Copy variants timed for the floor by default (the fastest of them at H16/HV32).
DEFAULT_COPY_VARIANTS: tuple[str, ...] = ("task_8heads_row", "task_2heads_row", "task_64")


def task_timing(report: str) -> dict[str, Optional[float]]:
    """From the ``_simulate.swim.json`` beside a cost-model report: the tasks run on cube
    (AIC) and vector (AIV) cores, the mean task time (``execEnd - execStart``), the mean,
    median and least gap between one task's end and the next task's start on the same core
    (the scheduler's cost per task, with any wait for its AICPU), the tasks of the busiest
    core, and the last task's end."""
    swim = Path(report).parent / "_simulate.swim.json"
    if not swim.exists():
        return dict(cube_core_tasks=None, vector_core_tasks=None, task_cycles=None, gap_cycles=None,
                    gap_median_cycles=None, gap_min_cycles=None, max_tasks_per_core=None, last_task_end=None)
    raw = json.loads(swim.read_text())
    cores = [sorted(c["tasks"], key=lambda t: t["execStart"]) for c in raw if c["tasks"]]
    kinds = {kind: sum(len(c["tasks"]) for c in raw if c["coreType"] == kind) for kind in ("AIC", "AIV")}
    spans = [t["execEnd"] - t["execStart"] for tasks in cores for t in tasks]
    gaps = [b["execStart"] - a["execEnd"] for tasks in cores for a, b in zip(tasks, tasks[1:])]
    return dict(cube_core_tasks=kinds["AIC"], vector_core_tasks=kinds["AIV"],
                task_cycles=round(sum(spans) / len(spans)) if spans else None,
                gap_cycles=round(sum(gaps) / len(gaps)) if gaps else None,
                gap_median_cycles=sorted(gaps)[len(gaps) // 2] if gaps else None,
                gap_min_cycles=min(gaps, default=None),
                max_tasks_per_core=max((len(t) for t in cores), default=None),
                last_task_end=max((t["execEnd"] for tasks in cores for t in tasks), default=None))


def compute_only_launch(w: DecodeWorkload) -> tuple[Any, list[list[torch.Tensor]]]:
    """The decode kernel of ``w`` with its state made on chip (no pool read or write) and
    the decode kernel's own launch arguments (``bench/pypto_cost_model.py``'s
    :func:`decode_launch`; the rows and pool are passed and not read)."""
    from torch_gdr.ops.pypto.kernel_decode import build_decode_kernel, value_heads_per_body

    if w.gating:
        raise ValueError("compute_only: the plain kernel only (no --gating)")
    _, launches = decode_launch(w)
    kernel = build_decode_kernel(
        heads_per_body=w.heads_per_body or value_heads_per_body(w.batch, w.heads, w.v_heads, w.tokens, w.pool_dtype),
        num_qk_heads=w.heads, num_v_heads=w.v_heads, head_k_dim=w.head_k_dim, head_v_dim=w.head_v_dim,
        tokens_per_seq=w.tokens, use_qk_l2norm=w.l2norm, scale=w.head_k_dim ** -0.5, input_dtype=w.dtype,
        pool_dtype=w.pool_dtype, _state_on_chip_for_bench=True)
    return kernel, launches


def _rows(pypto: Any, tensors: list, rows: int, dk: int, key_row: Any) -> tuple:
    """Views ``[rows, K]`` at row ``rows * key_row`` of each of ``tensors``."""
    return tuple(pypto.view(t, [rows, dk], [rows * key_row, 0]) for t in tensors)


def build_cube_read_kernel(*, num_qk_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                           heads_per_body: int = 1, shape: str = "two", pool_dtype: str = "float32",
                           one_task: bool = False) -> Any:
    """A SIM-mode kernel multiplying each (sequence, value head)'s pool row by its q and k
    rows on the cube, nothing else.

    Arguments, in order: ``q``, ``k`` ``[B * H, K]`` fp32 (``shape="two"``) or ``qk``
    ``[B * H * 2, K]`` fp32 (``"stacked"``: q and k of key head i in rows 2i, 2i+1);
    ``read_rows [B, 1]`` int32; ``bodies [1]`` int32 (``B * HV / heads_per_body``); ``pool
    [slots * HV * K, V]`` pool_dtype; ``out [B * HV * 2, V]`` fp32 (row ``2 (n HV + h)``:
    ``S^T q``, the next ``S^T k``). One loop body (task chain, pypto's default partition)
    per sequence and ``heads_per_body`` value heads; ``one_task``: each body compiled into
    one task (``pg_skip_partition``, as the decode kernel's)."""
    if shape not in CUBE_SHAPES:
        raise ValueError(f"shape: expected one of {CUBE_SHAPES}, got {shape!r}")
    pypto = import_pypto()
    fp32 = pypto.DT_FP32
    pool_dt = {"float32": fp32, "bfloat16": pypto.DT_BF16, "float16": pypto.DT_FP16}[pool_dtype]
    dk, dv, hv = head_k_dim, head_v_dim, num_v_heads
    group = num_v_heads // num_qk_heads
    heads = heads_per_body
    bodies_per_seq = hv // heads
    jit = pypto.frontend.jit(runtime_options={"run_mode": pypto.RunMode.SIM, "stitch_function_max_num": 128},
                             **({"pass_options": {"pg_skip_partition": True}} if one_task else {}))

    def products(rows_of: Any, pool: Any, out: Any, seq: Any, row_in: Any, head: Any) -> None:
        pypto.set_cube_tile_shapes([16, 16], [dk, dk], [dv, dv])
        state = pypto.view(pool, [dk, dv], [(row_in * hv + head) * dk, 0])
        for i, lhs in enumerate(rows_of(seq * num_qk_heads + head // group)):
            result = pypto.matmul(lhs, state, fp32)
            pypto.set_vec_tile_shapes(8, 128)
            pypto.assemble(result, [(seq * hv + head) * 2 + i, 0], out)

    def two_rows(q: Any, k: Any) -> Any:
        """Key head r's q and k rows ``[1, K]``, as two left operands."""
        return functools.partial(_rows, pypto, [q, k], 1, dk)

    def stacked_rows(qk: Any) -> Any:
        """Key head r's q and k rows stacked ``[2, K]``, one left operand."""
        return functools.partial(_rows, pypto, [qk], 2, dk)

    if shape == "two":
        @jit
        def cube_read_two(
            q: pypto.Tensor([pypto.DYNAMIC, dk], fp32),
            k: pypto.Tensor([pypto.DYNAMIC, dk], fp32),
            read_rows: pypto.Tensor([pypto.DYNAMIC, 1], pypto.DT_INT32),
            bodies: pypto.Tensor([1], pypto.DT_INT32),
            pool: pypto.Tensor([pypto.DYNAMIC, dv], pool_dt),
            out: pypto.Tensor([pypto.DYNAMIC, dv], fp32),
        ):
            for body in pypto.loop(bodies[0], name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
                pypto.set_vec_tile_shapes(8, 128)
                seq = body // bodies_per_seq
                first_head = (body % bodies_per_seq) * heads
                row_in = read_rows[seq, 0]
                for h in range(heads):
                    products(two_rows(q, k), pool, out, seq, row_in, first_head + h)

        return cube_read_two

    @jit
    def cube_read_stacked(
        qk: pypto.Tensor([pypto.DYNAMIC, dk], fp32),
        read_rows: pypto.Tensor([pypto.DYNAMIC, 1], pypto.DT_INT32),
        bodies: pypto.Tensor([1], pypto.DT_INT32),
        pool: pypto.Tensor([pypto.DYNAMIC, dv], pool_dt),
        out: pypto.Tensor([pypto.DYNAMIC, dv], fp32),
    ):
        for body in pypto.loop(bodies[0], name="LOOP_SEQ_HEAD", idx_name="body", parallel=True):
            pypto.set_vec_tile_shapes(8, 128)
            seq = body // bodies_per_seq
            first_head = (body % bodies_per_seq) * heads
            row_in = read_rows[seq, 0]
            for h in range(heads):
                products(stacked_rows(qk), pool, out, seq, row_in, first_head + h)

    return cube_read_stacked


def cube_read_launch(w: DecodeWorkload, shape: str = "two", heads_per_body: int = 1,
                     one_task: bool = False) -> tuple[Any, list[list[torch.Tensor]]]:
    """:func:`build_cube_read_kernel` for ``w`` (one token: its rows are the decode
    kernel's, :func:`_pool_rows`) and its one launch's arguments."""
    if w.tokens != 1:
        raise ValueError("cube_read: one token a sequence only")
    gen = torch.Generator().manual_seed(0)
    n, h, hv, dk, dv = w.batch, w.heads, w.v_heads, w.head_k_dim, w.head_v_dim
    q, k = torch.randn(n * h, dk, generator=gen), torch.randn(n * h, dk, generator=gen)
    slots, rows = _pool_rows(w)
    pool = torch.zeros(slots * hv * dk, dv, dtype=getattr(torch, w.pool_dtype))
    read_rows = rows[:, 0].int().contiguous().view(-1, 1)
    bodies = torch.full((1,), n * hv // heads_per_body, dtype=torch.int32)
    out = torch.zeros(n * hv * 2, dv)
    kernel = build_cube_read_kernel(num_qk_heads=h, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                                    heads_per_body=heads_per_body, shape=shape, pool_dtype=w.pool_dtype,
                                    one_task=one_task)
    lhs = [q, k] if shape == "two" else [torch.stack([q, k], 1).reshape(n * h * 2, dk)]
    return kernel, [[*lhs, read_rows, bodies, pool, out]]


def run_caps(w: DecodeWorkload, out: Path, kernels: tuple[str, ...] = KERNELS, cube_shape: str = "two",
             cube_heads_per_body: int = 1, cube_one_task: bool = False, variants: tuple[str, ...] = DEFAULT_COPY_VARIANTS,
             with_decode: bool = False) -> dict[str, Any]:
    """Time the yardsticks ``kernels`` (and with ``with_decode`` the decode kernel itself)
    for ``w`` and, in the same run, the copy ``variants``; write ``out/result.json``:
    per kernel ``cycles``, ``tasks``, ``ratio_to_copy`` (cycles over the fastest copy),
    ``error`` (pypto's message where it failed); ``memory_bound_cycles`` and the variant."""
    from torch_gdr.ops.pypto.kernel_pool_copy import copy_variant_applies

    t0 = time.perf_counter()
    launchers = dict(compute_only=lambda: compute_only_launch(w),
                     cube_read=lambda: cube_read_launch(w, cube_shape, cube_heads_per_body, cube_one_task),
                     decode=lambda: decode_launch(w))
    copies = {}
    for variant in variants:  # first: after a failed compile pypto's parser refuses the next kernel
        if copy_variant_applies(variant, w.v_heads):
            kernel, launches = copy_launch(w, variant)
            c = simulate_launches(kernel, launches, out / f"copy_{variant}")[0]
            copies[variant] = dict(cycles=c["total_cycles"], tasks=c["tasks"], **task_timing(c["report"]))
    measured: dict[str, dict[str, Any]] = {}
    for name in (("decode",) if with_decode else ()) + tuple(kernels):
        try:
            kernel, launches = launchers[name]()
            f = simulate_launches(kernel, launches, out / name)[0]
            measured[name] = dict(cycles=f["total_cycles"], tasks=f["tasks"], vector_busy_pct=f["vector_busy_pct"],
                                  cube_busy_pct=f["cube_busy_pct"], vector_pipe_pct=f["vector_pipe_pct"],
                                  cube_pipe_pct=f["cube_pipe_pct"], mte_in_pct=f["mte_in_pct"], report=f["report"],
                                  **task_timing(f["report"]))
        except Exception as e:  # noqa: BLE001 - pypto's failures are a result here
            measured[name] = dict(cycles=None, tasks=None, error=f"{type(e).__name__}: {str(e)[:2000]}")
    floor_variant = min(copies, key=lambda v: copies[v]["cycles"]) if copies else None
    floor = None if floor_variant is None else copies[floor_variant]["cycles"]
    for m in measured.values():
        m["ratio_to_copy"] = None if m["cycles"] is None or not floor else round(m["cycles"] / floor, 3)
        m["us"] = None if m["cycles"] is None else round(m["cycles"] / CYCLES_PER_US, 1)
    result = dict(workload=asdict(w), cube_shape=cube_shape, cube_heads_per_body=cube_heads_per_body,
                  cube_one_task=cube_one_task,
                  kernels=measured, memory_bound_cycles=floor, memory_bound_variant=floor_variant,
                  copy_variants=copies, seconds=round(time.perf_counter() - t0, 1))
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_caps(r: dict[str, Any]) -> str:
    w = r["workload"]
    parts = [f"B={w['batch']} S={w['tokens']} H={w['heads']} HV={w['v_heads']} {w['pool_dtype']} pool:"]
    for name, m in r["kernels"].items():
        parts.append(f"{name} " + (f"failed ({m['error'][:200]})" if m["cycles"] is None else
                                   f"{m['cycles']:,} cycles, {m['tasks']} tasks (AIC {m['cube_core_tasks']}, AIV {m['vector_core_tasks']}; task {m['task_cycles']}, gap "
                                   f"mean {m['gap_cycles']} median {m['gap_median_cycles']} least "
                                   f"{m['gap_min_cycles']}, {m['max_tasks_per_core']} a core at most), "
                                   f"x floor {m['ratio_to_copy']}"))
    if r["memory_bound_cycles"] is not None:
        parts.append(f"floor {r['memory_bound_cycles']:,} ({r['memory_bound_variant']}); copies " + ", ".join(
            f"{v} {c['cycles']:,} ({c['tasks']} tasks)" for v, c in r["copy_variants"].items()))
    return "; ".join(parts) + f" ({r['seconds']} s)"


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="B, sequences")
    parser.add_argument("--tokens", type=int, default=1, help="S, tokens a sequence (a token bucket)")
    parser.add_argument("--heads", type=int, default=16, help="H")
    parser.add_argument("--v-heads", type=int, default=32, help="HV")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256), help="K = V")
    parser.add_argument("--pool-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--heads-per-body", type=int, default=None,
                        help="compute_only: value heads a task (default: the host's choice)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, of {KERNELS}")
    parser.add_argument("--with-decode", action="store_true", help="also time the decode kernel itself")
    parser.add_argument("--cube-shape", default="stacked", choices=CUBE_SHAPES)
    parser.add_argument("--cube-heads-per-body", type=int, default=1, help="cube_read: value heads a loop body")
    parser.add_argument("--cube-one-task", action="store_true",
                        help="cube_read: each body one task (pg_skip_partition)")
    parser.add_argument("--copy-variants", default=",".join(DEFAULT_COPY_VARIANTS),
                        help="comma-separated copy variants for the floor ('' for none)")
    parser.add_argument("--out", default=None, help="keep the SIM output and result.json here")
    args = parser.parse_args(argv)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    unknown = set(kernels) - set(KERNELS)
    if unknown:
        parser.error(f"--kernels: unknown {sorted(unknown)}, expected some of {KERNELS}")
    w = DecodeWorkload(batch=args.batch, tokens=args.tokens, heads=args.heads, v_heads=args.v_heads,
                       head_k_dim=args.head_dim, head_v_dim=args.head_dim, pool_dtype=args.pool_dtype,
                       heads_per_body=args.heads_per_body)
    if w.tokens != 1:
        kernels = tuple(k for k in kernels if k != "cube_read")
    with output_root(args.out) as root:
        r = run_caps(w, root, kernels, args.cube_shape, args.cube_heads_per_body, args.cube_one_task,
                     tuple(v for v in args.copy_variants.split(",") if v), args.with_decode)
    print(format_caps(r))


if __name__ == "__main__":
    main()
