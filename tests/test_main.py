"""``python -m torch_gdr`` (``make run``): a check that fails when a backend is wrong."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

import torch_gdr.dispatch
from torch_gdr.__main__ import main

SMALL = ["--seqlens", "21", "0", "9", "--heads", "1", "--v-heads", "2", "--head-dim", "16", "--chunk-size", "16",
         "--repeats", "1", "--backends", "torch", "recurrent"]


def _broken(o_scale: float = 1.0, state_scale: float = 1.0):
    """The torch backend with its forward op's output and final state scaled."""
    real = torch_gdr.dispatch.BACKENDS["torch"]

    def broken(*args):
        o, final_state, states = real.forward_op(*args)
        return o * o_scale, final_state * state_scale, states

    return dataclasses.replace(real, forward_op=broken)


def test_agreeing_backends_exit_zero(capsys) -> None:
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    assert "[1/2] torch on cpu" in out and "[2/2] recurrent on cpu" in out and "agree with the reference" in out


@pytest.mark.parametrize("scales", [{"o_scale": 1.5}, {"o_scale": 1.001}, {"state_scale": 0.999}])
def test_a_backend_that_disagrees_fails_the_run(monkeypatch, capsys, scales: dict) -> None:
    """Even by 0.1% (the backends agree with the float64 recurrence to about 1e-6)."""
    monkeypatch.setitem(torch_gdr.dispatch.BACKENDS, "torch", _broken(**scales))
    assert main(SMALL) == 1
    out = capsys.readouterr().out
    assert "DISAGREES" in out and "FAILED: torch (cpu)" in out


def test_a_backend_that_raises_fails_the_run(monkeypatch, capsys) -> None:
    def raising(*args):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setitem(torch_gdr.dispatch.BACKENDS, "recurrent",
                        dataclasses.replace(torch_gdr.dispatch.BACKENDS["recurrent"], forward_op=raising))
    assert main(SMALL) == 1
    assert "simulated kernel failure" in capsys.readouterr().out


def test_a_slow_backend_row_is_not_silent(monkeypatch, capsys) -> None:
    """A row that takes minutes (PyPTO's first run under load) prints a line every
    HEARTBEAT_SECONDS while it runs: `make run` is never silent for long."""
    from torch_gdr.ops.cpu import _variants

    real = torch_gdr.dispatch.BACKENDS["recurrent"]

    def slow(*args):
        time.sleep(0.4)
        return real.forward_op(*args)

    monkeypatch.setattr(_variants, "HEARTBEAT_SECONDS", 0.05)
    monkeypatch.setitem(torch_gdr.dispatch.BACKENDS, "recurrent", dataclasses.replace(real, forward_op=slow))
    assert main([*SMALL[:-2], "recurrent"]) == 0
    out = capsys.readouterr().out
    assert out.count("recurrent on cpu: still running") >= 3


def test_python_dash_m_exits_nonzero_with_a_broken_backend() -> None:
    """The real entry point, in a fresh interpreter: the exit status, not only main's value."""
    code = ("import runpy, sys, torch_gdr.dispatch as d; real = d.BACKENDS['torch']; "
            "import dataclasses; d.BACKENDS['torch'] = dataclasses.replace(real, forward_op=lambda *a: "
            "(lambda o, s, c: (o * 1.5, s, c))"
            "(*real.forward_op(*a))); "
            f"sys.argv = ['python -m torch_gdr'] + {SMALL!r}; runpy.run_module('torch_gdr', run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: torch (cpu)" in done.stdout


@pytest.mark.parametrize("argv", [["--backends", "nope"], ["--tolerance"]])
def test_bad_arguments_exit_two(argv: list) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
