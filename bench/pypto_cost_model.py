"""Time the PyPTO GDR kernels with pypto's cost model (stock SIM, Ascend 910B "A2A3").

For given packed sequence lengths, heads and head dims, compiles the kernel in stock SIM
mode (which computes no numbers: it runs pypto's cycle cost model of one launch) and
prints the total cycles, µs (cycles / 1800, pypto's own conversion), cycles per token,
the task count and the cube / vector busy shares: the cores' task time over the makespan
(from ``_simulate.swim.json``) and the compute pipes' usage (from the cost model's
``_simulate.stat.report.txt``). The same input gives the same figures every time.

Examples::

    python bench/pypto_cost_model.py --lens 4096 --heads 2 --v-heads 4 --head-dim 128 --out /tmp/cm
    python bench/pypto_cost_model.py --lens 256,256,256,256 --chunk 64 --out /tmp/cm16
    python bench/pypto_cost_model.py --suite --append bench/RESULTS.md --out /tmp/cm_suite
    python bench/pypto_cost_model.py --suite saturating --dtype bfloat16 --out /tmp/cm_sat

``--out DIR`` keeps pypto's SIM output (``CostModelSimulationOutput/`` with the stat
report and the per-core swim lanes) under DIR and writes ``DIR/result.json``. Without
``--out`` everything goes to a temporary folder under the torch_gdr cache, removed at the
end. A compile plus cost model takes minutes at T = 16384 on a loaded machine.

Kernels: :func:`forward_launch` builds the forward kernel and its arguments;
``--backward`` uses :data:`BACKWARD_LAUNCH`, a slot for the backward kernel's builder
(None until that kernel exists).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout this script belongs to

from torch_gdr.ops.pypto._env import cache_dir, import_pypto, redirected_output
from torch_gdr.ops.pypto.backward import build_bwd_for_cost_model
from torch_gdr.ops.pypto.forward import chunk_offsets
from torch_gdr.ops.pypto.kernel import augmented_state, build_gdr_kernel, chunk_masks, eye_pad, kernel_chunk_size, \
    ticket_scratch, ticket_width, time_windows

CYCLES_PER_US = 1800.0
#: ``make bench-npu``: (label, lengths). H=2, HV=4, K=V=128, l2norm and initial state on.
SUITE: tuple[tuple[str, tuple[int, ...]], ...] = (
    ("T=256", (256,)),
    ("T=1024", (1024,)),
    ("T=4096", (4096,)),
    ("T=16384", (16384,)),
    ("16 x 256", (256,) * 16),
    ("16 x 1024", (1024,) * 16),
)
#: ``make bench-npu-saturating`` (``--suite saturating``): (label, lengths, H, HV), shapes with
#: enough (sequence, value head) chains to keep every core of the device busy.
SATURATING_SUITE: tuple[tuple[str, tuple[int, ...], int, int], ...] = (
    ("8 x 1024, H16/HV32", (1024,) * 8, 16, 32),
    ("4 x 4096, H16/HV16", (4096,) * 4, 16, 16),
)


@dataclass(frozen=True)
class Workload:
    """One cost-model input: packed sequences and the kernel configuration."""

    lens: tuple[int, ...]
    heads: int = 2
    v_heads: int = 4
    head_k_dim: int = 128
    head_v_dim: int = 128
    chunk_size: int | None = None  # None: the kernel's own choice (kernel_chunk_size)
    dtype: str = "float32"
    initial_state: bool = True
    l2norm: bool = True
    chunk_states: bool = False
    stitch: int | None = None  # pypto's stitch_function_max_num; None: the kernel's default
    gating: bool = False  # fla's activations in the kernel: raw gate with A_log/dt_bias, beta logits

    @property
    def tokens(self) -> int:
        return sum(self.lens)

    def kernel_chunk(self) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return kernel_chunk_size(self.head_k_dim, self.head_v_dim, max(self.lens, default=0),
                                 num_seqs=len(self.lens), num_v_heads=self.v_heads)


#: ``launch(workload) -> (kernel, args)``: a kernel built in SIM run mode and its arguments.
#: ``launch(w) -> (kernel, launches)``: the kernel and the arguments of each of its launches
#: for one call (a forward over long sequences is several launches, see ``time_windows``).
Launch = Callable[[Workload], tuple[Any, list[list[torch.Tensor]]]]


def forward_launch(w: Workload) -> tuple[Any, list[list[torch.Tensor]]]:
    """The forward kernel for ``w`` and its launches' arguments (random inputs, realistic
    gates; each window's launch starts from the initial state: the cost does not depend on it)."""
    gen = torch.Generator().manual_seed(0)
    t, n = w.tokens, len(w.lens)
    dtype = getattr(torch, w.dtype)
    chunk = w.kernel_chunk()
    q = torch.randn(t, w.heads, w.head_k_dim, generator=gen).to(dtype)
    k = torch.randn(t, w.heads, w.head_k_dim, generator=gen).to(dtype)
    v = torch.randn(t, w.v_heads, w.head_v_dim, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(t, w.v_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(t, w.v_heads, generator=gen))
    cu_seqlens = torch.tensor([0, *torch.tensor(w.lens).cumsum(0).tolist()], dtype=torch.int32)
    s0 = 0.5 * torch.randn(n, w.v_heads, w.head_k_dim, w.head_v_dim, generator=gen) if w.initial_state else None
    gate_params = []
    if w.gating:  # raw gate and beta logits; A_log and dt_bias [HV]
        g, beta = torch.randn(t, w.v_heads, generator=gen), torch.randn(t, w.v_heads, generator=gen)
        gate_params = [torch.stack([torch.rand(w.v_heads, generator=gen).log(), torch.randn(w.v_heads, generator=gen)])]
    offsets = chunk_offsets(cu_seqlens, chunk)
    kernel = build_gdr_kernel(
        num_seqs=n, num_qk_heads=w.heads, num_v_heads=w.v_heads, head_k_dim=w.head_k_dim,
        head_v_dim=w.head_v_dim, chunk_size=chunk, use_qk_l2norm=w.l2norm, scale=w.head_k_dim ** -0.5,
        has_initial_state=w.initial_state, input_dtype=w.dtype, output_chunk_states=w.chunk_states,
        gate_in_kernel=w.gating, beta_sigmoid_in_kernel=w.gating, allow_neg_eigval=w.gating,
        **({} if w.stitch is None else {"stitch_function_max_num": w.stitch}),
    )
    chunk_states = (torch.zeros(int(offsets[-1]), w.v_heads, w.head_k_dim, w.head_v_dim) if w.chunk_states
                    else torch.zeros(1, 1))
    inputs = [q.flatten(1), k.flatten(1), v.flatten(1), g, beta, *gate_params, cu_seqlens, offsets.int()]
    constants = [chunk_masks(chunk), eye_pad(w.head_k_dim, w.head_v_dim)]
    chunk_states_arg = chunk_states.view(-1, w.head_v_dim) if w.chunk_states else chunk_states
    ticket = ticket_scratch(n * w.v_heads, chunk, width=ticket_width(w.head_k_dim, w.head_v_dim))
    launches = [[*inputs, window, *constants, augmented_state(s0, n, w.v_heads, w.head_k_dim, w.head_v_dim),
                 torch.zeros(t, w.v_heads * w.head_v_dim), torch.zeros(n * w.v_heads * w.head_k_dim, w.head_v_dim),
                 chunk_states_arg, ticket]
                for window in time_windows(cu_seqlens, chunk)]
    return kernel, launches


def backward_launch(w: Workload) -> tuple[Any, list[list[torch.Tensor]]]:
    """The backward kernel for ``w`` (the forward's kernel chunk size) and its arguments (one launch)."""
    kernel, args = build_bwd_for_cost_model(list(w.lens), heads=w.heads, v_heads=w.v_heads, head_k_dim=w.head_k_dim,
                                    head_v_dim=w.head_v_dim, chunk_size=w.kernel_chunk(),
                                    has_initial_state=w.initial_state, gating=w.gating)
    return kernel, [args]


#: The backward kernel's launch: same contract as :func:`forward_launch`.
BACKWARD_LAUNCH: Launch | None = backward_launch


@contextlib.contextmanager
def output_redirected_to(log: Path) -> Iterator[None]:
    """Send fds 1 and 2 to ``log``: pypto's cost-model plotting scripts print there;
    pypto's own errors still surface as Python exceptions."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log, "w") as sink:
        for fd in saved:
            os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)


def _number(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text)
    return None if match is None else float(match.group(1).replace(",", ""))


def parse_report(text: str) -> dict[str, float | None]:
    """Total cycles, submitted tasks and the average cube / vector pipe and DDR-in copy
    (MTE_IN) usage (% of the makespan), from a ``_simulate.stat.report.txt``."""
    cycles = _number(r"Total Cycles\D*(\d[\d,]*)", text)
    if cycles is None:
        raise RuntimeError("no 'Total Cycles' in the cost-model report:\n" + text[:2000])
    return dict(
        total_cycles=int(cycles),
        tasks=_number(r"Total Submit Tasks\D*(\d+)", text),
        cube_pipe_pct=_number(r"Average Cube Usage\D*[\d.]+\s+([\d.]+)%", text),
        vector_pipe_pct=_number(r"Average Vector Usage\D*[\d.]+\s+([\d.]+)%", text),
        mte_in_pct=_number(r"Average MTE_IN Usage\D*[\d.]+\s+([\d.]+)%", text),
    )


def algorithm_macs_per_chunk_head(chunk_size: int, head_k_dim: int, head_v_dim: int) -> int:
    """Multiply-accumulates the chunked algorithm needs per chunk of l tokens and value head.

    ``Q K^T``, ``K K^T`` (``l^2 K`` each), ``W`` (``l^2 K``), ``U`` (``l^2 V``), ``W S``,
    ``Q S``, ``K^T V'`` (``l K V`` each), ``P V'`` (``l^2 V``) and the triangular inverse
    (``l^3 / 6``): ``3 l^2 K + 2 l^2 V + 3 l K V + l^3 / 6``; 8.17 x 128^3 at l = K = V = 128.
    """
    l, dk, dv = chunk_size, head_k_dim, head_v_dim
    return 3 * l * l * dk + 2 * l * l * dv + 3 * l * dk * dv + l ** 3 // 6


_TILE = re.compile(r'^\s*(T\d+) \[label="Tile\\n\d+ (\w+?)_\[[^]]*\]\[(\d+),(\d+)\]')
_MATMUL = re.compile(r'^\s*(N\d+) \[label="TileOp\\nopmagic:\d+\\nopcode:A_MUL(?:ACC)?_B\\n')
_EDGE = re.compile(r'^\s*(\w+) -> (\w+);')


def leaf_function_macs(graph_dot: str) -> tuple[int | None, int]:
    """The function hash of one of the cost model's leaf graphs (``graphs/*_graph.dot``) and
    the multiply-accumulates of its matmul tile ops: ``m k n = sqrt(|A| |B| |C|)`` from the
    element counts of each op's two input tiles and its output tile (L0A, L0B, L0C)."""
    found = re.search(r"hash:(\d+)", graph_dot)
    tiles, matmuls, inputs, outputs = {}, set(), {}, {}
    for line in graph_dot.splitlines():
        if (m := _TILE.match(line)) is not None:
            tiles[m.group(1)] = (m.group(2), int(m.group(3)) * int(m.group(4)))
        elif (m := _MATMUL.match(line)) is not None:
            matmuls.add(m.group(1))
        elif (m := _EDGE.match(line)) is not None:
            inputs.setdefault(m.group(2), []).append(m.group(1))
            outputs.setdefault(m.group(1), []).append(m.group(2))
    macs = 0
    for op in matmuls:
        operands = dict(tiles[t] for t in inputs.get(op, []) + outputs.get(op, []) if t in tiles)
        if {"L0A", "L0B", "L0C"} <= operands.keys():
            macs += round((operands["L0A"] * operands["L0B"] * operands["L0C"]) ** 0.5)
    return (None if found is None else int(found.group(1))), macs


def executed_macs(report: Path) -> int | None:
    """Multiply-accumulates of every task the cost model ran for one launch: each task's leaf
    function (``tmp_topo_json.json`` beside the SIM output) times that function's matmul MACs
    (:func:`leaf_function_macs`), over the tasks in ``_simulate.swim.json``."""
    sim = report.parent
    topo_file, swim_file = sim.parent / "tmp_topo_json.json", sim / "_simulate.swim.json"
    if not topo_file.exists() or not swim_file.exists():
        return None
    per_function = dict(leaf_function_macs(f.read_text()) for f in (sim / "graphs").glob("*_graph.dot"))
    function_of = {(t["seqNo"], t["taskId"]): t["funcHash"] for t in json.loads(topo_file.read_text())}
    return sum(per_function.get(function_of.get((t["seqNo"], t["taskId"])), 0) or 0
               for core in json.loads(swim_file.read_text()) for t in core["tasks"])


def core_busy_shares(swim_json: Path) -> dict[str, float]:
    """Share of the makespan the cube (AIC) and vector (AIV) cores spend running tasks, in %,
    averaged over the cores of each kind, from the cost model's ``_simulate.swim.json``."""
    cores = json.loads(swim_json.read_text())
    spans = [(c["coreType"], t["execStart"], t["execEnd"]) for c in cores for t in c["tasks"]]
    makespan = max((end for _, _, end in spans), default=0) or 1
    shares = {}
    for kind, name in (("AIC", "cube_busy_pct"), ("AIV", "vector_busy_pct")):
        count = sum(1 for c in cores if c["coreType"] == kind) or 1
        busy = sum(end - start for core_type, start, end in spans if core_type == kind)
        shares[name] = round(100.0 * busy / makespan / count, 1)
    return shares


def simulate_launches(kernel: Any, launches: list[list[torch.Tensor]], out: Path) -> list[dict[str, Any]]:
    """Run ``kernel`` on each launch's arguments in stock SIM mode with its output under
    ``out``; the figures of each launch (:func:`parse_report`, busy shares, report path)."""
    import_pypto()
    out.mkdir(parents=True, exist_ok=True)
    per_launch = []
    for args in launches:
        seen = set(out.rglob("_simulate.stat.report.txt"))
        with redirected_output(out), output_redirected_to(out / "pypto_stdout.log"):
            kernel(*args)
        reports = sorted(set(out.rglob("_simulate.stat.report.txt")) - seen, key=lambda p: p.stat().st_mtime)
        if not reports:
            raise RuntimeError(f"the cost model wrote no _simulate.stat.report.txt under {out}")
        figures = parse_report(reports[-1].read_text())
        swim = reports[-1].parent / "_simulate.swim.json"
        figures.update(core_busy_shares(swim) if swim.exists() else dict(cube_busy_pct=None, vector_busy_pct=None))
        figures["macs"] = executed_macs(reports[-1])
        figures["report"] = str(reports[-1])
        per_launch.append(figures)
    return per_launch


def run_cost_model(w: Workload, out: Path, launch: Launch = forward_launch) -> dict[str, Any]:
    """Compile ``launch(w)`` in stock SIM mode with its output under ``out``; return the figures.

    A call of several launches sums their cycles and tasks (launches on one stream run one
    after another; the host's cost per launch is not modelled) and weights the busy shares
    by each launch's cycles."""
    kernel, launches = launch(w)
    t0 = time.perf_counter()
    per_launch = simulate_launches(kernel, launches, out)
    seconds = time.perf_counter() - t0
    cycles = sum(f["total_cycles"] for f in per_launch)

    def weighted(key: str) -> float | None:
        if any(f[key] is None for f in per_launch):
            return None
        return round(sum(f[key] * f["total_cycles"] for f in per_launch) / max(cycles, 1), 2)

    tasks = None if any(f["tasks"] is None for f in per_launch) else int(sum(f["tasks"] for f in per_launch))
    chunk = w.kernel_chunk()
    chunk_heads = sum(-(-n // chunk) for n in w.lens) * w.v_heads
    macs = None if any(f["macs"] is None for f in per_launch) else sum(f["macs"] for f in per_launch)
    algorithm_macs = chunk_heads * algorithm_macs_per_chunk_head(chunk, w.head_k_dim, w.head_v_dim)
    result = dict(
        workload=asdict(w), tokens=w.tokens, chunk_size=chunk, total_cycles=cycles,
        us=round(cycles / CYCLES_PER_US, 1), cycles_per_token=round(cycles / max(w.tokens, 1), 1),
        cycles_per_vht=round(cycles / max(w.tokens * w.v_heads, 1), 2),
        tasks=tasks, launches=len(per_launch), chunk_heads=chunk_heads,
        tasks_per_chunk_head=None if tasks is None else round(tasks / max(chunk_heads, 1), 2),
        executed_macs=macs, algorithm_macs=algorithm_macs,
        macs_ratio=None if macs is None else round(macs / max(algorithm_macs, 1), 2),
        cube_busy_pct=weighted("cube_busy_pct"), vector_busy_pct=weighted("vector_busy_pct"),
        cube_pipe_pct=weighted("cube_pipe_pct"), vector_pipe_pct=weighted("vector_pipe_pct"),
        mte_in_pct=weighted("mte_in_pct"),
        report=per_launch[-1]["report"], reports=[f["report"] for f in per_launch],
        compile_and_model_s=round(seconds, 1),
    )
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


@dataclass(frozen=True)
class DecodeWorkload:
    """One decode step over a pool: B sequences of S tokens, rows drawn at random from a
    pool of ``B * S + 8`` slots (each sequence reads one row and writes S)."""

    batch: int
    tokens: int = 1
    heads: int = 16
    v_heads: int = 32
    head_k_dim: int = 128
    head_v_dim: int = 128
    dtype: str = "float32"
    pool_dtype: str = "float32"
    l2norm: bool = True
    gating: bool = False  # fla's activations in the kernel: raw gate with A_log/dt_bias, beta logits
    heads_per_body: int | None = None  # value heads per loop body (task); None: the host's choice


def _pool_rows(w: DecodeWorkload) -> tuple[int, torch.Tensor]:
    slots = w.batch * w.tokens + 8
    gen = torch.Generator().manual_seed(1)
    return slots, torch.randperm(slots, generator=gen)[:w.batch * w.tokens].view(w.batch, w.tokens)


def decode_launch(w: DecodeWorkload) -> tuple[Any, list[list[torch.Tensor]]]:
    """The decode kernel for ``w`` (its batch is dynamic; S must be a token bucket, as the
    host pads it) and its one launch's arguments."""
    from torch_gdr.ops.pypto.decode import token_bucket
    from torch_gdr.ops.pypto.kernel_decode import MAX_BRANCHED_TOKENS, build_decode_kernel, value_heads_per_body

    n, s = w.batch, w.tokens
    if token_bucket(s) != s:
        raise ValueError(f"tokens: the cost model times a token bucket (1, 2, 3, 4, 6, 8, 12, 16), got {s}")
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, w.dtype)
    rows_total = n * s
    # one-token kernels read q, k as [T * H, K] and v as [T * HV, V]; others [T, H * K], [T, HV * V]
    q_row, v_row = (w.head_k_dim, w.head_v_dim) if s == 1 else (w.heads * w.head_k_dim, w.v_heads * w.head_v_dim)
    q = torch.randn(rows_total * w.heads * w.head_k_dim // q_row, q_row, generator=gen).to(dtype)
    k = torch.randn(rows_total * w.heads * w.head_k_dim // q_row, q_row, generator=gen).to(dtype)
    v = torch.randn(rows_total * w.v_heads * w.head_v_dim // v_row, v_row, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(rows_total, w.v_heads, generator=gen))
    beta = torch.sigmoid(torch.randn(rows_total, w.v_heads, generator=gen))
    gate_params = []
    if w.gating:  # raw gate and beta logits; A_log and dt_bias [HV]
        g, beta = torch.randn(rows_total, w.v_heads, generator=gen), torch.randn(rows_total, w.v_heads, generator=gen)
        gate_params = [torch.stack([torch.rand(w.v_heads, generator=gen).log(), torch.randn(w.v_heads, generator=gen)])]
    slots, rows = _pool_rows(w)
    read_rows = rows[:, 0].int().contiguous().view(-1, 1)
    write_rows = rows.flatten().int().contiguous()
    pool = torch.zeros(slots * w.v_heads * w.head_k_dim, w.head_v_dim, dtype=getattr(torch, w.pool_dtype))
    o = torch.zeros(rows_total, w.v_heads * w.head_v_dim)
    heads_per_body = w.heads_per_body or value_heads_per_body(n, w.heads, w.v_heads, s, w.pool_dtype)
    kernel = build_decode_kernel(heads_per_body=heads_per_body, num_qk_heads=w.heads, num_v_heads=w.v_heads,
                                 head_k_dim=w.head_k_dim, head_v_dim=w.head_v_dim, tokens_per_seq=s,
                                 use_qk_l2norm=w.l2norm, scale=w.head_k_dim ** -0.5, input_dtype=w.dtype,
                                 pool_dtype=w.pool_dtype, gate_in_kernel=w.gating, beta_sigmoid_in_kernel=w.gating,
                                 allow_neg_eigval=w.gating, store_every_token=s > MAX_BRANCHED_TOKENS)
    bodies = torch.full((1,), n * w.v_heads // heads_per_body, dtype=torch.int32)
    return kernel, [[q, k, v, g, beta, *gate_params, read_rows, write_rows, bodies, pool, o, pool]]


def pool_row_bytes(w: DecodeWorkload) -> int:
    """Pool bytes one decode step moves: per (sequence, value head) one ``[K, V]`` row read
    and S rows written, ``B * HV * (1 + S) * K * V * element size``."""
    element = torch.empty(0, dtype=getattr(torch, w.pool_dtype)).element_size()
    return w.batch * w.v_heads * (1 + w.tokens) * w.head_k_dim * w.head_v_dim * element


def copy_launch(w: DecodeWorkload, variant: str = "partitioned") -> tuple[Any, list[list[torch.Tensor]]]:
    """A PyPTO kernel that moves the pool-row bytes the decode step must move and nothing
    else (:mod:`torch_gdr.ops.pypto.kernel_pool_copy`, one of its ``COPY_VARIANTS``): each
    (sequence, value head) reads its ``[K, V]`` row once and writes it to each of its S
    rows, in the pool's dtype and layout, on the same rows as :func:`decode_launch`."""
    from torch_gdr.ops.pypto.kernel_pool_copy import build_pool_copy_kernel

    n, s, hv, dk, dv = w.batch, w.tokens, w.v_heads, w.head_k_dim, w.head_v_dim
    pool_row_copy = build_pool_copy_kernel(batch=n, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                                           tokens_per_seq=s, pool_dtype=w.pool_dtype, variant=variant)
    slots, rows = _pool_rows(w)
    pool = torch.zeros(slots * hv * dk, dv, dtype=getattr(torch, w.pool_dtype))
    return pool_row_copy, [[rows[:, 0].int().contiguous(), rows.flatten().int().contiguous(), pool, pool]]


def run_decode_cost_model(w: DecodeWorkload, out: Path, variants: tuple[str, ...] | None = None,
                          decode: bool = True) -> dict[str, Any]:
    """The decode kernel's cycles and, in the same run, every copy variant's
    (:func:`copy_launch`): ``total_cycles``, ``memory_bound_cycles`` (the fastest copy),
    ``copy_variants`` (each variant's cycles and tasks) in ``result.json``. ``variants``:
    the copies to run (default: every one that applies); ``decode=False`` times the copies
    alone (``total_cycles`` None)."""
    from torch_gdr.ops.pypto.kernel_pool_copy import COPY_VARIANTS, copy_variant_applies

    t0 = time.perf_counter()
    figures = None
    if decode:
        kernel, launches = decode_launch(w)
        figures = simulate_launches(kernel, launches, out / "decode")[0]
    copies: dict[str, dict[str, Any]] = {}
    for variant in variants or COPY_VARIANTS:
        if not copy_variant_applies(variant, w.v_heads):
            continue
        copy_kernel, copy_launches = copy_launch(w, variant)
        c = simulate_launches(copy_kernel, copy_launches, out / f"copy_{variant}")[0]
        copies[variant] = dict(cycles=c["total_cycles"], tasks=c["tasks"], vector_busy_pct=c["vector_busy_pct"],
                               report=c["report"])
    fastest = min(copies, key=lambda name: copies[name]["cycles"])
    floor = copies[fastest]["cycles"]
    cycles = None if figures is None else figures["total_cycles"]
    result = dict(
        workload=asdict(w), total_cycles=cycles, us=None if cycles is None else round(cycles / CYCLES_PER_US, 1),
        tasks=None if figures is None else figures["tasks"], memory_bound_cycles=floor, memory_bound_variant=fastest,
        copy_tasks=copies[fastest]["tasks"], copy_variants=copies,
        ratio_to_copy=None if cycles is None else round(cycles / max(floor, 1), 2),
        pool_row_bytes=pool_row_bytes(w),
        **({} if figures is None else dict(
            cube_busy_pct=figures["cube_busy_pct"], vector_busy_pct=figures["vector_busy_pct"],
            cube_pipe_pct=figures["cube_pipe_pct"], vector_pipe_pct=figures["vector_pipe_pct"],
            report=figures["report"])),
        compile_and_model_s=round(time.perf_counter() - t0, 1),
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_decode_result(r: dict[str, Any]) -> str:
    """One line for a :func:`run_decode_cost_model` result: the decode kernel, the floor and every copy."""
    w = r["workload"]
    head = (f"decode B={w['batch']} S={w['tokens']} H={w['heads']} HV={w['v_heads']} K={w['head_k_dim']} "
            f"V={w['head_v_dim']} {w['dtype']} inputs, {w['pool_dtype']} pool"
            f"{', gating in kernel' if w['gating'] else ''}, {r['pool_row_bytes']:,} pool bytes: ")
    if r["total_cycles"] is not None:
        head += (f"{r['total_cycles']:,} cycles ({r['us']:,} us, {r['tasks']} tasks, vector cores busy "
                 f"{r['vector_busy_pct']}%), ratio to the floor {r['ratio_to_copy']}; ")
    copies = ", ".join(f"{name} {c['cycles']:,} ({c['tasks']} tasks)" for name, c in r["copy_variants"].items())
    return (head + f"floor {r['memory_bound_cycles']:,} ({r['memory_bound_variant']}); copies: {copies} "
            f"({r['compile_and_model_s']} s)")


def format_result(label: str, r: dict[str, Any]) -> str:
    return (f"{label}: {r['total_cycles']:,} cycles, {r['us']:,} us, {r['cycles_per_token']} cycles/token, "
            f"{r.get('cycles_per_vht')} cycles/vht, {r['tasks']} tasks ({r.get('tasks_per_chunk_head')} per chunk "
            f"and head), MACs {r.get('macs_ratio')}x the algorithm's, cores busy: cube {r['cube_busy_pct']}%, "
            f"vector {r['vector_busy_pct']}% (pipes: cube {r['cube_pipe_pct']}%, vector {r['vector_pipe_pct']}%, "
            f"DDR-in {r.get('mte_in_pct')}%), chunk {r['chunk_size']}, {r.get('launches', 1)} launch(es) "
            f"({r['compile_and_model_s']} s)")


def suite_table(rows: list[tuple[str, dict[str, Any] | None]]) -> str:
    """A markdown table of suite results (None: the run failed)."""
    lines = ["| input | cycles | µs | cycles/token | cycles/vht | tasks | tasks per chunk and head | MACs / "
             "algorithm's | cube busy % | cube pipe % | DDR-in % | vector busy % | chunk | launches |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, r in rows:
        if r is None:
            lines.append(f"| {label} | failed |" + " |" * 12)
            continue
        lines.append(f"| {label} | {r['total_cycles']:,} | {r['us']:,} | {r['cycles_per_token']} | "
                     f"{r.get('cycles_per_vht')} | {r['tasks']} | {r.get('tasks_per_chunk_head')} | "
                     f"{r.get('macs_ratio')} | {r['cube_busy_pct']} | {r['cube_pipe_pct']} | {r.get('mte_in_pct')} | "
                     f"{r['vector_busy_pct']} | {r['chunk_size']} | {r.get('launches', 1)} |")
    return "\n".join(lines)


def _common_flags(args: argparse.Namespace) -> list[str]:
    """The workload flags of ``args`` other than the lengths and heads, to pass on to a child run."""
    flags = ["--head-dim", str(args.head_dim), "--dtype", args.dtype]
    for name, value in (("--head-v-dim", args.head_v_dim), ("--chunk", args.chunk), ("--stitch", args.stitch)):
        if value is not None:
            flags += [name, str(value)]
    for name, on in (("--no-initial-state", args.no_initial_state), ("--no-l2norm", args.no_l2norm),
                     ("--chunk-states", args.chunk_states), ("--backward", args.backward),
                     ("--gating", args.gating)):
        if on:
            flags.append(name)
    return flags


@contextlib.contextmanager
def output_root(out: str | None) -> Iterator[Path]:
    if out is not None:
        yield Path(out)
        return
    root = cache_dir() / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="costmodel_", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", default="4096", help="comma-separated sequence lengths, packed (default 4096)")
    parser.add_argument("--heads", type=int, default=2, help="H, query/key heads")
    parser.add_argument("--v-heads", type=int, default=4, help="HV, value heads")
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256), help="K = V")
    parser.add_argument("--head-v-dim", type=int, default=None, choices=(64, 128, 256), help="V, if not K")
    parser.add_argument("--chunk", type=int, default=None, choices=(32, 64, 128),
                        help="chunk length (default: the kernel's choice)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--no-initial-state", action="store_true")
    parser.add_argument("--no-l2norm", action="store_true")
    parser.add_argument("--chunk-states", action="store_true", help="also write the per-chunk states")
    parser.add_argument("--stitch", type=int, default=None, help="pypto's stitch_function_max_num")
    parser.add_argument("--backward", action="store_true", help="time the backward kernel")
    parser.add_argument("--decode", action="store_true",
                        help="time the decode step over a state pool (with --batch, --tokens) beside a copy kernel "
                             "moving the same pool-row bytes")
    parser.add_argument("--batch", type=int, default=1, help="with --decode: sequences in the step")
    parser.add_argument("--tokens", type=int, default=1, help="with --decode: tokens per sequence (1..16)")
    parser.add_argument("--copy-variants", default=None,
                        help="with --decode: comma-separated copy variants to run (default: all; "
                             "torch_gdr.ops.pypto.kernel_pool_copy.COPY_VARIANTS)")
    parser.add_argument("--copies-only", action="store_true", help="with --decode: time the copies alone")
    parser.add_argument("--heads-per-body", type=int, default=None,
                        help="with --decode: value heads per task, a power of two dividing HV (1, 2 or 4 for "
                             "several tokens; default: the host's choice)")
    parser.add_argument("--pool-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="with --decode: the pool's dtype")
    parser.add_argument("--gating", action="store_true",
                        help="fla's gate and beta activations in the kernel (use_gate_in_kernel with A_log and "
                             "dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval): the forward, --backward or "
                             "--decode kernel")
    parser.add_argument("--out", default=None, help="keep pypto's SIM output and result.json here")
    parser.add_argument("--suite", nargs="?", const="small", default=None, choices=("small", "saturating"),
                        help="run a fixed table: 'small' (the default; H/HV from the flags, make bench-npu) or "
                             "'saturating' (H16/HV32 8 x 1024 and H16/HV16 4 x 4096, make bench-npu-saturating)")
    parser.add_argument("--append", default=None, help="with --suite: append the table to this markdown file")
    args = parser.parse_args(argv)

    if args.decode:
        w = DecodeWorkload(batch=args.batch, tokens=args.tokens, heads=args.heads, v_heads=args.v_heads,
                           head_k_dim=args.head_dim, head_v_dim=args.head_v_dim or args.head_dim, dtype=args.dtype,
                           pool_dtype=args.pool_dtype, l2norm=not args.no_l2norm, gating=args.gating,
                           heads_per_body=args.heads_per_body)
        variants = tuple(args.copy_variants.split(",")) if args.copy_variants else None
        with output_root(args.out) as root:
            r = run_decode_cost_model(w, root, variants, decode=not args.copies_only)
        print(format_decode_result(r))
        return
    launch: Launch = forward_launch
    if args.backward:
        if BACKWARD_LAUNCH is None:
            parser.error("--backward: not available yet (no PyPTO backward kernel; set BACKWARD_LAUNCH "
                         "in bench/pypto_cost_model.py once it exists)")
        launch = BACKWARD_LAUNCH
    common = dict(heads=args.heads, v_heads=args.v_heads, head_k_dim=args.head_dim,
                  head_v_dim=args.head_v_dim or args.head_dim, chunk_size=args.chunk, dtype=args.dtype,
                  initial_state=not args.no_initial_state, l2norm=not args.no_l2norm,
                  chunk_states=args.chunk_states, stitch=args.stitch, gating=args.gating)
    with output_root(args.out) as root:
        if not args.suite:
            w = Workload(lens=tuple(int(x) for x in args.lens.split(",")), **common)
            result = run_cost_model(w, root, launch)
            print(format_result(f"lens={args.lens if len(w.lens) < 5 else f'{len(w.lens)}x{w.lens[0]}'}", result))
            return
        rows = []
        entries = ([(label, lens, args.heads, args.v_heads) for label, lens in SUITE] if args.suite == "small"
                   else list(SATURATING_SUITE))
        for label, lens, heads, v_heads in entries:  # one process each: a crash in pypto loses one row, not the table
            out = root / re.sub(r"[^A-Za-z0-9=]", "", label)
            command = [sys.executable, os.path.abspath(__file__), "--lens", ",".join(map(str, lens)),
                       "--heads", str(heads), "--v-heads", str(v_heads), "--out", str(out), *_common_flags(args)]
            status = subprocess.run(command, check=False).returncode
            result_file = out / "result.json"
            if status != 0 or not result_file.exists():
                print(f"{label}: failed (exit status {status})", flush=True)
                rows.append((label, None))
                continue
            rows.append((label, json.loads(result_file.read_text())))
        kind = "backward" if args.backward else "forward"
        title = (f"\n### PyPTO {kind} kernel, cost model (pypto 0.2.0 stock SIM, A2A3), "
                 f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
                 + (f"H={args.heads}, HV={args.v_heads}, " if args.suite == "small" else "")
                 + f"K={common['head_k_dim']}, V={common['head_v_dim']}, "
                 f"{args.dtype}, l2norm {'off' if args.no_l2norm else 'on'}, initial state "
                 f"{'off' if args.no_initial_state else 'on'}{', gating in kernel' if args.gating else ''}; "
                 "µs = cycles / 1800.\n\n")
        table = title + suite_table(rows) + "\n"
        print(table)
        if args.append:
            with open(args.append, "a") as f:
                f.write(table)


if __name__ == "__main__":
    main()
