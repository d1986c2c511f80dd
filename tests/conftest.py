"""Test-wide settings and fixtures: one torch thread, no files left in the working directory,
reproducible CI runs, a probe of the backward's recompute pass."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

# One torch thread per test process: the suite's calls are small, and on a loaded 2-core
# machine several threads per op cost far more than they give (OpenMP regions spin). A test
# that needs threads sets them itself, with the ``torch_threads`` fixture.
torch.set_num_threads(1)

# The engines' stand-in packages (bench/run_engine_tests.py puts them on the path of the
# engines' own test files); their modules are not this suite's tests.
collect_ignore = ["engine_standins"]


@pytest.fixture
def torch_threads():
    """``torch_threads(n)`` sets the intra-op thread count for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# `make test` (pytest.ini: -m "not slow") leaves the long cases out: say so when the run
# starts, not only in the summary's last line. Under pytest-xdist (pytest.ini: -n) the
# workers collect and their output is not shown: they hand the count to the controller,
# which says it in the summary.
_deselected_slow: list = []
_said_left_out: list = []


def _left_out_line(count: int) -> str:
    return (f"left out: {count} slow test(s) (-m \"not slow\"); run them with `make test-slow` "
            "or `python -m pytest -m slow`")


def pytest_deselected(items):
    _deselected_slow.extend(item for item in items if item.get_closest_marker("slow") is not None)


def pytest_collection_finish(session):
    # only when the mark expression left them out (not, say, a -k filter in a slow run)
    if not _deselected_slow or "not slow" not in (session.config.getoption("markexpr") or ""):
        return
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its output is not shown
        workeroutput["slow_left_out"] = len(_deselected_slow)
        return
    session.config.get_terminal_writer().line(_left_out_line(len(_deselected_slow)))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    count = getattr(node, "workeroutput", {}).get("slow_left_out")
    if count and not _said_left_out:
        _said_left_out.append(count)


def pytest_terminal_summary(terminalreporter):
    if _said_left_out:
        terminalreporter.write_line(_left_out_line(_said_left_out[0]))


# Hypothesis keeps caches (and by default an example database) in ./.hypothesis: send them
# to a temporary directory removed at exit.
_hypothesis_home = tempfile.mkdtemp(prefix="torch_gdr-hypothesis-")
set_hypothesis_home_dir(_hypothesis_home)
atexit.register(shutil.rmtree, _hypothesis_home, ignore_errors=True)

# No example database. Local runs draw new examples each time, to keep finding cases; CI
# (CI=true) draws the same ones every run, so a red CI always reproduces.
settings.register_profile("torch_gdr", database=None)
settings.register_profile("torch_gdr_ci", database=None, derandomize=True)
settings.load_profile("torch_gdr_ci" if os.environ.get("CI") else "torch_gdr")


# PyPTO writes ./output, ~/.pypto and ~/ascend unless torch_gdr redirects it first (an
# `import pypto` that bypasses torch_gdr.ops.pypto does not), and pytest-benchmark makes
# ./.benchmarks in every session it is loaded in (pytest.ini disables it for the tests).
# Fail the run if any of them appears.
_LITTER = [os.path.join(os.getcwd(), "output"), os.path.join(os.getcwd(), ".benchmarks"),
           os.path.expanduser("~/.pypto"), os.path.expanduser("~/ascend")]
_present_at_start = {path for path in _LITTER if os.path.exists(path)}


def pytest_sessionfinish(session, exitstatus):
    created = [path for path in _LITTER if os.path.exists(path) and path not in _present_at_start]
    if created:
        session.config.get_terminal_writer().line(
            f"tests left files behind: {', '.join(created)} (import pypto through torch_gdr.ops.pypto; "
            "run the tests without the pytest-benchmark plugin)",
            red=True)
        session.exitstatus = 1


@pytest.fixture
def recompute_passes(monkeypatch) -> list:
    """Records, for every pass of a backward over the chunks, whether it recomputed the chunk
    states: the pure-torch backward's load_segment calls (``states_only`` marks the recompute
    pass) and the fused CPU kernels' backward calls (recomputing when given no states)."""
    import torch_gdr.ops.cpu.kernels as cpu_kernels
    import torch_gdr.ops.torch.chunk_backward as chunk_backward

    passes = []
    real_load, real_cpu_bwd = chunk_backward.load_segment, cpu_kernels.chunk_bwd

    def counting_load(*args, **kwargs):
        passes.append(kwargs.get("states_only", False))
        return real_load(*args, **kwargs)

    def counting_cpu_bwd(*args):
        passes.append(args[-1] is None)  # chunk_states: None means a recompute
        return real_cpu_bwd(*args)

    monkeypatch.setattr(chunk_backward, "load_segment", counting_load)
    monkeypatch.setattr(cpu_kernels, "chunk_bwd", counting_cpu_bwd)
    return passes
