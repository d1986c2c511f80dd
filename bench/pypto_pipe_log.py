"""Per-pipe busy cycles of one vector core from pypto 0.2.0's SIM pipe log.

The stock SIM writes ``CostModelSimulationOutput/_simulate.pipe.swim.json``: a list with
one entry per core (``blockIdx``, ``coreType`` "AIC" or "AIV" and, for cores that ran
tasks, ``pipeLogs``: pipe name -> list of ``{"execStart", "execEnd", "tileOp"}``; the
tile op's text names its opcode second and its task as ``TASK[id]`` or ``Task[id]``).
This reads the vector core that ran the most tasks and divides each pipe's busy cycles
(and each opcode's count and cycles) by ``tasks x units_per_task``, e.g. the (token,
value head) pairs of a decode task: the figure bench/RESULTS.md quotes as "vector cycles
per (token, head)".

Example (after ``bench/pypto_cost_model.py --decode --batch 8 --tokens 4 --out /tmp/cm``;
two value heads a task, four tokens)::

    python bench/pypto_pipe_log.py /tmp/cm --units-per-task 8
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_TASK = re.compile(r"TASK\[(\d+)\]", re.IGNORECASE)


@dataclass
class PipeFigures:
    """One pipe's busy cycles over a core's tasks: ``cycles`` in all, ``per_unit`` divided by
    ``tasks x units_per_task``; ``ops``: opcode -> (count per unit, mean cycles an op)."""

    cycles: int
    per_unit: float
    ops: dict[str, tuple[float, float]] = field(default_factory=dict)


def _tasks(logs: dict[str, list[dict[str, Any]]]) -> set[str]:
    return {m.group(1) for events in logs.values() for e in events if (m := _TASK.search(e["tileOp"]))}


def busiest_vector_core(cores: list[dict[str, Any]]) -> tuple[str, int, dict[str, list[dict[str, Any]]]]:
    """``(blockIdx, tasks, pipeLogs)`` of the AIV core that ran the most tasks (the first of
    equals)."""
    best: tuple[str, int, dict[str, list[dict[str, Any]]]] | None = None
    for core in cores:
        logs = core.get("pipeLogs")
        if core.get("coreType") != "AIV" or not logs:
            continue
        n = len(_tasks(logs))
        if best is None or n > best[1]:
            best = (str(core["blockIdx"]), n, logs)
    if best is None:
        raise ValueError("no vector core with a pipe log")
    return best


def pipe_figures(logs: dict[str, list[dict[str, Any]]], tasks: int, units_per_task: int) -> dict[str, PipeFigures]:
    """Each pipe's :class:`PipeFigures` for a core that ran ``tasks`` tasks."""
    units = max(tasks * units_per_task, 1)
    out = {}
    for pipe, events in logs.items():
        count: Counter[str] = Counter()
        cycles: Counter[str] = Counter()
        for e in events:
            op = e["tileOp"].split()[1]
            count[op] += 1
            cycles[op] += e["execEnd"] - e["execStart"]
        total = sum(cycles.values())
        out[pipe] = PipeFigures(total, total / units, {
            op: (count[op] / units, cycles[op] / count[op]) for op in sorted(cycles, key=lambda o: -cycles[o])})
    return out


def find_pipe_log(root: Path) -> Path:
    """The decode kernel's pipe log under a ``pypto_cost_model.py --out`` folder (its ``decode/``
    part where there is one, never a copy kernel's), or the file itself. Large launches get no
    pipe log from the SIM (H16/HV32 S = 4 B = 64 has none): then FileNotFoundError."""
    if root.is_file():
        return root
    where = root / "decode" if (root / "decode").is_dir() else root
    found = sorted(where.glob("**/_simulate.pipe.swim.json"))
    if not found:
        raise FileNotFoundError(f"no _simulate.pipe.swim.json under {where} (the SIM writes none for large launches)")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="a pypto_cost_model.py --out folder, or a pipe log")
    parser.add_argument("--units-per-task", type=int, default=1,
                        help="units a task runs, e.g. tokens x value heads of a decode body")
    args = parser.parse_args(argv)
    core, tasks, logs = busiest_vector_core(json.loads(find_pipe_log(args.root).read_text()))
    print(f"vector core {core}: {tasks} tasks")
    for pipe, f in pipe_figures(logs, tasks, args.units_per_task).items():
        ops = ", ".join(f"{op} {n:.2f} x {c:.0f}" for op, (n, c) in list(f.ops.items())[:12])
        print(f"{pipe}: {f.cycles} cycles, {f.per_unit:.0f} a unit; {ops}")


if __name__ == "__main__":
    main()
