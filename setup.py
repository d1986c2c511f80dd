"""Packaging for torch_gdr: the chunked gated delta rule as a PyTorch op.

The fused CPU kernels (C++/OpenMP, ``torch_gdr/ops/cpu/csrc``) are compiled here when torch
is importable at build time and a C++ compiler works: one extension module per
instruction-set variant (``torch_gdr.ops.cpu._C_avx512bf16``, ``_C_avx512``, ``_C_avx2``,
``_C_base`` on x86-64; ``_C_base`` elsewhere), the running CPU choosing among them. Where either is missing (pip's
build isolation hides the installed torch: install with ``--no-build-isolation`` to prebuild),
or a variant fails to compile, the install still succeeds, with a note, and the kernels are
built at first use instead. The sources ship as package data in every case, so that first-use
build works from a wheel too.

``TORCH_GDR_CPU_VARIANTS``: a comma-separated subset of the variants to build (e.g. ``avx2``,
or empty for none); all of them by default, as a wheel for other machines needs (the
Makefile's editable install sets it to the variant this CPU runs). Each variant's compile
says when it starts and ends, with a line every 15 s in between (``pip -v`` shows them). A
wheel where no variant was built holds no binary and is tagged ``py3-none-any``.
"""

from __future__ import annotations

import json
import os
import pathlib
import runpy
import shlex
import subprocess
import sys
import tempfile

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1: the wheel package's, where installed
    try:
        from wheel.bdist_wheel import bdist_wheel
    except ImportError:
        bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_PACKAGE = "torch_gdr.ops.cpu"
CPU_DIR = os.path.join("torch_gdr", "ops", "cpu")
# the variants' flags and sources, shared with the first-use build (stdlib only: run by path)
VARIANTS = runpy.run_path(os.path.join(HERE, CPU_DIR, "_variants.py"))


def note(message: str) -> None:
    """A line to the build's log (pip shows it with -v, as the Makefile asks, and on failure)."""
    print(f"torch_gdr setup: {message}", file=sys.stderr, flush=True)


def compiler_problem() -> str | None:
    """Why the C++ compiler that torch's build runs ($CXX, default c++) cannot compile, or None."""
    command = shlex.split(os.environ.get("CXX") or "c++") or ["c++"]
    with tempfile.TemporaryDirectory(prefix="torch_gdr_cxx_") as tmp:
        probe = os.path.join(tmp, "probe.cpp")
        with open(probe, "w", encoding="utf-8") as f:
            f.write("int main() { return 0; }\n")
        try:
            done = subprocess.run([*command, "-c", probe, "-o", os.path.join(tmp, "probe.o")], capture_output=True,
                                  text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{' '.join(command)} does not run ({exc})"
    if done.returncode != 0:
        output = done.stderr.strip()[-500:]
        return f"{' '.join(command)} cannot compile a trivial file (status {done.returncode})" + (
            f": {output}" if output else "")
    return None


def selected_variants() -> list[str]:
    """The variants to build: ``$TORCH_GDR_CPU_VARIANTS`` where set, else every one of this machine's."""
    available = list(VARIANTS["names"]())
    wanted = os.environ.get("TORCH_GDR_CPU_VARIANTS")
    if wanted is None:
        return available
    chosen = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in available]
    if unknown:
        raise SystemExit(f"TORCH_GDR_CPU_VARIANTS: expected a comma-separated subset of {available}, got {wanted!r}")
    return chosen


def cpu_extensions() -> tuple[list, dict]:
    """The extension modules and the build_ext command, or none of either without torch."""
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as exc:  # noqa: BLE001 - no torch here means a pure-Python install
        note(f"torch is not importable at build time ({type(exc).__name__}: {exc}); the fused CPU kernels are "
             "not prebuilt and will be built at first use (to prebuild them, install with --no-build-isolation "
             "into an environment that has torch)")
        return [], {}

    sources = [os.path.join(CPU_DIR, "csrc", name) for name in VARIANTS["SOURCES"]]
    extensions = [
        CppExtension(
            name=f"{CPU_PACKAGE}.{VARIANTS['module_name'](variant)}",
            sources=sources,
            depends=[os.path.join(CPU_DIR, "csrc", name) for name in VARIANTS["HEADERS"]],
            extra_compile_args=VARIANTS["compile_flags"](variant),
            extra_link_args=list(VARIANTS["LINK_FLAGS"]),
            optional=True,  # the others still install, and so does the package without any
        )
        for variant in selected_variants()
    ]
    if not extensions:
        note("TORCH_GDR_CPU_VARIANTS names no variant: the fused CPU kernels are not prebuilt")
        return [], {}

    class BuildCpuKernels(BuildExtension):
        """torch's BuildExtension, made optional: a variant that fails to build is left out
        with a note (the kernels are then built at first use), and the variants that built
        are recorded with the torch version and the sources' hash in ``_C_build.json``."""

        def run(self) -> None:
            self.built_variants: list[str] = []
            problem = compiler_problem()
            if problem is not None:
                note(f"no working C++ compiler: {problem}; the fused CPU kernels are not prebuilt "
                     "(installing without them)")
            else:
                note(f"building the fused CPU kernels for torch {torch.__version__}, variants "
                     f"{', '.join(ext.name.rpartition('.')[2][len('_C_'):] for ext in self.extensions)} "
                     "(TORCH_GDR_CPU_VARIANTS selects them; minutes each on a loaded machine)")
                try:
                    super().run()
                except Exception as exc:  # noqa: BLE001 - the install goes on without kernels
                    note(f"building the fused CPU kernels failed ({type(exc).__name__}: {exc}); "
                         "installing without them")
            self.write_record()

        def build_extension(self, ext) -> None:
            variant = ext.name.rpartition(".")[2][len("_C_"):]
            # every variant compiles the same sources: separate object directories
            shared_temp = self.build_temp
            self.build_temp = os.path.join(shared_temp, ext.name)
            position = f"{self.extensions.index(ext) + 1} of {len(self.extensions)}"
            try:
                # a line when it starts and ends, and a heartbeat while it compiles (minutes)
                with VARIANTS["progress"](note, f"compiling the {variant!r} variant of the fused CPU kernels "
                                                f"({position})"):
                    super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001 - this variant only is left out
                note(f"the {variant!r} variant of the fused CPU kernels failed to build ({type(exc).__name__}: "
                     f"{exc}); installing without it")
            else:
                self.built_variants.append(variant)
            finally:
                self.build_temp = shared_temp

        def write_record(self) -> None:
            """``_C_build.json`` beside the modules: in the build tree (wheels) and, for an
            in-place or editable build, in the source tree too."""
            source_hash = VARIANTS["source_hash"](pathlib.Path(HERE, CPU_DIR, "csrc"))
            record = {"torch": torch.__version__, "sources": source_hash, "variants": self.built_variants,
                      "flags": {v: VARIANTS["compile_flags"](v) for v in self.built_variants}}
            targets = {os.path.join(self.build_lib, CPU_DIR)}
            if self.inplace:
                targets.add(os.path.join(HERE, CPU_DIR))
            for target in targets:
                path = os.path.join(target, VARIANTS["METADATA_FILE"])
                if not self.built_variants:
                    if os.path.exists(path):  # a record of an earlier build no longer holds
                        os.remove(path)
                    continue
                os.makedirs(target, exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(record, f, indent=1, sort_keys=True)
                    f.write("\n")
            if self.built_variants:
                note(f"built the fused CPU kernels for torch {torch.__version__}: {', '.join(self.built_variants)}")

        def get_outputs(self) -> list[str]:
            # the record is part of what the build installs (wheels and ``install --record``)
            outputs = super().get_outputs()
            if getattr(self, "built_variants", None):
                outputs.append(os.path.join(self.build_lib, CPU_DIR, VARIANTS["METADATA_FILE"]))
            return outputs

    commands: dict = {"build_ext": BuildCpuKernels}
    if bdist_wheel is not None:
        commands["bdist_wheel"] = WheelOfWhatWasBuilt
    return extensions, commands


def _holds_binary(directory: str) -> bool:
    """Whether ``directory`` holds a compiled extension module."""
    return any(name.endswith((".so", ".pyd")) for _, _, names in os.walk(directory) for name in names)


if bdist_wheel is not None:
    class WheelOfWhatWasBuilt(bdist_wheel):
        """A wheel tagged for what it holds: where no variant of the kernels was built (no
        working compiler, every variant failed) it holds no binary and is ``py3-none-any``,
        like a wheel built without torch, rather than tied to this interpreter and platform."""

        def run_command(self, command: str) -> None:
            super().run_command(command)
            # the build is installed into bdist_dir now; the tag and the WHEEL file come after
            if command == "install" and not self.root_is_pure and not _holds_binary(self.bdist_dir):
                note("no fused CPU kernel was built: the wheel holds none and is tagged py3-none-any "
                     "(the kernels are built at first use)")
                self.root_is_pure = True


ext_modules, cmdclass = cpu_extensions()

setup(
    name="torch_gdr",
    version="0.1.0",
    description="Chunked gated delta rule (Gated DeltaNet) as a PyTorch op: pure-torch and PyPTO backends",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_gdr", "torch_gdr.*"]),
    # the C++ sources, for the first-use build where no module was prebuilt or it does not fit
    package_data={CPU_PACKAGE: ["csrc/*.cpp", "csrc/*.h"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    install_requires=["torch>=2.4,<3", "einops>=0.7", "tqdm>=4.60"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "numpy"],
        "npu": ["pypto==0.2.0"],
        # the "fla" backend calls fla-core's internal chunk forward/backward, whose
        # signatures are those of 0.6.x (torch_gdr/ops/fla); tested range only
        "gpu": ["fla-core>=0.6.0,<0.7"],
        "bench": ["pytest-benchmark>=4", "transformers>=4.57"],
    },
)
