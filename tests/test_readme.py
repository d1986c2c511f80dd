"""The README's code: every snippet marked as a complete program runs as it stands.

A fenced ``python`` block whose first line starts with ``# complete program`` is a program a
reader can paste into a file and run; the test does that, in a fresh interpreter in an
empty directory, with one torch thread. A block whose first line names ``torchrun`` runs
under ``python -m torch.distributed.run`` with the process count it names (slow: several
processes import torch). Other blocks are fragments (a signature, an excerpt) and say what
they need.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MARKER = "# complete program"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def complete_snippets() -> list[tuple[str, str]]:
    """``(name, source)`` of the README's complete programs, named by the section above them."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    snippets = []
    for match in _FENCE.finditer(text):
        source = match.group(1)
        if not source.startswith(MARKER):
            continue
        heading = re.findall(r"^#+ (.+)$", text[: match.start()], re.M)
        base = re.sub(r"\W+", "_", heading[-1] if heading else "top").strip("_").lower()
        name = base
        while name in dict(snippets):
            name += "_"
        snippets.append((name, source))
    return snippets


SNIPPETS = complete_snippets()


def test_the_readme_has_complete_programs() -> None:
    """The marker is found (a renamed marker would silently run nothing)."""
    assert len(SNIPPETS) >= 3, [name for name, _ in SNIPPETS]


def _torchrun_processes(source: str) -> int | None:
    first_line = source.splitlines()[0]
    if "torchrun" not in first_line:
        return None
    found = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", first_line)
    assert found, f"a torchrun program names its process count: {first_line}"
    return int(found.group(1))


@pytest.mark.parametrize("name, source", [
    pytest.param(name, source, marks=[pytest.mark.slow] if _torchrun_processes(source) else [], id=name)
    for name, source in SNIPPETS
])
def test_complete_readme_program_runs(tmp_path, name: str, source: str) -> None:
    program = tmp_path / f"{name}.py"
    program.write_text(source, encoding="utf-8")
    processes = _torchrun_processes(source)
    command = [sys.executable, str(program)]
    if processes:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                   str(program)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [p for p in sys.path if p]))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [program.name], "the program left files behind"
