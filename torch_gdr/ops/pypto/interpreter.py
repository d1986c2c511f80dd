"""Run a PyPTO jit kernel on CPU tensors through PyPTO 0.2.0's verify interpreter.

PyPTO's SIM mode compiles a kernel and runs a cycle cost model but computes no numbers.
Its precision tool ("pass verify") does interpret the kernel's tensor graph on the host,
and dumps each output it computes. Three changes to 0.2.0 make that a CPU backend:

1. ``JitCallableWrapper._setup_verify_data`` is replaced: stock 0.2.0 copies the inputs
   through a device-to-host copy that copies nothing without CANN, so the interpreter saw
   zeros. The replacement hands the real CPU tensors to ``SetVerifyData``.
2. The interpreter's calculator library (``pypto/lib/calculator``, a cmake + g++ build
   against the installed torch) is built once into the cache directory, keyed by the torch
   version and C++ ABI, and loaded with ctypes; stock pypto rebuilds it in every process.
3. The cost model is skipped for kernels run here (it only writes performance traces).

Only the tensor graph is interpreted (``pass_verify_pass_filter=[]``); the per-pass
re-interpretation is a compiler self-check, ten times slower, and adds nothing to the
result. Each call dumps into a temporary directory that is removed afterwards.

The patches only change kernels that opt in (see :func:`mark_for_interpreter`); stock
SIM mode (used for the cost model) is left as it was.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torch_gdr._paths import cache_dir

from ._env import import_pypto, redirected_output, scratch_dir

_INTERPRET_FLAG = "_torch_gdr_interpret"
_lock = threading.RLock()
_patched = False


def _calculator_dir() -> Path:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return cache_dir() / "calculator" / f"torch-{torch.__version__}-cxx11abi{abi}"


def load_calculator() -> None:
    """Build pypto's calculator library once into the cache (about 30-45 s), then load it.

    The first build needs cmake and a C++ compiler (pypto compiles it against torch's headers).

    Builds in a temporary folder and renames it into place, so a crashed or concurrent
    build never leaves a half-built library behind.
    """
    import_pypto()
    from pypto._utils import BuildOnlineManager

    with _lock:
        _build_and_load_calculator(BuildOnlineManager())


def _build_and_load_calculator(manager: Any) -> None:
    if manager.calculator_loaded:
        return
    target = _calculator_dir()
    library = target / "install" / "lib" / "libtile_fwk_calculator.so"
    if not library.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="build_", dir=target.parent))
        try:
            cmake = manager._CMakeContext()
            build = manager._CMakeContext.CompileContext(
                src_dir=Path(manager.pkg_lib_dir, "calculator"), tmp_dir=staging
            )
            # Not pypto's _TorchContext: it rebinds os.environ to a plain dict, after which
            # environment changes no longer reach pypto's C++ side.
            build.cfg_cmd_ext = (
                f"-DPY3_MOD_TORCH_VERSION={torch.__version__}"
                f" -DPY3_MOD_TORCH_ROOT_PATH={Path(torch.__file__).parent}"
                f" -DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
            )
            build.build_job_num = os.cpu_count() or 2
            cmake.compile(build)
            shutil.rmtree(staging / "build", ignore_errors=True)
            try:
                staging.rename(target)
            except OSError:  # another process won the race
                pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    manager.calculator_loaded = True


def _install_patches() -> None:
    global _patched
    with _lock:
        if _patched:
            return
        pypto = import_pypto()
        from pypto import pypto_impl
        from pypto.frontend.parser import entry
        from pypto.runtime import _pto_verify_datas

        wrapper_cls = entry.JitCallableWrapper
        stock_run_with_cpu = wrapper_cls._run_with_cpu

        def setup_verify_data_from_cpu_tensors(pto_tensors: Sequence[Any]) -> None:
            if not pypto.get_verify_options().get("enable_pass_verify"):
                return
            load_calculator()
            datas = [pypto_impl.DeviceTensorData(t.dtype, t.data_ptr, list(t.ori_shape)) for t in pto_tensors]
            pypto_impl.SetVerifyData(datas, [], _pto_verify_datas.get_data())

        def run_with_cpu(self: Any, in_tensors: list[Any], out_tensors: list[Any]) -> None:
            if getattr(self, _INTERPRET_FLAG, False):
                return  # interpreter kernels: the cost model would only write traces
            stock_run_with_cpu(self, in_tensors, out_tensors)

        wrapper_cls._setup_verify_data = staticmethod(setup_verify_data_from_cpu_tensors)
        wrapper_cls._run_with_cpu = run_with_cpu
        _patched = True


def mark_for_interpreter(kernel: Any) -> Any:
    """Flag a ``pypto.frontend.jit`` kernel (built in SIM run mode) to run through the interpreter."""
    setattr(kernel, _INTERPRET_FLAG, True)
    return kernel


def _read_dump(verify_dir: Path, arg_index: int, out: torch.Tensor) -> None:
    pattern = str(verify_dir / "tensor_graph" / f"tensor_graph~{arg_index}~*.data")
    files = sorted(f for f in glob.glob(pattern) if "~golden~" not in f)
    if not files:
        raise RuntimeError(f"the PyPTO interpreter wrote no result for kernel argument {arg_index}")
    raw = bytearray(Path(files[-1]).read_bytes())
    expected = out.numel() * out.element_size()
    if len(raw) != expected:
        raise RuntimeError(f"interpreter dump of argument {arg_index} has {len(raw)} bytes, expected {expected}")
    out.copy_(torch.frombuffer(raw, dtype=out.dtype).reshape(out.shape))


def run_kernel(
    kernel: Any,
    tensors: Sequence[torch.Tensor],
    output_indices: Sequence[int],
    *scalar_args: Any,
) -> None:
    """Call ``kernel(*tensors, *scalar_args)`` through the interpreter, filling the outputs in place.

    Args:
        kernel: a ``pypto.frontend.jit`` kernel built in SIM run mode.
        tensors: every tensor argument of the kernel, contiguous CPU tensors, in order.
        output_indices: positions in ``tensors`` of the outputs, which receive the results.
        scalar_args: the kernel's non-tensor arguments, if any.

    Safe to call repeatedly (and from several threads: calls are serialised, since PyPTO's
    verify state is global).
    """
    pypto = import_pypto()
    _install_patches()
    load_calculator()
    mark_for_interpreter(kernel)
    for i, t in enumerate(tensors):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"kernel argument {i} must be a contiguous CPU tensor")
    with _lock, scratch_dir("interp_") as scratch:
        verify_dir = scratch / "verify"
        kernel._verify_options = {
            "enable_pass_verify": True,
            "pass_verify_save_tensor_dir": str(verify_dir),
            "pass_verify_pass_filter": [],
        }
        goldens: list[torch.Tensor | None] = [None] * len(tensors)
        for i in output_indices:
            goldens[i] = torch.zeros_like(tensors[i])  # a placeholder: the result is computed
        pypto.set_verify_golden_data(goldens=goldens)
        try:
            with redirected_output(scratch / "output"):
                kernel(*tensors, *scalar_args)
        finally:
            pypto.set_verify_options(enable_pass_verify=False)
        runs = sorted(Path(p) for p in glob.glob(str(verify_dir / "verify_*")))
        if not runs:
            raise RuntimeError("the PyPTO interpreter produced no verify folder")
        for i in output_indices:
            _read_dump(runs[-1], i, tensors[i])


def launch(kernel: Any, tensors: Sequence[torch.Tensor], output_indices: Sequence[int]) -> None:
    """Run ``kernel`` on its tensor arguments where they live: on an Ascend NPU pypto launches
    it on the current stream (run mode NPU); on the CPU it runs through the interpreter
    (:func:`run_kernel`), filling the outputs in place. Other devices raise ``ValueError``."""
    device_type = tensors[0].device.type
    if device_type == "npu":
        kernel(*tensors)
    elif device_type == "cpu":
        run_kernel(kernel, tensors, output_indices)
    else:
        raise ValueError(f"the PyPTO backend runs on 'npu' or 'cpu' tensors, not {device_type!r}")
