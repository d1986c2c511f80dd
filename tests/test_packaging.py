"""The C++ kernels as installed: a wheel carries them prebuilt (and their sources), the
running CPU picks a portable variant, and where no module can be had the reason says why
(no compiler, a failed build with its log, sources missing)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import torch_gdr
from torch_gdr.ops.cpu import _build, _variants

REPO = Path(torch_gdr.__file__).resolve().parent.parent
FP32_BOUND = 2e-6  # rmse ratio of a float32 kernel against the float64 recurrence

# --- choosing a variant ---------------------------------------------------------------------

# the features of the x86-64 levels, written out from the psABI's table (not from _variants)
_V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "sse", "sse2"}
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@pytest.mark.parametrize("flags, capability, expected", [
    (_V4, "AVX512", "avx512"),
    (_V3, "AVX2", "avx2"),
    (_V4 - {"avx512cd"}, "AVX512", "avx2"),  # short of one feature: the level below
    (_V3 - {"bmi2"}, "AVX2", "base"),  # AVX2 without the rest of x86-64-v3
    (_V2, "DEFAULT", "base"),
    (_V4, "AVX2", "avx2"),  # torch's own dispatch lowered (ATEN_CPU_CAPABILITY) lowers ours
    (_V3, "AVX512", "avx2"),  # and never raises it past what the CPU lists
    (None, "AVX512", "avx512"),  # no /proc/cpuinfo: torch's answer alone
    (None, None, "base"),
])
def test_the_widest_variant_the_cpu_has_is_chosen(flags, capability, expected) -> None:
    chosen = _variants.choose(None if flags is None else frozenset(flags), capability, machine="x86_64")
    assert chosen == expected


# CPUs as their /proc/cpuinfo lists them (the features that matter here, written out by
# hand): the variant each runs, and what torch's dispatch level (ATEN_CPU_CAPABILITY) does to it.
_ZEN3 = _V3 | {"sse4a", "sha_ni", "vaes", "vpclmulqdq"}  # AVX2, no AVX-512
_ZEN4 = _V4 | {"avx512_bf16", "avx512_vnni", "avx512_bitalg", "avx512vbmi", "gfni"}  # Zen 4 and 5
_SKYLAKE_X = _V4 | {"avx512_vnni"}  # AVX-512 without BF16 (Skylake-X, Cascade Lake, Ice Lake)
_SAPPHIRE_RAPIDS = _V4 | {"avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"}
_OLD_SSE = {"fpu", "sse", "sse2", "pni"}  # an x86-64 of 2005: SSE3, nothing of x86-64-v2


@pytest.mark.parametrize("flags, capability, machine, expected", [
    (_ZEN3, "AVX2", "x86_64", "avx2"),
    (_ZEN4, "AVX512", "x86_64", "avx512bf16"),
    (_SAPPHIRE_RAPIDS, "AVX512", "x86_64", "avx512bf16"),  # AMX CPUs list avx512_bf16: no tile variant
    (_SKYLAKE_X, "AVX512", "x86_64", "avx512"),
    (_OLD_SSE, "DEFAULT", "x86_64", "base"),
    (_ZEN4 - {"avx512bw"}, "AVX512", "x86_64", "avx2"),  # BF16 without the rest of x86-64-v4
    (_ZEN4, "AVX2", "x86_64", "avx2"),  # ATEN_CPU_CAPABILITY=avx2 caps an avx512_bf16 CPU
    (_SAPPHIRE_RAPIDS, "AVX2", "x86_64", "avx2"),
    (_ZEN4, "DEFAULT", "x86_64", "base"),
    (_ZEN3, "AVX512", "x86_64", "avx2"),  # torch's level never raises past the CPU's features
    (None, "AVX512", "x86_64", "avx512"),  # torch's AVX512 alone does not prove AVX512-BF16
    (frozenset({"fp", "asimd", "bf16", "sve"}), "DEFAULT", "aarch64", "base"),  # not x86
    (_ZEN4, "AVX512", "aarch64", "base"),
], ids=["zen3", "zen4_zen5", "sapphire_rapids_amx", "skylake_x", "old_sse", "bf16_without_v4", "zen4_capped_avx2",
        "amx_capped_avx2", "zen4_capped_default", "zen3_torch_avx512", "no_cpuinfo", "arm", "arm_with_x86_flags"])
def test_each_cpu_runs_its_variant(flags, capability, machine, expected) -> None:
    chosen = _variants.choose(None if flags is None else frozenset(flags), capability, machine=machine)
    assert chosen == expected
    if flags is not None and chosen != "base":  # what the chosen variant is built for, the CPU has
        assert _variants.X86_REQUIRES[chosen] <= frozenset(flags)


def test_the_bf16_variant_is_built_for_the_bf16_unit() -> None:
    flags = _variants.compile_flags("avx512bf16", "x86_64")
    assert "-march=x86-64-v4" in flags and "-mavx512bf16" in flags
    assert _variants.names("x86_64")[0] == "avx512bf16"  # widest first: tried first
    assert "-mavx512bf16" not in _variants.compile_flags("avx512", "x86_64")


def test_other_architectures_build_and_choose_the_default_flags_only() -> None:
    assert _variants.names("aarch64") == ("base",)
    assert _variants.choose(frozenset(_V4), "AVX512", machine="aarch64") == "base"
    assert not any(f.startswith("-march") for f in _variants.compile_flags("base", "aarch64"))
    with pytest.raises(ValueError, match="variant"):
        _variants.compile_flags("avx2", "aarch64")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_no_variant_is_built_for_the_build_machine_only(machine) -> None:
    for name in _variants.names(machine):
        flags = _variants.compile_flags(name, machine)
        assert "-march=native" not in flags and "-mcpu=native" not in flags and "-mtune=native" not in flags


def test_this_cpu_runs_the_variant_it_is_given() -> None:
    """The chosen variant's level is one /proc/cpuinfo lists in full (where it can be read)."""
    flags = _build._cpu_flags()
    if flags is None or not _variants.is_x86_64():
        pytest.skip("needs an x86-64 Linux CPU")
    assert _variants.X86_REQUIRES[_build.variant()] <= flags


# --- why there is no module -----------------------------------------------------------------

@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """``_build`` as in a new process with no install-time modules and an empty cache (the
    remembered outcome of this process is restored afterwards)."""
    monkeypatch.setenv("TORCH_GDR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_state", _build._Outcome())
    monkeypatch.setattr(_build, "_prebuilt", lambda name: (None, None))
    return _build


def _built_files(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.suffix in (".so", ".o", ".pyd")] if cache.exists() else []


@pytest.mark.parametrize("compiler", ["/bin/false", "no-such-compiler-anywhere"])
def test_without_a_compiler_the_reason_says_so(fresh_build, monkeypatch, tmp_path, compiler) -> None:
    monkeypatch.setenv("CXX", compiler)
    assert fresh_build.load() is None
    reason = fresh_build.unavailable_reason()
    assert reason is not None and "no working C++ compiler" in reason and compiler in reason
    assert fresh_build.origin() is None
    assert fresh_build.load() is None and fresh_build.unavailable_reason() == reason  # remembered
    assert not _built_files(tmp_path / "cache")


def test_without_sources_the_reason_says_so(fresh_build, monkeypatch, tmp_path) -> None:
    """An installation without csrc/ (a wheel built without its package data)."""
    empty = tmp_path / "csrc"
    empty.mkdir()
    monkeypatch.setattr(fresh_build, "_SOURCE_DIR", empty)
    assert fresh_build.load() is None
    reason = fresh_build.unavailable_reason()
    assert reason is not None and "sources are missing" in reason and str(empty) in reason
    assert not _built_files(tmp_path / "cache")


_FAILING_COMPILER = """#!/bin/sh
# answers --version like a compiler, and refuses to compile anything
case "$1" in --version|-v|-dumpfullversion|-dumpversion) echo "12.2.0"; exit 0;; esac
echo "deliberately refusing to compile: $*" >&2
exit 1
"""


@pytest.fixture
def refusing_compiler(monkeypatch, tmp_path) -> Path:
    """``$CXX`` set to a compiler that answers ``--version`` and refuses to compile (a
    first-use build then fails at once, in ninja's first step)."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("the first-use build needs ninja")
    compiler = tmp_path / "refusing-c++"
    compiler.write_text(_FAILING_COMPILER)
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    return compiler


def test_a_failed_build_leaves_its_log_and_names_it(fresh_build, refusing_compiler, tmp_path) -> None:
    with pytest.warns(torch_gdr.CpuKernelBuildWarning):  # said before it compiles, failing or not
        assert fresh_build.load() is None
    reason = fresh_build.unavailable_reason()
    assert reason is not None and "build failed" in reason
    log = fresh_build.build_dir() / _build.BUILD_LOG
    assert str(log) in reason and str(tmp_path / "cache") in str(log)
    assert "deliberately refusing to compile" in log.read_text()
    assert not _built_files(tmp_path / "cache")


@pytest.mark.filterwarnings("ignore::torch_gdr.CpuKernelBuildWarning")
def test_a_cpu_whose_variant_neither_shipped_nor_builds_runs_the_next_one_shipped(
        fresh_build, refusing_compiler, monkeypatch) -> None:
    """A wheel whose compiler could not build avx512bf16 (old compilers lack -mavx512bf16),
    on a CPU that runs it, without a working compiler: the shipped avx512 module, not none."""
    shipped = object()
    monkeypatch.setattr(fresh_build, "variant", lambda: "avx512bf16")
    monkeypatch.setattr(fresh_build, "_prebuilt", lambda name: (shipped, None) if name == "avx512" else (None, None))
    with pytest.warns(torch_gdr.CpuKernelBuildWarning):
        assert fresh_build.load() is shipped
    assert fresh_build.unavailable_reason() is None
    assert fresh_build.origin().startswith("prebuilt, the 'avx512' variant ('avx512bf16': the C++ build failed")
    assert _variants.narrower("avx512bf16", "x86_64") == ("avx512", "avx2", "base")


def test_a_baton_left_by_a_killed_build_does_not_hang_the_next(fresh_build, refusing_compiler) -> None:
    """cpp_extension's baton (a file named ``lock`` whose existence is the lock) outlives a
    build killed midway; the next first-use build goes ahead rather than wait on it forever."""
    directory = fresh_build.build_dir()
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # the killed build's baton
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(fresh_build.load()), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the build waited on the stale baton"
    assert outcome == [None] and "build failed" in fresh_build.unavailable_reason()


# --- saying so before a first-use build compiles --------------------------------------------

@pytest.fixture
def compiling(fresh_build, monkeypatch):
    """A first-use build that takes a moment, as a compile does, and leaves its module in the
    build directory, without running a compiler: it yields this CPU's install-time module.
    The calls it gets are recorded in the returned list."""
    try:
        module = importlib.import_module(f"torch_gdr.ops.cpu._C_{_build.variant()}")
    except ImportError:
        pytest.skip("needs this CPU's install-time module (make run builds it)")
    from torch.utils import cpp_extension

    calls: list[dict] = []

    def slow_load(**kwargs):
        calls.append(kwargs)
        time.sleep(0.4)
        Path(kwargs["build_directory"], f"{kwargs['name']}.so").touch()
        return module

    monkeypatch.setattr(fresh_build, "_toolchain_problem", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", slow_load)
    monkeypatch.setattr(fresh_build, "HEARTBEAT_SECONDS", 0.05)
    return calls


def _first_calls(threads: int) -> tuple[list, list[warnings.WarningMessage]]:
    """``threads`` concurrent first calls of the public forward on CPU float32 tensors; their
    errors against the float64 recurrence and every warning they raised."""
    from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule
    from torch_gdr.testing import make_inputs, rmse_ratio

    x = make_inputs(seq_len=40, num_qk_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=8, dtype=torch.float32,
                    normalize_qk=True, seed=5)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    expected, _ = naive_recurrent_gated_delta_rule(*(t.double() for t in args))
    errors: list = []
    start = threading.Barrier(threads)

    def first_call() -> None:
        start.wait()
        o, _ = torch_gdr.chunk_gated_delta_rule(*args)
        errors.append(rmse_ratio(expected, o))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workers = [threading.Thread(target=first_call) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
    return errors, list(caught)


def test_a_first_use_build_warns_once_before_it_compiles_even_in_strict_mode(
        fresh_build, compiling, monkeypatch, capfd, tmp_path) -> None:
    monkeypatch.setenv("TORCH_GDR_STRICT", "1")  # a note, not a fallback: no error
    passed_over = "the install-time build is for torch 0.0.1, this is another"
    monkeypatch.setattr(fresh_build, "_prebuilt", lambda name: (None, passed_over))
    errors, caught = _first_calls(threads=2)
    assert len(errors) == 2 and all(e < FP32_BOUND for e in errors)
    assert len(compiling) == 1
    builds = [w for w in caught if issubclass(w.category, torch_gdr.CpuKernelBuildWarning)]
    assert len(builds) == 1, [str(w.message) for w in caught]
    assert issubclass(torch_gdr.CpuKernelBuildWarning, UserWarning)
    message = str(builds[0].message)
    # what (the variant, where), why (the install-time build passed over), how to prebuild
    assert repr(_build.variant()) in message and str(tmp_path / "cache") in message
    assert passed_over in message and "--no-build-isolation" in message
    assert fresh_build.origin().startswith("built at first use")
    # progress while it compiled: a start, lines every HEARTBEAT_SECONDS, an end
    err = capfd.readouterr().err
    assert "compiling the fused CPU kernels" in err and err.count("still running") >= 2 and "done after" in err


def test_a_build_found_in_the_cache_loads_without_a_word(fresh_build, compiling, capfd) -> None:
    directory = fresh_build.build_dir()
    directory.mkdir(parents=True)
    (directory / f"torch_gdr_cpu_{directory.name}.so").touch()  # an earlier process built it
    errors, caught = _first_calls(threads=1)
    assert errors and errors[0] < FP32_BOUND and len(compiling) == 1
    assert not [w for w in caught if issubclass(w.category, torch_gdr.CpuKernelBuildWarning)]
    assert "compiling" not in capfd.readouterr().err


def test_a_long_step_reports_while_it_runs_and_stops_after() -> None:
    lines: list[str] = []
    with _variants.progress(lines.append, "step", interval=0.03):
        time.sleep(0.2)
    assert lines[0] == "step: started" and lines[-1].startswith("step: done after")
    assert sum("still running" in line for line in lines) >= 3
    count = len(lines)
    time.sleep(0.1)
    assert len(lines) == count  # the heartbeat ended with the step
    with pytest.raises(KeyError), _variants.progress(lines.append, "bad", interval=10):
        raise KeyError("x")
    assert lines[-1].startswith("bad: failed after")


# --- make run: the install says what it does, and builds this CPU's variant ------------------

_FAKE_VENV_PYTHON = """#!{python}
# the venv's python as the Makefile calls it: scripts run for real, pip calls are recorded
import json, os, subprocess, sys
if sys.argv[1:3] != ["-m", "pip"]:
    sys.exit(subprocess.call([{python!r}, *sys.argv[1:]]))
with open({log!r}, "a", encoding="utf-8") as f:
    f.write(json.dumps({{"args": sys.argv[3:], "variants": os.environ.get("TORCH_GDR_CPU_VARIANTS")}}) + "\\n")
"""


def _make_install(tmp_path: Path, name: str) -> list[dict]:
    """``make`` of the install step with a venv whose python records its pip calls."""
    venv, log = tmp_path / name, tmp_path / f"{name}.jsonl"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(_FAKE_VENV_PYTHON.format(python=sys.executable, log=str(log)))
    python.chmod(0o755)
    done = subprocess.run(["make", "-C", str(REPO), f"VENV={venv}", f"{venv}/.installed"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


def test_make_installs_this_cpus_variant_and_shows_what_pip_does(tmp_path, monkeypatch) -> None:
    if shutil.which("make") is None or not (REPO / "Makefile").is_file():
        pytest.skip("needs make and the project's source tree")
    monkeypatch.delenv("TORCH_GDR_CPU_VARIANTS", raising=False)
    calls = _make_install(tmp_path, "venv")
    assert len(calls) == 2 and all("install" in c["args"] for c in calls)
    for call in calls:  # pip's progress shown: never quiet
        assert not any(a in ("-q", "--quiet") or (a.startswith("-q") and set(a[1:]) == {"q"}) for a in call["args"])
    editable = calls[-1]
    assert "-e" in editable["args"] and "-v" in editable["args"]  # -v: setup.py's build lines shown
    assert editable["variants"] == _build.variant()  # only the variant this CPU runs
    monkeypatch.setenv("TORCH_GDR_CPU_VARIANTS", "")  # a choice already made is kept
    assert _make_install(tmp_path, "venv2")[-1]["variants"] == ""


# --- whether an install-time module fits ----------------------------------------------------

def _record(**changes) -> dict:
    record = {"torch": torch.__version__, "sources": _variants.source_hash(_build._SOURCE_DIR),
              "variants": list(_variants.names())}
    record.update(changes)
    return record


@pytest.mark.parametrize("changes, why", [
    ({"torch": "2.0.0"}, "for torch 2.0.0"),
    ({"sources": "0" * 64}, "sources changed"),
    ({"variants": []}, "no "),
])
def test_an_install_time_module_for_another_torch_or_other_sources_is_passed_over(monkeypatch, changes, why) -> None:
    imported = []
    monkeypatch.setattr(_build, "_prebuilt_record", lambda: _record(**changes))
    monkeypatch.setattr(_build.importlib, "import_module", lambda name: imported.append(name))
    module, passed_over = _build._prebuilt(_build.variant())
    assert module is None and passed_over is not None and why in passed_over
    assert not imported  # not even loaded: a module for another torch may not load cleanly


def test_a_matching_install_time_module_is_imported(monkeypatch) -> None:
    sentinel = object()
    monkeypatch.setattr(_build, "_prebuilt_record", lambda: _record())
    monkeypatch.setattr(_build.importlib, "import_module",
                        lambda name: sentinel if name == f"torch_gdr.ops.cpu._C_{_build.variant()}" else None)
    assert _build._prebuilt(_build.variant()) == (sentinel, None)


# --- a wheel, installed -----------------------------------------------------------------------

_RUN_FROM_THE_INSTALL = textwrap.dedent("""
    import json, torch
    import torch_gdr
    from torch_gdr.ops.cpu import _build
    from torch_gdr.ref.naive import naive_recurrent_gated_delta_rule
    from torch_gdr.testing import make_inputs, rmse_ratio
    x = make_inputs(seq_len=70, num_qk_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, dtype=torch.float32,
                    with_initial_state=True, normalize_qk=True, seed=3)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, s = torch_gdr.chunk_gated_delta_rule(*args, initial_state=x["initial_state"], output_final_state=True)
    ro, rs = naive_recurrent_gated_delta_rule(*(t.double() for t in args), initial_state=x["initial_state"].double(),
                                              output_final_state=True)
    print(json.dumps({"package": torch_gdr.__file__, "origin": _build.origin(), "variant": _build.variant(),
                      "module": getattr(_build.load(), "__file__", None), "reason": _build.unavailable_reason(),
                      "o_err": rmse_ratio(ro, o), "s_err": rmse_ratio(rs, s)}))
""")


def _source_copy(destination: Path) -> Path:
    """The project's files a wheel is built from, without what a local build left beside them."""
    destination.mkdir()
    for name in ("setup.py", "MANIFEST.in", "README.md", "requirements-dev.txt"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, destination / name)
    shutil.copytree(REPO / "torch_gdr", destination / "torch_gdr",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", _variants.METADATA_FILE))
    return destination


# answers --version and compiles setup.py's probe, then refuses to compile the kernels
_KERNEL_REFUSING_COMPILER = """#!/bin/sh
case "$1" in --version|-v|-dumpfullversion|-dumpversion) echo "12.2.0"; exit 0;; esac
for arg in "$@"; do case "$arg" in *probe.cpp) exit 0;; esac; done
echo "deliberately refusing to compile: $*" >&2
exit 1
"""


@pytest.mark.parametrize("compiler", ["false", "refuses the kernels"])
def test_a_wheel_without_a_kernel_built_is_tagged_for_any_platform(tmp_path, compiler) -> None:
    """``pip wheel --no-build-isolation`` (torch importable, so the kernels are tried) where
    the compiler does not run, or fails on the kernels: the wheel holds no binary and is
    ``py3-none-any``. Calls the build hook pip calls (setuptools' legacy backend), without pip."""
    if not (REPO / "setup.py").exists():
        pytest.skip("needs the project's source tree")
    source = _source_copy(tmp_path / "source")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    if compiler != "false":
        script = tmp_path / "refusing-c++"
        script.write_text(_KERNEL_REFUSING_COMPILER)
        script.chmod(0o755)
        compiler = str(script)
    env = dict(os.environ, CXX=compiler, TORCH_GDR_CPU_VARIANTS=_build.variant(),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    hook = f"from setuptools.build_meta import __legacy__ as b; print(b.build_wheel({str(wheels)!r}))"
    built = subprocess.run([sys.executable, "-c", hook], cwd=source, env=env, capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name == "torch_gdr-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: true" in metadata and "Tag: py3-none-any" in metadata
    assert not [n for n in names if n.endswith((".so", ".pyd")) or n.endswith(_variants.METADATA_FILE)]
    assert all(f"torch_gdr/ops/cpu/csrc/{n}" in names for n in _variants.SOURCES + _variants.HEADERS)
    if compiler != "false":  # the variant's build was tried: a line when it started and when it failed
        log = built.stdout + built.stderr
        assert f"compiling the {_build.variant()!r} variant of the fused CPU kernels (1 of 1): started" in log
        assert "(1 of 1): failed after" in log


@pytest.mark.slow
def test_a_wheel_installs_the_kernels_prebuilt(tmp_path) -> None:
    if not (REPO / "setup.py").exists():
        pytest.skip("needs the project's source tree")
    source = _source_copy(tmp_path / "source")
    wheels, target, cache, work = (tmp_path / d for d in ("wheels", "site", "cache", "work"))
    for d in (wheels, target, cache, work):
        d.mkdir()
    # this CPU's variant only: the others build alike, at twice the time
    env = dict(os.environ, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               TORCH_GDR_CPU_VARIANTS=_build.variant())
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(source),
                            "-w", str(wheels)], env=env, cwd=work, capture_output=True, text=True, timeout=3000)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = wheels.glob("torch_gdr-*.whl")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                                str(wheel)], env=env, cwd=work, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]

    run_env = dict(os.environ, PYTHONPATH=str(target), TORCH_GDR_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    ran = subprocess.run([sys.executable, "-c", _RUN_FROM_THE_INSTALL], env=run_env, cwd=work, capture_output=True,
                         text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(result["package"]).resolve().is_relative_to(target.resolve())
    assert result["origin"] == "prebuilt", result["reason"]
    assert Path(result["module"]).resolve().is_relative_to(target.resolve())
    assert Path(result["module"]).name.startswith(f"_C_{result['variant']}.")
    assert result["o_err"] < FP32_BOUND and result["s_err"] < FP32_BOUND
    assert not any(cache.rglob("*")), "the installed wheel built into the cache"
    # the first-use build's sources ship too
    assert all((target / "torch_gdr" / "ops" / "cpu" / "csrc" / n).is_file()
               for n in _variants.SOURCES + _variants.HEADERS)
