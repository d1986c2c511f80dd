"""Import PyPTO lazily and keep every file it writes out of the user's directories.

PyPTO 0.2.0 writes, on each compile, ``./output/output_<ts>_<pid>_<ip>/``
(``TILE_FWK_OUTPUT_DIR``), ``~/.pypto/run/rundata_<ts>/`` (``PYPTO_HOME``) and
``~/ascend/log/...`` (``ASCEND_PROCESS_LOG_PATH``). :func:`import_pypto` points each of the
three that the user has not set into torch_gdr's cache directory *before* the first
``import pypto``, so nothing lands in the working directory or in ``~/.pypto`` / ``~/ascend``;
a variable the user set is honoured and never changed. Per-call outputs (compile folders,
verify dumps) are further confined to temporary directories by :func:`scratch_dir`, the
compile folders only while ``TILE_FWK_OUTPUT_DIR`` is not the user's.

PyPTO's import also configures logging for the whole process (the root logger at DEBUG,
with a stderr handler); :func:`import_pypto` puts the logging configuration back as it was.

The CPU interpreter patches private internals of PyPTO 0.2.0; :func:`import_pypto` checks
the version and that those internals still exist, and fails loudly otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

# re-exported: callers outside ops/cpu and ops/pypto still import the cache directory from here
from torch_gdr._paths import CACHE_DIR_ENV, cache_dir  # noqa: F401

#: The only PyPTO release whose private internals :mod:`.interpreter` knows.
SUPPORTED_PYPTO_VERSION = "0.2.0"

_INSTALL_HINT = (
    "The PyPTO backend of torch_gdr needs pypto=={v}: pip install 'torch_gdr[npu]' "
    "(or pip install pypto=={v})."
).format(v=SUPPORTED_PYPTO_VERSION)

#: (module, attribute) pairs of PyPTO private internals the interpreter relies on.
_REQUIRED_INTERNALS: tuple[tuple[str, str], ...] = (
    ("pypto.frontend.parser.entry", "JitCallableWrapper"),
    ("pypto.runtime", "_pto_verify_datas"),
    ("pypto._utils", "BuildOnlineManager"),
    ("pypto", "pypto_impl"),
)
_REQUIRED_METHODS: tuple[str, ...] = ("_setup_verify_data", "_run_with_cpu", "_execute_kernel")
_REQUIRED_IMPL: tuple[str, ...] = ("SetVerifyData", "DeviceTensorData")

_pypto: ModuleType | None = None


class PyptoUnavailableError(ImportError):
    """PyPTO is missing, of the wrong version, or its internals moved."""


#: The variables through which PyPTO's files are placed, and where torch_gdr puts them
#: (under the cache directory) when the user has not set them.
_PYPTO_DIR_VARS: dict[str, str] = {
    "TILE_FWK_OUTPUT_DIR": "output",  # per-compile output_<ts>_... folders (read at each compile)
    "PYPTO_HOME": "home",  # a run/rundata_<ts> record at every import
    "ASCEND_PROCESS_LOG_PATH": "log",  # the Ascend logs
}

#: The values torch_gdr itself gave those variables: any other value is the user's.
_defaults_set: dict[str, str] = {}


def user_set(var: str) -> bool:
    """Whether the environment variable ``var`` holds a value the user gave it (set before
    torch_gdr gave it a default, or changed since), which torch_gdr must leave alone."""
    value = os.environ.get(var)
    return bool(value) and value != _defaults_set.get(var)


def _redirect_side_effects() -> None:
    """Point PyPTO's output, home and log directories into the cache (read by its C++ side),
    each only where the user has not set it: a variable the user set is left as it is (and
    so are the directories it names)."""
    root = cache_dir() / "pypto"
    for var, sub in _PYPTO_DIR_VARS.items():
        if user_set(var):
            continue
        path = root / sub
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = _defaults_set[var] = str(path)
    if not user_set("PYPTO_HOME"):
        _prune_run_records(Path(os.environ["PYPTO_HOME"]) / "run")


#: How many of PyPTO's per-import ``rundata_<ts>`` records to keep in the cache.
_KEEP_RUN_RECORDS = 8


def _prune_run_records(run_dir: Path) -> None:
    """PyPTO writes a ``rundata_<ts>`` folder at every import; keep only the newest few."""
    if not run_dir.is_dir():
        return
    records = sorted(p for p in run_dir.iterdir() if p.name.startswith("rundata_"))
    for old in records[:-_KEEP_RUN_RECORDS]:
        shutil.rmtree(old, ignore_errors=True)


def _check_internals(pypto: ModuleType) -> None:
    try:
        version: str | None = importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(pypto, "__version__", None)
    if version != SUPPORTED_PYPTO_VERSION:
        raise PyptoUnavailableError(
            f"torch_gdr's PyPTO backend is pinned to pypto=={SUPPORTED_PYPTO_VERSION}, found {version!r}. "
            + _INSTALL_HINT
        )
    missing: list[str] = []
    for mod_name, attr in _REQUIRED_INTERNALS:
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, attr):
            missing.append(f"{mod_name}.{attr}")
    from pypto.frontend.parser.entry import JitCallableWrapper

    probe = JitCallableWrapper.__dict__
    missing += [f"JitCallableWrapper.{m}" for m in _REQUIRED_METHODS if m not in probe]
    missing += [f"pypto_impl.{n}" for n in _REQUIRED_IMPL if not hasattr(pypto.pypto_impl, n)]
    if missing:
        raise PyptoUnavailableError(
            "PyPTO internals that torch_gdr's CPU interpreter patches have moved: "
            + ", ".join(missing)
            + f". Install pypto=={SUPPORTED_PYPTO_VERSION}."
        )


@contextlib.contextmanager
def _logging_left_alone() -> Iterator[None]:
    """Undo, at the end of the block, what PyPTO's import does to the process's logging:
    ``pypto._controller`` calls ``logging.basicConfig(level=logging.DEBUG)``, which, in a
    program that configured no logging, sets the root logger to DEBUG with a stderr handler,
    and every library's debug records (filelock's, ...) reach the terminal. The root logger's
    level and handlers, and the process-wide ``logging.disable`` level, are restored."""
    root = logging.getLogger()
    level, handlers, disabled = root.level, list(root.handlers), logging.root.manager.disable
    try:
        yield
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        for handler in handlers:
            if handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)
        logging.disable(disabled)


def import_pypto() -> ModuleType:
    """Return the ``pypto`` module, importing it on first use with side effects redirected.

    pypto records each import under ``PYPTO_HOME``; if the application imported pypto
    before torch_gdr, that one record went to pypto's default place. Per-call output is
    redirected regardless.

    Raises:
        PyptoUnavailableError: pypto is not installed, is not 0.2.0, or lacks the internals
            the CPU interpreter patches.
    """
    global _pypto
    if _pypto is not None:
        return _pypto
    _redirect_side_effects()
    with _logging_left_alone():
        try:
            pypto = importlib.import_module("pypto")
        except ImportError as exc:  # not installed, or a broken install
            raise PyptoUnavailableError(f"pypto is not importable ({exc}). " + _INSTALL_HINT) from exc
        _check_internals(pypto)
    _pypto = pypto
    return pypto


@torch.compiler.assume_constant_result
def is_pypto_available() -> bool:
    """True when :func:`import_pypto` succeeds (a constant to ``torch.compile``: it imports
    nothing while a graph is traced)."""
    try:
        import_pypto()
    except PyptoUnavailableError:
        return False
    return True


@contextlib.contextmanager
def scratch_dir(prefix: str = "torch_gdr_") -> Iterator[Path]:
    """A temporary directory under the cache, removed on exit (even on error)."""
    base = cache_dir() / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def redirected_output(path: Path) -> Iterator[None]:
    """Send PyPTO's per-compile ``output_<ts>_...`` folder into ``path`` for the block (PyPTO
    reads ``TILE_FWK_OUTPUT_DIR`` at each compile), unless the user set that variable: then
    the folder goes where the user asked and the variable is not touched."""
    var = "TILE_FWK_OUTPUT_DIR"
    if user_set(var):
        yield
        return
    old = os.environ.get(var)
    os.environ[var] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
