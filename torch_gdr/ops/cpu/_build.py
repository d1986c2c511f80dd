"""Build and load the C++/OpenMP extension at first use, cached across processes.

The extension is compiled by :func:`torch.utils.cpp_extension.load` into
``<cache_dir>/cpu_kernels/<key>/`` (:func:`torch_gdr._paths.cache_dir`: ``$TORCH_GDR_CACHE_DIR`` or
``~/.cache/torch_gdr``), never into the working tree. ``key`` hashes the sources, the torch
version, the compiler (``$CXX``), the compile flags and the CPU's instruction-set flags, so
that a change of any of them builds afresh and an unchanged one is loaded without compiling.

Why ``-march=native`` with the CPU flags in the key: the elementwise loops are written to be
auto-vectorised (``#pragma omp simd``), and the wide vector units are where they win. A
binary built for one CPU may crash with an illegal instruction on another, so the CPU's
flags (``/proc/cpuinfo``) are part of the key: a cache shared by different machines holds
one build per instruction set, each used only where it was built. Where the flags cannot
be read, the build uses the compiler's portable default instead. The GEMMs go to the BLAS
torch links (MKL on x86), which dispatches on the CPU at run time by itself.

Thread- and process-safe: one lock per process around the first load, and
``cpp_extension``'s file baton in the build directory across processes. A failure (no
compiler, no ninja, a compile error) is remembered: :func:`load` returns None from then on
and :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from torch_gdr._paths import cache_dir

_SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("binding.cpp", "forward.cpp", "backward.cpp", "recurrent.cpp")
_HEADERS = ("gdr_cpu.h", "common.h")

_lock = threading.Lock()
_module: Optional[ModuleType] = None
_failure: Optional[str] = None
_tried = False


def _cpu_flags() -> Optional[str]:
    """The instruction-set flags of this CPU (x86 Linux), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        return None
    return None


def compile_flags() -> list[str]:
    """C++ flags of the build: optimised, OpenMP, and tuned to this CPU when its flags are known."""
    flags = ["-O3", "-fopenmp", "-DNDEBUG", "-fno-math-errno"]
    cpu_flags = _cpu_flags()
    if cpu_flags is not None and platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")
        if "avx512f" in cpu_flags.split():
            flags.append("-mprefer-vector-width=512")  # GCC's default for these CPUs is 256
    return flags


def build_key() -> str:
    """A hash of everything the binary depends on (see the module docstring)."""
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update(name.encode())
        digest.update((_SOURCE_DIR / name).read_bytes())
    for part in (torch.__version__, os.environ.get("CXX", "c++"), " ".join(compile_flags()),
                 _cpu_flags() or "portable", platform.machine()):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    return cache_dir() / "cpu_kernels" / build_key()


def load() -> Optional[ModuleType]:
    """The compiled extension, building it on first use; None when it cannot be built."""
    global _module, _failure, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        try:
            from torch.utils import cpp_extension

            key = build_key()
            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            _module = cpp_extension.load(
                name=f"torch_gdr_cpu_{key}",
                sources=[str(_SOURCE_DIR / s) for s in _SOURCES],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any failure means "use the pure-torch path"
            _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
            _module = None
        _tried = True
        return _module


def unavailable_reason() -> Optional[str]:
    """Why the extension is unavailable (after a :func:`load` attempt), or None."""
    return _failure
