"""``python -m torch_gdr``: check every available backend against the reference.

Runs a default workload (packed sequences of uneven length, GVA, an initial state)
through each backend, compares output and final state with the per-token recurrence in
float64, times forward and forward + backward, and prints a table.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from tqdm import tqdm

import torch_gdr
from torch_gdr.dispatch import BACKENDS
from torch_gdr.ops.pypto import is_pypto_available
from torch_gdr.ref import naive_recurrent_gated_delta_rule


@dataclass
class Row:
    backend: str
    device: str
    max_err_o: float = float("nan")
    max_err_state: float = float("nan")
    forward_ms: float = float("nan")
    forward_backward_ms: float = float("nan")
    note: str = ""


def make_workload(seqlens: list[int], num_qk_heads: int, num_v_heads: int, head_dim: int,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Packed float32 inputs with realistic gates (``g = logsigmoid``, ``beta = sigmoid``)."""
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


def _median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def check_backend(backend: str, device: torch.device, workload: dict[str, torch.Tensor],
                  reference: tuple[torch.Tensor, torch.Tensor], chunk_size: int, repeats: int) -> Row:
    """Run one backend on one device; errors against the reference and median timings."""
    row = Row(backend, str(device))
    inputs = {n: t.to(device) for n, t in workload.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size, backend=backend)
    try:
        o, s = torch_gdr.chunk_gated_delta_rule(**inputs, **kwargs)
    except Exception as error:  # noqa: BLE001 - the table reports any failure
        row.note = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
        return row
    row.max_err_o = (o.double().cpu() - reference[0]).abs().max().item()
    row.max_err_state = (s.double().cpu() - reference[1]).abs().max().item()
    row.forward_ms = _median_ms(lambda: torch_gdr.chunk_gated_delta_rule(**inputs, **kwargs), repeats, sync)

    def forward_backward() -> None:
        leaves = {n: (t.detach().requires_grad_() if t.is_floating_point() else t) for n, t in inputs.items()}
        o, s = torch_gdr.chunk_gated_delta_rule(**leaves, **kwargs)
        (o.sum() + s.sum()).backward()

    row.forward_backward_ms = _median_ms(forward_backward, repeats, sync)
    if backend == "pypto" and device.type == "cpu":
        row.note = "PyPTO's interpreter on the CPU (a correctness check; backward is pure torch)"
    return row


def available_targets(backends: Optional[list[str]]) -> list[tuple[str, torch.device]]:
    """(backend, device) pairs to check: every available backend on the CPU (pypto through
    its interpreter, when installed), the pure-torch ones on CUDA too."""
    names = backends or [name for name in BACKENDS if name != "pypto" or is_pypto_available()]
    targets = [(name, torch.device("cpu")) for name in names]
    if torch.cuda.is_available():
        targets += [(name, torch.device("cuda")) for name in names if name in ("torch", "recurrent")]
    return targets


def format_table(rows: list[Row]) -> str:
    header = f"{'backend':<10} {'device':<7} {'max|Δo|':>10} {'max|Δstate|':>12} {'fwd ms':>9} {'fwd+bwd ms':>11}  note"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.backend:<10} {r.device:<7} {r.max_err_o:>10.2e} {r.max_err_state:>12.2e} "
                     f"{r.forward_ms:>9.1f} {r.forward_backward_ms:>11.1f}  {r.note}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_gdr", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[300, 17, 0, 130],
                        help="lengths of the packed sequences (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=2, help="q/k heads H (default: %(default)s)")
    parser.add_argument("--v-heads", type=int, default=4, help="value heads HV (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, help="K = V (default: %(default)s)")
    parser.add_argument("--chunk-size", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), help="default: all available")
    args = parser.parse_args(argv)

    workload = make_workload(args.seqlens, args.heads, args.v_heads, args.head_dim)
    reference = naive_recurrent_gated_delta_rule(
        **{n: t.double() if t.is_floating_point() else t for n, t in workload.items()},
        use_qk_l2norm_in_kernel=True)
    print(f"torch_gdr {torch_gdr.__version__}, torch {torch.__version__}; workload: seqlens {args.seqlens} "
          f"(T = {sum(args.seqlens)}), H = {args.heads}, HV = {args.v_heads}, K = V = {args.head_dim}, "
          f"chunk {args.chunk_size}, float32, initial state, l2norm; reference: recurrence in float64")
    rows = [check_backend(name, device, workload, reference, args.chunk_size, args.repeats)
            for name, device in tqdm(available_targets(args.backends), desc="backends", unit="backend")]
    print(format_table(rows))
    return 1 if any(r.note.startswith("failed") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
