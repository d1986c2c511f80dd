"""The examples run end to end (short settings), generation with the cache matches re-running, and
the README's layer snippet runs as written."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in sys.path if p]))
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_train_tiny_runs_with_a_progress_bar() -> None:
    done = run_example("examples/train_tiny.py", "--steps", "3", "--seqs-per-batch", "4")
    assert "loss: first step" in done.stdout
    assert "training" in done.stderr and "3/3" in done.stderr, done.stderr  # tqdm's bar, on stderr


def test_generate_with_cache_matches_rerun() -> None:
    out = run_example("examples/generate_with_cache.py", "--new-tokens", "3", "--prompt-len", "64", "--hidden", "64",
                      "--heads", "2", "--v-heads", "4", "--head-dim", "16", "--vocab", "128").stdout
    diff = float(out.split("max |logits diff| = ")[1].split()[0])
    assert diff < 1e-4, out


def readme_python_block(containing: str) -> str:
    """The README's python code block that contains ``containing``."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    matches = [block for block in blocks if containing in block]
    assert len(matches) == 1, f"{len(matches)} README python blocks contain {containing!r}"
    return matches[0]


def test_readme_layer_snippet_runs_as_written() -> None:
    namespace: dict = {}
    exec(compile(readme_python_block("GatedDeltaNetCache()"), "README.md", "exec"), namespace)
    assert namespace["y"].shape == (2, 100, 512) and namespace["y_next"].shape == (2, 1, 512)
