"""Find the C++/OpenMP extension: the one built at install time, else one built at first use.

Two places a module can come from:

- **prebuilt**: ``setup.py`` compiles one module per instruction-set variant
  (:mod:`._variants`) into the package, ``torch_gdr/ops/cpu/_C_<variant>.*.so``, and writes
  ``_C_build.json`` beside them: the torch version it compiled against, a hash of the
  sources and the variants it built. A compiled extension is tied to the torch it was built
  against, and an editable checkout's sources may have changed since, so the prebuilt module
  of this CPU's variant is imported only when the running torch and the sources shipped in
  ``csrc/`` match that record.
- **built at first use**: otherwise :func:`torch.utils.cpp_extension.load` compiles the
  same sources with the same flags, this CPU's variant only, into
  ``<cache_dir>/cpu_kernels/<key>/`` (:func:`torch_gdr._paths.cache_dir`:
  ``$TORCH_GDR_CACHE_DIR`` or ``~/.cache/torch_gdr``), never into the working tree. ``key``
  hashes the sources, the torch version, the compiler (``$CXX``), the flags and the variant,
  so a change of any of them builds afresh and an unchanged one loads without compiling.

The GEMMs go to the BLAS torch links (MKL on x86), which dispatches on the CPU by itself.

Thread- and process-safe: one lock per process around the first load, and across processes
an OS file lock (``flock``) on ``build.flock`` in the build directory, which the OS releases
when its holder dies. ``cpp_extension``'s own baton is a file whose existence is the lock: a
build killed midway leaves it behind, and every later process would wait on it forever; under
the OS lock no one else is building, so a baton found there is stale and removed. The outcome is
remembered: :func:`load` returns the same module (or None) from then on, :func:`origin`
says where it came from and :func:`unavailable_reason` why there is none: no working C++
compiler, no ninja, a failed build (its output is in a log file named in the reason), or
sources missing from the installation.

A first-use build that compiles (nothing in the cache yet) takes a minute or more: before it
starts, the process warns once with :class:`CpuKernelBuildWarning` (what is built, why, and
how to build it ahead of time), and while it compiles it prints a line to stderr every
:data:`HEARTBEAT_SECONDS`. Loading an earlier build from the cache says nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional

import torch

from torch_gdr import _decode_memo
from torch_gdr._paths import cache_dir
from torch_gdr.ops.cpu import _variants

_PACKAGE_DIR = Path(__file__).resolve().parent
_SOURCE_DIR = _PACKAGE_DIR / "csrc"
_SOURCES = _variants.SOURCES
_HEADERS = _variants.HEADERS

#: The name of the log a failed first-use build leaves in its build directory.
BUILD_LOG = "build.log"
#: The file of the build directory that processes lock while one of them builds.
BUILD_LOCK = "build.flock"
#: Seconds between two "still running" lines to stderr while a first-use build compiles.
HEARTBEAT_SECONDS = _variants.HEARTBEAT_SECONDS


class CpuKernelBuildWarning(UserWarning):
    """The fused CPU kernels are being compiled at first use (a minute or more, once per
    torch, compiler and sources): no install-time build fits this process. Informational:
    ``TORCH_GDR_STRICT`` does not make it an error; filter it with the ``warnings`` module."""


@dataclasses.dataclass
class _Outcome:
    """What the first :func:`load` found, kept for the life of the process."""

    tried: bool = False
    module: Optional[ModuleType] = None
    origin: Optional[str] = None
    failure: Optional[str] = None


_lock = threading.Lock()
_state = _Outcome()


def _cpu_flags() -> Optional[frozenset[str]]:
    """The instruction-set flags of this CPU (Linux), or None where they cannot be read."""
    return _variants.cpu_flags()


def variant() -> str:
    """The instruction-set variant this CPU runs (``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or ``"base"``):
    the widest whose features /proc/cpuinfo lists, at most what torch itself dispatches to."""
    try:
        capability: Optional[str] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - an old or unusual torch: rely on /proc/cpuinfo alone
        capability = None
    return _variants.choose(_cpu_flags(), capability)


def compile_flags() -> list[str]:
    """C++ flags of the first-use build: those of this CPU's variant, as ``setup.py`` uses."""
    return _variants.compile_flags(variant())


def _compiler() -> list[str]:
    """The C++ compiler ``cpp_extension`` runs, as a command: ``$CXX`` or ``c++``."""
    return shlex.split(os.environ.get("CXX") or "c++") or ["c++"]


def build_key() -> str:
    """A hash of everything the first-use binary depends on (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(_variants.source_hash(_SOURCE_DIR).encode())
    for part in (torch.__version__, " ".join(_compiler()), " ".join(compile_flags()), variant(),
                 platform.machine()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where the first-use build of this torch, compiler and CPU variant lives."""
    return cache_dir() / "cpu_kernels" / build_key()


def _sources_present() -> bool:
    return all((_SOURCE_DIR / name).is_file() for name in _SOURCES + _HEADERS)


def _prebuilt_record() -> Optional[dict[str, Any]]:
    """The install-time build's record (``_C_build.json``), or None when there is none."""
    try:
        return json.loads((_PACKAGE_DIR / _variants.METADATA_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _prebuilt(name: str) -> tuple[Optional[ModuleType], Optional[str]]:
    """The install-time module of variant ``name`` when it was built for the running torch
    from the sources installed here, with None; else None and why it was passed over (None
    when there is simply no install-time build)."""
    record = _prebuilt_record()
    if record is None:
        return None, None
    if name not in record.get("variants", ()):
        return None, f"the install-time build has no {name!r} variant"
    if record.get("torch") != torch.__version__:
        return None, f"the install-time build is for torch {record.get('torch')}, this is {torch.__version__}"
    # sources absent (a wheel stripped of csrc/) cannot have changed since the build
    if _sources_present() and record.get("sources") != _variants.source_hash(_SOURCE_DIR):
        return None, "the sources changed since the install-time build"
    try:
        module = importlib.import_module(f"{__package__}.{_variants.module_name(name)}")
    except ImportError as exc:
        return None, f"the install-time module does not import ({exc})"
    return module, None


def _toolchain_problem() -> Optional[str]:
    """Why a first-use build cannot start here (no sources, compiler or ninja), or None."""
    if not _sources_present():
        missing = [n for n in _SOURCES + _HEADERS if not (_SOURCE_DIR / n).is_file()]
        return (f"the C++ sources are missing from this installation ({_SOURCE_DIR}: no {', '.join(missing)}); "
                "reinstall torch_gdr from a wheel or sdist that ships them")
    command = _compiler()
    if shutil.which(command[0]) is None:
        return f"no working C++ compiler: {command[0]!r} (from $CXX, default c++) was not found"
    try:
        probe = subprocess.run([*command, "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no working C++ compiler: {' '.join(command)} --version failed ({exc})"
    if probe.returncode != 0:
        return f"no working C++ compiler: {' '.join(command)} --version exited with status {probe.returncode}"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (torch's first-use C++ build needs it: pip install ninja)"
    return None


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """Hold the build directory against other processes (see the module docstring); where the
    OS has no ``flock`` (Windows), ``cpp_extension``'s baton alone."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(directory / BUILD_LOCK, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)  # cpp_extension's baton, stale here
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _say(line: str) -> None:
    """A progress line of the first-use build, to stderr."""
    print(f"torch_gdr: {line}", file=sys.stderr, flush=True)


def _announce(directory: Path, passed_over: Optional[str]) -> None:
    """Warn, before a first-use build compiles, what it builds, why and how to prebuild."""
    why = passed_over or ("no install-time build is installed (a wheel built with pip's build isolation "
                          "carries the C++ sources only)")
    warnings.warn(
        f"torch_gdr: compiling the fused CPU kernels (the {variant()!r} variant, for torch {torch.__version__}) "
        f"into {directory}: {why}. This takes a minute or more, once; later processes load the build from "
        "there. To build them ahead of time, install torch_gdr with `pip install --no-build-isolation` into an "
        "environment that has torch and a C++ compiler, or run `python -m torch_gdr --no-pypto` once.",
        CpuKernelBuildWarning, stacklevel=4)


def _build_at_first_use(passed_over: Optional[str] = None) -> tuple[Optional[ModuleType], Optional[str]]:
    """Build (or load the earlier build of) this CPU's variant in the cache: the module, or
    None and the reason. ``passed_over``: why no install-time module was taken, if one was
    there (the warning before a build says it)."""
    problem = _toolchain_problem()
    if problem is not None:
        return None, problem
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / BUILD_LOG
    name = f"torch_gdr_cpu_{directory.name}"
    # an earlier build in the cache loads in a moment: only a build that compiles is announced
    compiles = not any((directory / f"{name}{suffix}").is_file() for suffix in (".so", ".pyd"))
    if compiles:
        _announce(directory, passed_over)
    reporting = _variants.progress(_say, f"compiling the fused CPU kernels ({variant()!r} variant) into {directory}",
                                   HEARTBEAT_SECONDS) if compiles else contextlib.nullcontext()
    try:
        with reporting, _exclusive(directory):  # lines while it waits on another process too
            module = cpp_extension.load(
                name=name,
                sources=[str(_SOURCE_DIR / s) for s in _SOURCES],
                extra_cflags=compile_flags(),
                extra_ldflags=list(_variants.LINK_FLAGS),
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any failure means "no kernels", and says why
        detail = str(exc).strip() or repr(exc)
        try:
            log.write_text(f"{type(exc).__name__}: {detail}\n", encoding="utf-8")
        except OSError:
            return None, f"the C++ build failed ({type(exc).__name__}: {detail.splitlines()[-1]})"
        return None, f"the C++ build failed; the compiler's output is in {log}"
    return module, None


def load() -> Optional[ModuleType]:
    """The extension of this CPU's variant: the install-time one where it fits, else built
    in the cache on first use, else the install-time module of the widest narrower variant
    the CPU runs; None when none is possible (see :func:`unavailable_reason`)."""
    if _state.tried:
        return _state.module
    with _lock:
        if _state.tried:
            return _state.module
        chosen = variant()
        module, passed_over = _prebuilt(chosen)
        if module is not None:
            _state.module, _state.origin = module, "prebuilt"
        else:
            module, failure = _build_at_first_use(passed_over)
            if module is not None:
                _state.module, _state.origin = module, f"built at first use into {build_dir()}"
            else:
                _state.failure = failure if passed_over is None else f"{failure} ({passed_over})"
                # e.g. a wheel whose compiler could not build avx512bf16, on a CPU that runs it:
                # the install-time avx512 module rather than none
                for narrower in _variants.narrower(chosen):
                    module, _ = _prebuilt(narrower)
                    if module is not None:
                        _state.module, _state.failure = module, None
                        _state.origin = f"prebuilt, the {narrower!r} variant ({chosen!r}: {failure})"
                        break
        _state.tried = True
        if _state.module is not None:  # the decode memo's key in C++ (an older module may lack it)
            _decode_memo.use_native_signature(getattr(_state.module, "decode_signature", None))
        return _state.module


def unavailable_reason() -> Optional[str]:
    """Why the extension is unavailable (after a :func:`load` attempt), or None."""
    return _state.failure


def origin() -> Optional[str]:
    """Where the loaded extension came from: ``"prebuilt"`` (built at install time),
    ``"built at first use into <dir>"``, or None (none loaded, or :func:`load` not called)."""
    return _state.origin
