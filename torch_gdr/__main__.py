"""``python -m torch_gdr``: check every available backend against the reference.

Runs a workload (packed sequences of uneven length, one of them empty, GVA, an initial
state, q/k l2norm) through each backend, compares output and final state with the
per-token recurrence in float64, times forward and forward + backward, and prints a table.
PyPTO's CPU interpreter is slow, so its row runs a smaller workload of its own; its first
use builds the interpreter's calculator library once (30-45 s on an idle machine).

The exit status is 0 when every backend ran and agreed with the reference within the
tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import torch_gdr
from torch_gdr.dispatch import BACKENDS, CallSpec
from torch_gdr.ops.cpu._variants import heartbeat
from torch_gdr.ref import naive_recurrent_gated_delta_rule

#: Backends timed by one call each (the per-token recurrence in Python, PyPTO's interpreter):
#: their rows are a correctness check first, and repeating them would cost minutes.
SLOW_BACKENDS = ("recurrent", "pypto")

#: The PyPTO row's workload: small, since the interpreter runs the kernel op by op.
PYPTO_SEQLENS = [40, 0, 23]
PYPTO_HEAD_DIM = 64
PYPTO_CHUNK_SIZE = 32


@dataclass
class Workload:
    """Packed float32 inputs and the float64 recurrence's ``(o, final_state)`` on them."""

    name: str
    seqlens: list[int]
    num_qk_heads: int
    num_v_heads: int
    head_dim: int
    chunk_size: int
    inputs: dict[str, torch.Tensor] = field(repr=False)
    reference: tuple[torch.Tensor, torch.Tensor] = field(repr=False)

    def describe(self) -> str:
        return (f"seqlens {self.seqlens} (T = {sum(self.seqlens)}), H = {self.num_qk_heads}, "
                f"HV = {self.num_v_heads}, K = V = {self.head_dim}, chunk {self.chunk_size}")


@dataclass
class Row:
    backend: str
    device: str
    workload: str
    rel_err_o: float = float("nan")
    rel_err_state: float = float("nan")
    forward_ms: float = float("nan")
    forward_backward_ms: float = float("nan")
    note: str = ""
    ok: bool = False


def make_inputs(seqlens: list[int], num_qk_heads: int, num_v_heads: int, head_dim: int,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """Packed float32 inputs ``[1, T, ...]`` with realistic gates (``g = logsigmoid``,
    ``beta = sigmoid``), an initial state ``[N, HV, K, V]`` and ``cu_seqlens``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    offsets = torch.tensor([0] + seqlens).cumsum(0)
    return dict(
        q=torch.randn(1, total, num_qk_heads, head_dim, generator=gen),
        k=torch.randn(1, total, num_qk_heads, head_dim, generator=gen),
        v=torch.randn(1, total, num_v_heads, head_dim, generator=gen),
        g=F.logsigmoid(torch.randn(1, total, num_v_heads, generator=gen)),
        beta=torch.sigmoid(torch.randn(1, total, num_v_heads, generator=gen)),
        initial_state=0.1 * torch.randn(len(seqlens), num_v_heads, head_dim, head_dim, generator=gen),
        cu_seqlens=offsets,
    )


def make_workload(name: str, seqlens: list[int], num_qk_heads: int, num_v_heads: int, head_dim: int,
                  chunk_size: int) -> Workload:
    inputs = make_inputs(seqlens, num_qk_heads, num_v_heads, head_dim)
    reference = naive_recurrent_gated_delta_rule(
        **{n: t.double() if t.is_floating_point() else t for n, t in inputs.items()},
        use_qk_l2norm_in_kernel=True, output_final_state=True)
    return Workload(name, seqlens, num_qk_heads, num_v_heads, head_dim, chunk_size, inputs, reference)


def _alternating_medians_ms(fns: list[Callable[[], object]], repeats: int, sync: Callable[[], None],
                            warmup: bool) -> list[float]:
    """Median wall time in ms of each of ``fns``, timed in alternating rounds (one call of
    each per round, after one untimed round when ``warmup``), so that a machine whose speed
    drifts (other load, frequency) weighs on every function alike: timed back to back, a
    slow spell during one of them could show forward + backward faster than forward."""
    if warmup:
        for fn in fns:
            fn()
            sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            sync()
            spent.append((time.perf_counter() - start) * 1e3)
    return [sorted(spent)[len(spent) // 2] for spent in times]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` (over 1 where ``want`` is all zeros); inf for a shape
    mismatch or a NaN."""
    if got.shape != want.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    err = (got.double().cpu() - want).abs().max().item()
    scale = want.abs().max().item() or 1.0
    return float("inf") if err != err else err / scale


def check_backend(backend: str, device: torch.device, workload: Workload, repeats: int, tolerance: float) -> Row:
    """Run one backend on one device: errors against the reference (relative to the
    reference's largest magnitude), median timings, and whether it agrees."""
    row = Row(backend, str(device), workload.name)
    inputs = {n: t.to(device) for n, t in workload.inputs.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=workload.chunk_size,
                  backend=backend)
    try:
        o, s = torch_gdr.chunk_gated_delta_rule(**inputs, **kwargs)
    except Exception as error:  # noqa: BLE001 - the table reports any failure
        row.note = f"failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:80]}"
        return row
    row.rel_err_o = _relative_error(o, workload.reference[0])
    row.rel_err_state = _relative_error(s, workload.reference[1])
    row.ok = row.rel_err_o <= tolerance and row.rel_err_state <= tolerance
    if not row.ok:
        row.note = f"DISAGREES with the reference (tolerance {tolerance:.0e})"
        return row

    def forward() -> None:
        torch_gdr.chunk_gated_delta_rule(**inputs, **kwargs)

    def forward_backward() -> None:
        leaves = {n: (t.detach().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
        o, s = torch_gdr.chunk_gated_delta_rule(**leaves, **kwargs)
        (o.sum() + s.sum()).backward()

    try:
        # One untimed round first where calls are cheap: a first backward pays for lazy
        # imports and first allocations.
        row.forward_ms, row.forward_backward_ms = _alternating_medians_ms(
            [forward, forward_backward], repeats, sync, warmup=backend not in SLOW_BACKENDS)
    except Exception as error:  # noqa: BLE001
        row.ok = False
        row.note = f"backward failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:80]}"
        return row
    if backend == "pypto" and device.type == "cpu":
        row.note = "PyPTO's interpreter on the CPU, forward and backward kernels (a correctness check, slow)"
    return row


def pypto_status() -> str:
    """``"ready"``, ``"needs build"`` (the interpreter's calculator library is not built yet),
    or why PyPTO cannot run (not installed, wrong version)."""
    from torch_gdr.ops.pypto import is_pypto_available

    if not is_pypto_available():
        return "not installed (pip install 'torch_gdr[npu]')"
    try:
        from torch_gdr.ops.pypto.interpreter import _calculator_dir

        built = (_calculator_dir() / "install" / "lib" / "libtile_fwk_calculator.so").exists()
    except Exception:  # noqa: BLE001 - only for the message
        built = True
    return "ready" if built else "needs build"


#: Backends by the devices they run on here (pypto on the CPU through its interpreter).
CPU_BACKENDS = ("cpu", "torch", "recurrent", "pypto")
CUDA_BACKENDS = ("torch", "recurrent", "fla")


def backend_report() -> list[str]:
    """One line per backend: whether it serves a float32 chunked call on this machine's
    devices (the CPU, and CUDA where there is one), else every reason it does not."""
    from torch_gdr.dispatch import CallSpec

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lines = []
    for name, backend in BACKENDS.items():
        served, reasons = [], []
        for device in devices:
            x = torch.empty(1, 1, 1, 128, device=device)
            found = backend.unsupported_reasons(CallSpec.of("chunk", x, x, 64, False))
            (reasons.extend(f"{device}: {r.text}" for r in found) if found else served.append(device))
        status = f"serves {', '.join(served)}" if served else "missing here"
        lines.append(f"  {name:<9} {status}" + (f" ({'; '.join(reasons)})" if reasons and not served else ""))
    return lines


def available_targets(backends: Optional[list[str]], include_pypto: bool = True) -> list[tuple[str, torch.device]]:
    """(backend, device) pairs to check: the CPU's backends (pypto only when
    ``include_pypto``), and with a GPU the CUDA ones (fla where fla-core imports)."""
    names = backends or [name for name in BACKENDS if name != "pypto" or include_pypto]
    cpu_spec = CallSpec.of("chunk", torch.empty(1, 1, 1, 1), torch.empty(1, 1, 1, 1), 64, False)
    targets = [(name, torch.device("cpu")) for name in names if name in CPU_BACKENDS
               and (name == "pypto" or (backends is not None) or BACKENDS[name].serves(cpu_spec))]
    if torch.cuda.is_available():
        from torch_gdr.ops import fla

        targets += [(name, torch.device("cuda")) for name in names
                    if name in CUDA_BACKENDS and (name != "fla" or fla.available())]
    return targets


def format_table(rows: list[Row]) -> str:
    header = (f"{'backend':<10} {'device':<7} {'workload':<9} {'rel|Δo|':>10} {'rel|Δstate|':>12} "
              f"{'fwd ms':>9} {'fwd+bwd ms':>11}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.backend:<10} {r.device:<7} {r.workload:<9} {r.rel_err_o:>10.2e} {r.rel_err_state:>12.2e} "
                     f"{r.forward_ms:>9.1f} {r.forward_backward_ms:>11.1f}  {r.note}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torch_gdr", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[300, 17, 0, 130],
                        help="lengths of the packed sequences (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=2, help="q/k heads H (default: %(default)s)")
    parser.add_argument("--v-heads", type=int, default=4, help="value heads HV (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, help="K = V (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds of forward and forward + backward, alternated, after one untimed "
                             "round (medians; recurrent and pypto: one round, no warm-up) (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest max|error| / max|reference| (of the output and of the final state) that "
                             "counts as agreeing; float32 backends are near 1e-6 (default: %(default)s)")
    parser.add_argument("--backends", nargs="+", help=f"default: all available ({', '.join(BACKENDS)})")
    parser.add_argument("--no-pypto", action="store_true", help="skip the PyPTO interpreter row")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    unknown = [name for name in args.backends or () if name not in BACKENDS]
    if unknown:
        parser.error(f"--backends: unknown {unknown}; expected some of {list(BACKENDS)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Run the check; returns the exit status (0: every backend agrees with the reference)."""
    started = time.perf_counter()
    args = parse_args(argv)
    say = lambda text: print(text, flush=True)  # noqa: E731

    want_pypto = "pypto" in BACKENDS and not args.no_pypto and (args.backends is None or "pypto" in args.backends)
    status = pypto_status() if want_pypto else "skipped (--no-pypto)"
    include_pypto = status in ("ready", "needs build")
    targets = available_targets(args.backends, include_pypto)
    say(f"torch_gdr {torch_gdr.__version__}, torch {torch.__version__}: checking {len(targets)} backend(s) "
        f"against the per-token recurrence in float64 (float32 inputs, initial state, q/k l2norm)")
    if "pypto" in BACKENDS and not include_pypto and (args.backends is None or "pypto" in args.backends):
        say(f"  pypto: {status}")
    say("backends on this machine (float32 chunked call):")
    for line in backend_report():
        say(line)

    workloads: dict[str, Workload] = {}

    def workload_for(backend: str) -> Workload:
        name = "pypto" if backend == "pypto" else "default"
        if name not in workloads:
            if name == "pypto":
                workloads[name] = make_workload(name, PYPTO_SEQLENS, 1, 2, PYPTO_HEAD_DIM, PYPTO_CHUNK_SIZE)
            else:
                workloads[name] = make_workload(name, args.seqlens, args.heads, args.v_heads, args.head_dim,
                                                args.chunk_size)
            say(f"  {name} workload: {workloads[name].describe()}")
        return workloads[name]

    rows = []
    for i, (backend, device) in enumerate(targets, 1):
        workload = workload_for(backend)
        if backend == "pypto" and status == "needs build":
            say("  pypto: building the CPU interpreter's calculator library (first run only; 30-45 s on an idle "
                "machine)")
        say(f"[{i}/{len(targets)}] {backend} on {device}: forward, then timing forward and forward + backward ...")
        start = time.perf_counter()
        with heartbeat(say, f"    {backend} on {device}"):  # a row can take minutes on a loaded machine
            row = check_backend(backend, device, workload, 1 if backend in SLOW_BACKENDS else args.repeats,
                                args.tolerance)
        verdict = "ok" if row.ok else (row.note or "FAILED")
        say(f"    {verdict}: max|Δo| / max|o| {row.rel_err_o:.1e}, max|Δstate| / max|state| {row.rel_err_state:.1e} "
            f"({time.perf_counter() - start:.1f} s)")
        rows.append(row)

    say(format_table(rows))
    bad = [r for r in rows if not r.ok]
    elapsed = time.perf_counter() - started
    if bad:
        say(f"FAILED: {', '.join(f'{r.backend} ({r.device})' for r in bad)} did not match the reference "
            f"({elapsed:.0f} s)")
        return 1
    say(f"all {len(rows)} backend(s) agree with the reference within {args.tolerance:.0e} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
