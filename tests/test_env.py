"""Environment variables: torch_gdr reads them as a user would write them, and never
overwrites what the user set."""

from __future__ import annotations

import pytest
import torch

from torch_gdr.dispatch import resolve_backend


@pytest.mark.parametrize("value, backend", [(" Recurrent ", "recurrent"), ("TORCH\n", "torch"), ("  ", "cpu")])
def test_backend_variable_is_stripped_and_lower_cased(monkeypatch, value: str, backend: str) -> None:
    """Like TORCH_GDR_STRICT; blank means unset (the device's default, "cpu" on the CPU)."""
    monkeypatch.setenv("TORCH_GDR_BACKEND", value)
    assert resolve_backend(None, torch.device("cpu")) == backend


def test_unknown_backend_variable_still_raises(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_GDR_BACKEND", " nope ")
    with pytest.raises(ValueError, match="TORCH_GDR_BACKEND"):
        resolve_backend(None, torch.device("cpu"))


# --- PyPTO's directories (torch_gdr/ops/pypto/_env.py) ---------------------------------

_PYPTO_VARS = ("TILE_FWK_OUTPUT_DIR", "PYPTO_HOME", "ASCEND_PROCESS_LOG_PATH")


@pytest.fixture
def pypto_env(monkeypatch, tmp_path):
    """A fresh view of the environment for ``_env``: a cache directory under tmp_path, none of
    PyPTO's variables set, no defaults recorded; everything restored afterwards."""
    from torch_gdr.ops.pypto import _env

    monkeypatch.setenv("TORCH_GDR_CACHE_DIR", str(tmp_path / "cache"))
    for var in _PYPTO_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_env, "_defaults_set", {}, raising=False)
    return _env


def test_pypto_variables_the_user_set_are_kept(pypto_env, monkeypatch, tmp_path) -> None:
    """Set ones stay as they are (and their records are not pruned); unset ones get the cache."""
    user_home = tmp_path / "my_pypto_home"
    for i in range(12):
        (user_home / "run" / f"rundata_{i:02d}").mkdir(parents=True)
    monkeypatch.setenv("PYPTO_HOME", str(user_home))
    monkeypatch.setenv("ASCEND_PROCESS_LOG_PATH", str(tmp_path / "my_logs"))
    pypto_env._redirect_side_effects()
    import os

    assert os.environ["PYPTO_HOME"] == str(user_home)
    assert os.environ["ASCEND_PROCESS_LOG_PATH"] == str(tmp_path / "my_logs")
    assert os.environ["TILE_FWK_OUTPUT_DIR"] == str(tmp_path / "cache" / "pypto" / "output")
    assert len(list((user_home / "run").iterdir())) == 12
    assert not (tmp_path / "my_logs").exists()  # not even created


def test_unset_pypto_variables_go_to_the_cache(pypto_env, tmp_path) -> None:
    import os

    pypto_env._redirect_side_effects()
    for var, sub in (("TILE_FWK_OUTPUT_DIR", "output"), ("PYPTO_HOME", "home"), ("ASCEND_PROCESS_LOG_PATH", "log")):
        assert os.environ[var] == str(tmp_path / "cache" / "pypto" / sub)
        assert not pypto_env.user_set(var)


@pytest.mark.parametrize("user_value", [None, "mine"])
def test_per_call_output_redirect_leaves_a_user_value_alone(pypto_env, monkeypatch, tmp_path, user_value) -> None:
    """Per compile, PyPTO's output folder goes to the call's scratch directory, unless the
    user chose TILE_FWK_OUTPUT_DIR (before or after torch_gdr set its default)."""
    import os

    pypto_env._redirect_side_effects()
    default = os.environ["TILE_FWK_OUTPUT_DIR"]
    if user_value is not None:
        monkeypatch.setenv("TILE_FWK_OUTPUT_DIR", str(tmp_path / user_value))
    before = os.environ["TILE_FWK_OUTPUT_DIR"]
    with pypto_env.redirected_output(tmp_path / "scratch"):
        inside = os.environ["TILE_FWK_OUTPUT_DIR"]
    assert os.environ["TILE_FWK_OUTPUT_DIR"] == before
    assert inside == (str(tmp_path / "scratch") if user_value is None else str(tmp_path / user_value))
    assert before == (default if user_value is None else str(tmp_path / user_value))


_PYPTO_CALL = """
import os, torch, torch.nn.functional as F, torch_gdr
torch.manual_seed(0)
q, k, v = (torch.randn(1, 16, 1, 64) for _ in range(3))
g, beta = F.logsigmoid(torch.randn(1, 16, 1)), torch.rand(1, 16, 1)
o, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, chunk_size=32,
                                        backend="pypto")
want, _ = torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="recurrent")
assert (o - want).abs().max() < 1e-4
print({var: os.environ.get(var) for var in ("TILE_FWK_OUTPUT_DIR", "PYPTO_HOME", "ASCEND_PROCESS_LOG_PATH")})
"""


def test_pypto_call_honours_the_users_directories_and_litters_nothing(tmp_path) -> None:
    """A real PyPTO (interpreter) call in a fresh process with all three variables set: they
    are unchanged afterwards, PyPTO wrote where they point, and nothing went to the working
    directory."""
    import ast
    import os
    import subprocess
    import sys

    from torch_gdr.ops.pypto import is_pypto_available

    if not is_pypto_available():
        pytest.skip("pypto==0.2.0 (the npu extra) is not installed")
    user = {"TILE_FWK_OUTPUT_DIR": str(tmp_path / "out"), "PYPTO_HOME": str(tmp_path / "home"),
            "ASCEND_PROCESS_LOG_PATH": str(tmp_path / "log")}
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = dict(os.environ, **user, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", _PYPTO_CALL], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ast.literal_eval(done.stdout.strip().splitlines()[-1]) == user
    assert list(cwd.iterdir()) == []
    assert any(p.name.startswith("output_") for p in (tmp_path / "out").iterdir())
    assert any(p.name.startswith("rundata_") for p in (tmp_path / "home" / "run").iterdir())


_PYPTO_CALL_LOGGING = """
import logging, torch, torch.nn.functional as F, torch_gdr
root = logging.getLogger()
before = (root.level, list(root.handlers))
torch.manual_seed(0)
q, k, v = (torch.randn(1, 16, 1, 64) for _ in range(3))
g, beta = F.logsigmoid(torch.randn(1, 16, 1)), torch.rand(1, 16, 1)
torch_gdr.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=32, backend="pypto")
after = (root.level, list(root.handlers))
assert after == before, (before, after)
logging.getLogger("filelock").debug("a debug record nobody asked to see")
logging.getLogger("some.library").info("an info record nobody asked to see")
"""


def test_a_pypto_call_leaves_the_users_logging_alone(tmp_path) -> None:
    """PyPTO's import calls ``logging.basicConfig(level=DEBUG)``: in a process that configured
    no logging, a ``backend="pypto"`` call must leave the root logger's level and handlers as
    they were, so that libraries' debug records (filelock's, ...) do not reach stderr."""
    import os
    import subprocess
    import sys

    from torch_gdr.ops.pypto import is_pypto_available

    if not is_pypto_available():
        pytest.skip("pypto==0.2.0 (the npu extra) is not installed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", _PYPTO_CALL_LOGGING], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "nobody asked to see" not in done.stderr, done.stderr[-3000:]
