"""A pytest plugin for the engines' tests run on a CPU-only machine (tests only).

The engines' GDN tests create their tensors on ``torch.device("cuda:0")``. While each test
runs, a torch function mode maps every CUDA device argument of a torch call (factories,
``Tensor.to``, ``Tensor.cuda``) to the CPU, so the test runs unchanged on the CPU against
the stand-ins. ``torch.cuda.synchronize`` becomes a no-op. Loaded by
``bench/run_engine_tests.py`` with ``-p cuda_on_cpu``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _map(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "cuda":
        return _CPU
    if isinstance(value, str) and value.startswith("cuda"):
        return "cpu"
    return value


class CudaOnCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU; ``Tensor.cuda()`` returns the tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _map(kwargs["device"])
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                    torch.Tensor.new_full, torch.Tensor.new_tensor):
            args = tuple(_map(a) for a in args)
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _cuda_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with CudaOnCpu():
        yield


def _host_memory() -> tuple[int, int]:
    """``(available, total)`` bytes of the host's memory, from ``/proc/meminfo``."""
    fields = {}
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        for line in meminfo:
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


def _device_memory(*args: Any, **kwargs: Any) -> tuple[int, int]:
    if os.environ.get("TORCH_GDR_ENGINE_HOST_MEMORY") == "1":
        return _host_memory()
    return 0, 0


@pytest.fixture(autouse=True)
def _a_cuda_device_that_is_the_cpu(monkeypatch):
    """The CUDA queries the tests make, answered for the CPU that runs them: available, one
    device of capability 9.0 (the stand-ins' architecture), no free device memory (tests that
    need a multi-GB device allocation skip themselves) unless ``TORCH_GDR_ENGINE_HOST_MEMORY=1``
    (``run_engine_tests.py --long``): then the host's available memory, as ``/proc/meminfo``
    says when asked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", _device_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: None)
