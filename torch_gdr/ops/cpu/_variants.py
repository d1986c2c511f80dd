"""The instruction-set variants of the C++ kernels: their flags, their sources, which one a CPU runs.

The elementwise loops of the kernels are written to be auto-vectorised (``#pragma omp
simd``), so the instruction set they are compiled for matters; a binary built for a wider
one crashes with an illegal instruction on a CPU without it. What ships is therefore built
for named x86-64 levels (never ``-march=native``), one extension module per level, and the
running CPU picks the widest level it has (:func:`choose`). Other architectures get one
variant with the compiler's default flags.

Standard library only: ``setup.py`` runs this file by path, before torch_gdr (or even torch)
is importable, so that the install-time build and the first-use build (:mod:`._build`)
compile the same sources with the same flags, and report their progress alike
(:func:`progress`). Run as a script (``python torch_gdr/ops/cpu/_variants.py``), it prints
the variant this CPU runs, which the Makefile builds alone (torch's dispatch level is
taken into account where torch is importable, as at run time).
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

#: The translation units of the extension, and the headers they include (under ``csrc/``).
SOURCES: tuple[str, ...] = ("binding.cpp", "forward.cpp", "backward.cpp", "recurrent.cpp", "pool.cpp")
HEADERS: tuple[str, ...] = ("gdr_cpu.h", "common.h", "microgemm.h", "pairdot.h", "token_block.h", "fp8.h")

#: Flags of every variant: optimised, OpenMP, no errno from the math functions (which would
#: keep ``exp`` out of vectorised loops), no debug information in what ships.
COMMON_FLAGS: tuple[str, ...] = ("-O3", "-fopenmp", "-DNDEBUG", "-fno-math-errno", "-g0")
LINK_FLAGS: tuple[str, ...] = ("-fopenmp",)

#: The x86-64 variants, widest first, and the flags that select their instruction set.
#: GCC tunes AVX-512 code to 256-bit vectors unless asked: the kernels' loops gain from 512.
#: ``avx512bf16`` is x86-64-v4 with AVX512-BF16 (AMD Zen 4 and 5, Intel Cooper Lake, and the
#: Intel Xeons with AMX from Sapphire Rapids on, which list avx512_bf16 too and run this
#: variant: no AMX tile code is built): its bfloat16 chunked forward computes the chunk
#: products from bfloat16 operands with ``vdpbf16ps`` (csrc/pairdot.h).
X86_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mprefer-vector-width=512"),
    "avx512": ("-march=x86-64-v4", "-mprefer-vector-width=512"),
    "avx2": ("-march=x86-64-v3",),
    "base": (),
}

# The CPU features (as Linux's /proc/cpuinfo names them) of the x86-64 levels: v2, v3
# (``abm`` is LZCNT), v4; a variant runs only where all of its level's are present.
_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
X86_REQUIRES: dict[str, frozenset[str]] = {
    "avx512bf16": _X86_V4 | {"avx512_bf16"}, "avx512": _X86_V4, "avx2": _X86_V3, "base": frozenset()}

#: torch.backends.cpu.get_cpu_capability()'s answers and the variant each allows at most
#: (torch has no level of its own for AVX512-BF16: its AVX512 allows it)...
_TORCH_CAPABILITY = {"AVX512": "avx512bf16", "AVX2": "avx2"}
#: ... and the variant each proves the CPU runs, where /proc/cpuinfo cannot be read.
_TORCH_IMPLIES = {"AVX512": "avx512", "AVX2": "avx2"}

#: The file, beside the install-time built modules, that records what they were built from.
METADATA_FILE = "_C_build.json"

#: Seconds between two "still compiling" lines of a build (:func:`progress`): a compile of
#: one variant takes minutes on a loaded machine, and a log silent that long looks hung.
HEARTBEAT_SECONDS = 15.0


def is_x86_64(machine: Optional[str] = None) -> bool:
    """Whether ``machine`` (default: this one, ``platform.machine()``) is x86-64."""
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def names(machine: Optional[str] = None) -> tuple[str, ...]:
    """The variants built for ``machine`` (default: this one), widest first."""
    return tuple(X86_FLAGS) if is_x86_64(machine) else ("base",)


def narrower(variant: str, machine: Optional[str] = None) -> tuple[str, ...]:
    """The variants after ``variant`` in :func:`names` (narrower ones, which a CPU that runs
    ``variant`` runs too), widest first."""
    order = names(machine)
    return order[order.index(variant) + 1:] if variant in order else ()


def module_name(variant: str) -> str:
    """The extension module of ``variant``, inside ``torch_gdr.ops.cpu``: ``_C_<variant>``."""
    return f"_C_{variant}"


def compile_flags(variant: str, machine: Optional[str] = None) -> list[str]:
    """The C++ flags of ``variant`` on ``machine`` (default: this one)."""
    if variant not in names(machine):
        raise ValueError(f"variant: expected one of {names(machine)} on this machine, got {variant!r}")
    extra = X86_FLAGS[variant] if is_x86_64(machine) else ()
    return [*COMMON_FLAGS, *extra]


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Optional[frozenset[str]]:
    """The CPU's features as ``cpuinfo`` (Linux) lists them, or None where it cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def choose(cpu_flags: Optional[frozenset[str]], torch_capability: Optional[str],
           machine: Optional[str] = None) -> str:
    """The widest variant this CPU runs.

    Args:
        cpu_flags: the CPU's features as /proc/cpuinfo lists them, or None where unknown.
        torch_capability: ``torch.backends.cpu.get_cpu_capability()`` (``"AVX512"``,
            ``"AVX2"``, ``"DEFAULT"``...), or None. It caps the choice too, so that
            ``ATEN_CPU_CAPABILITY`` lowering torch's own kernels lowers these as well.
        machine: ``platform.machine()`` of the CPU (default: this one).
    """
    if not is_x86_64(machine):
        return "base"
    order = list(X86_FLAGS)  # widest first
    capability = None if torch_capability is None else torch_capability.upper()
    if cpu_flags is None:  # torch's answer alone, for what it proves
        return "base" if capability is None else _TORCH_IMPLIES.get(capability, "base")
    chosen = next(v for v in order if X86_REQUIRES[v] <= cpu_flags)
    if capability is not None:  # the narrower of the two answers
        chosen = max(chosen, _TORCH_CAPABILITY.get(capability, "base"), key=order.index)
    return chosen


def source_hash(source_dir: Path) -> str:
    """A hash of the sources and headers under ``source_dir`` (names and contents).

    Raises:
        FileNotFoundError: one of them is missing.
    """
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0")
        digest.update((source_dir / name).read_bytes())
    return digest.hexdigest()



@contextlib.contextmanager
def heartbeat(say: Callable[[str], None], what: str, interval: Optional[float] = None) -> Iterator[None]:
    """While the body runs, ``say`` "<what>: still running (N s so far)" every ``interval``
    seconds (default :data:`HEARTBEAT_SECONDS`), from a background thread that ends with it."""
    interval = HEARTBEAT_SECONDS if interval is None else interval
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(interval):
            say(f"{what}: still running ({time.monotonic() - start:.0f} s so far)")

    beater = threading.Thread(target=beat, name="torch_gdr-heartbeat", daemon=True)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()


@contextlib.contextmanager
def progress(say: Callable[[str], None], what: str, interval: Optional[float] = None) -> Iterator[None]:
    """Report a long step: ``say`` a line when it starts, one every ``interval`` seconds
    while it runs (:func:`heartbeat`), and one when it ends (with its duration, and whether
    it raised)."""
    start = time.monotonic()
    say(f"{what}: started")
    failed = True
    try:
        with heartbeat(say, what, interval):
            yield
        failed = False
    finally:
        say(f"{what}: {'failed' if failed else 'done'} after {time.monotonic() - start:.0f} s")


def _torch_capability() -> Optional[str]:
    """torch's CPU dispatch level where torch is importable (it caps the variant), else None."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - no torch: the CPU's features alone
        return None
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - an old or unusual torch
        return None


if __name__ == "__main__":
    print(choose(cpu_flags(), _torch_capability()))
